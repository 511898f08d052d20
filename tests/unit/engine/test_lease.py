"""LeaseTable: grants, adoption, expiry, and the age of the oldest lease still held."""

from __future__ import annotations

import pytest

from pdserve.engine.lease import LeaseTable


def test_oldest_age_follows_the_oldest_held_lease():
    table = LeaseTable(ttl_s=30.0)
    assert table.oldest_age_s(now=100.0) == 0.0
    first = table.grant([1, 2], 20, now=100.0)
    table.grant([3], 5, now=110.0)
    assert table.oldest_age_s(now=115.0) == pytest.approx(15.0)
    table.take(first.lease_id)
    assert table.oldest_age_s(now=115.0) == pytest.approx(5.0)


def test_expired_leases_leave_the_table_and_the_age():
    table = LeaseTable(ttl_s=10.0)
    table.grant([1], 4, now=0.0)
    kept = table.grant([2], 4, now=8.0)
    gone = table.expired(now=10.0)
    assert [len(lease.block_ids) for lease in gone] == [1]
    assert list(table.leases) == [kept.lease_id]
    assert table.oldest_age_s(now=12.0) == pytest.approx(4.0)
    with pytest.raises(KeyError, match="unknown or expired"):
        table.take(gone[0].lease_id)


def test_blocks_shared_by_a_part_lease_and_the_final_lease_count_once():
    table = LeaseTable(ttl_s=30.0)
    part = table.grant([4, 5], 32, now=0.0)  # a KV part sent while prefill ran
    table.grant([4, 5, 6], 40, now=1.0)  # the request's final handoff leases every block again
    assert table.num_blocks == 3
    table.take(part.lease_id)
    assert table.num_blocks == 3
