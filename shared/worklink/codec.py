"""msgpack encodings of the router-worker contract (pdserve.api.contract), field by field.

Arrays decode as tuples (`use_list=False`), the contract's own sequence type, so a decoded value
equals the one encoded. Nothing here executes what it reads: a malformed message is a CodecError.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgpack

from pdserve.api.contract import DecodeEvent, FallbackNotice, HandoffParams, KVPart, PrefillEvent, PrefillResult, \
    Priority, TokenBatch, WorkerRequest
from pdserve.sampling_params import params_from_dict, params_to_dict

BATCH_FIELDS = tuple(f.name for f in fields(TokenBatch))
_BATCH, _FALLBACK = 0, 1
_PART, _RESULT = 0, 1


class CodecError(ValueError):
    pass


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, use_list=False, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CodecError(f"malformed link message: {exc}") from None


def _batch_of(item: Any) -> TokenBatch:
    if not isinstance(item, tuple) or len(item) != len(BATCH_FIELDS):
        raise CodecError("malformed token batch")
    return TokenBatch(*item)


def _handoff_of(item: Any) -> HandoffParams | None:
    if item is None:
        return None
    if not isinstance(item, dict):
        raise CodecError("malformed handoff params")
    return HandoffParams.from_dict(item)


REQUEST_FIELDS = tuple(f.name for f in fields(WorkerRequest))
_TO_WIRE = {"params": params_to_dict, "priority": int, "trace": dict}
_FROM_WIRE = {"params": params_from_dict, "priority": Priority, "prompt_token_ids": tuple}


def pack_call(request: WorkerRequest, handoff: HandoffParams | None = None, first_token_id: int | None = None) -> bytes:
    """A prefill or decode call: the request (its fields in order), and for a decode after prefill its
    handoff and first token."""
    values = tuple(_TO_WIRE.get(name, _same)(getattr(request, name)) for name in REQUEST_FIELDS)
    return _pack((values, None if handoff is None else handoff.to_dict(), first_token_id))


def unpack_call(data: bytes) -> tuple[WorkerRequest, HandoffParams | None, int | None]:
    item = _unpack(data)
    if not isinstance(item, tuple) or len(item) != 3 or not isinstance(item[0], tuple) \
            or len(item[0]) != len(REQUEST_FIELDS) or not isinstance(item[0][REQUEST_FIELDS.index("params")], dict):
        raise CodecError("malformed worker call")
    try:
        values = {name: _FROM_WIRE.get(name, _same)(v) for name, v in zip(REQUEST_FIELDS, item[0])}
        return WorkerRequest(**values), _handoff_of(item[1]), item[2]
    except (TypeError, ValueError) as exc:
        raise CodecError(f"invalid worker call: {exc}") from None


def _same(value: Any) -> Any:
    return value


def pack_result(result: PrefillResult) -> bytes:
    first = tuple(getattr(result.first, name) for name in BATCH_FIELDS)
    return _pack((first, None if result.handoff is None else result.handoff.to_dict(), result.replica))


def unpack_result(data: bytes) -> PrefillResult:
    item = _unpack(data)
    if not isinstance(item, tuple) or len(item) != 3:
        raise CodecError("malformed prefill result")
    try:
        return PrefillResult(_batch_of(item[0]), _handoff_of(item[1]), item[2])
    except (TypeError, ValueError) as exc:
        raise CodecError(f"invalid prefill result: {exc}") from None


def pack_event(event: DecodeEvent) -> bytes:
    if isinstance(event, FallbackNotice):
        return _pack((_FALLBACK, event.reason, event.error))
    return _pack((_BATCH, *(getattr(event, name) for name in BATCH_FIELDS)))


def unpack_event(data: bytes) -> DecodeEvent:
    item = _unpack(data)
    if not isinstance(item, tuple) or not item:
        raise CodecError("malformed decode event")
    if item[0] == _FALLBACK and len(item) == 3:
        return FallbackNotice(item[1], item[2])
    if item[0] == _BATCH:
        return _batch_of(item[1:])
    raise CodecError("malformed decode event")


def pack_prefill_event(event: PrefillEvent) -> bytes:
    """A prefill stream's event: a KVPart (its params and the prompt's tokens) or the PrefillResult."""
    if isinstance(event, KVPart):
        return _pack((_PART, event.params.to_dict(), event.num_prompt_tokens))
    return _pack((_RESULT, pack_result(event)))


def unpack_prefill_event(data: bytes) -> PrefillEvent:
    item = _unpack(data)
    if isinstance(item, tuple) and len(item) == 2 and item[0] == _RESULT and isinstance(item[1], bytes):
        return unpack_result(item[1])
    if not (isinstance(item, tuple) and len(item) == 3 and item[0] == _PART and isinstance(item[2], int)):
        raise CodecError("malformed prefill event")
    try:
        return KVPart(_handoff_of(item[1]), item[2])
    except (TypeError, ValueError) as exc:
        raise CodecError(f"invalid KV part: {exc}") from None


def pack_stats_query(want_events: bool, cursor: tuple | None) -> bytes:
    """A routing-stats poll: whether to include the pool's KV events, and after which (epoch, seq) cursor."""
    return _pack((bool(want_events), None if cursor is None else tuple(cursor)))


def unpack_stats_query(data: bytes) -> tuple[bool, tuple | None]:
    item = _unpack(data)
    if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], bool) \
            or not (item[1] is None or (isinstance(item[1], tuple) and len(item[1]) == 2)):
        raise CodecError("malformed stats query")
    return item


def pack_stats(stats: dict[str, Any]) -> bytes:
    return _pack(stats)


def unpack_stats(data: bytes) -> dict[str, Any]:
    item = _unpack(data)
    if not isinstance(item, dict) or not all(isinstance(k, str) for k in item):
        raise CodecError("malformed routing stats")
    return item
