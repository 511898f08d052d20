"""Placement sync's wire format: JSON entries with their age, placed_at on the receiver's clock, the
router's own messages ignored, anything malformed dropped (never unpickled, never raising)."""

from __future__ import annotations

import json
import pickle

import pytest

from pdserve.placement.sync import NoSync, RedisPlacementSync, create_sync, decode, encode


def test_round_trip_puts_placed_at_on_the_receivers_clock():
    raw = encode("router-a", [("d1", 0, 40, 0.010), ("p3", 900, 57, 0.0)], now_wall=1000.0)
    # received 5 ms later (wall), at monotonic 50.0: placed 10 ms + 5 ms ago, and 5 ms ago
    entries = decode(raw, "router-b", now_wall=1000.005, now_mono=50.0)
    assert [(r, p, b) for r, p, b, _ in entries] == [("d1", 0, 40), ("p3", 900, 57)]
    assert [round(50.0 - t, 6) for *_, t in entries] == [0.015, 0.005]


def test_a_clock_behind_the_senders_counts_no_negative_transit():
    raw = encode("router-a", [("d1", 0, 4, 0.0)], now_wall=1000.0)
    [(_, _, _, placed_at)] = decode(raw, "router-b", now_wall=999.0, now_mono=50.0)
    assert placed_at == 50.0


def test_own_messages_are_ignored():
    assert decode(encode("me", [("d1", 0, 4, 0.0)], 1.0), "me", 1.0, 1.0) == []


@pytest.mark.parametrize("raw", [
    b"not json",
    pickle.dumps({"v": 1}),
    json.dumps([1, 2]),
    json.dumps({"v": 2, "router": "x", "sent_at": 1.0, "entries": []}),
    json.dumps({"v": 1, "router": "x", "sent_at": 1.0, "entries": [["d1", "9", 4, 0.0]]}),
    json.dumps({"v": 1, "router": "x", "sent_at": 1.0, "entries": [["d1", -1, 4, 0.0]]}),
    json.dumps({"v": 1, "router": "x", "sent_at": 1.0, "entries": [["d1", 1, 4, -3.0]]}),
    json.dumps({"v": 1, "router": "x", "sent_at": 1.0, "entries": [["d1", 1, 4]]}),
    json.dumps({"v": 1, "router": "x", "sent_at": "soon", "entries": [["d1", 1, 4, 0.0]]}),
    json.dumps({"v": 1, "router": "x", "sent_at": 1.0, "entries": [[7, 1, 4, 0.0]]}),
])
def test_malformed_messages_are_dropped(raw):
    assert decode(raw, "me", 2.0, 2.0) is None


def test_create_sync_by_name():
    assert isinstance(create_sync("auto", None, "c", 0.002), NoSync)
    assert isinstance(create_sync("auto", "redis://127.0.0.1:1/0", "c", 0.002), RedisPlacementSync)
    assert isinstance(create_sync("none", "redis://127.0.0.1:1/0", "c", 0.002), NoSync)
    with pytest.raises(ValueError, match="needs a Redis"):
        create_sync("redis", None, "c", 0.002)
    with pytest.raises(ValueError, match="unknown placement sync"):
        create_sync("gossip", None, "c", 0.002)
