"""Wire protocol: every message round-trips; every malformed input is a ProtocolError."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.hashing import hash_prefix_blocks
from common.outputs import FinishReason, TokenLogprob
from common.protocol import (
    MAX_MESSAGE_BYTES,
    Abort,
    Admitted,
    Deregister,
    Drained,
    Draining,
    Finished,
    Heartbeat,
    Job,
    KVAck,
    KVEvents,
    KVHandoff,
    KVPiece,
    KVShmHandoff,
    Message,
    Ping,
    ProtocolError,
    Queued,
    Register,
    Registered,
    Rejected,
    Reregister,
    Roster,
    ShmSegmentRef,
    Status,
    Submit,
    Survey,
    Task,
    Tokens,
    WorkerView,
    decode,
    encode,
)
from common.roles import FinishStage, WorkerRole
from common.sampling_params import SamplingParams
from common.wire import registered

PARAMS = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1234, stop=("\n\n", "###"),
                        stop_token_ids=(2, 7), logprobs=3)
PARAMS_N2 = SamplingParams(max_tokens=32, n=2)
LP = TokenLogprob(450, -0.25, ((450, -0.25), (319, -1.75)))
PROMPT = [1, 15043, 29892, 920, 526, 366, 29973, 13, 4013, 338, 263, 1243, 3142, 1058, 9157, 29889]
HASHES = hash_prefix_blocks(PROMPT, 4)

EXAMPLES: list[Message] = [
    Submit.of("req-1", PROMPT, PARAMS, "tcp://10.0.0.5:7201"),
    Submit.of("req-1", PROMPT, PARAMS, "tcp://10.0.0.5:7201", block_size=4),  # hashed by the gateway
    Job(PROMPT, PARAMS),
    Admitted("req-1"),
    Queued("req-1"),
    Rejected("req-1", 429, "server busy: 256 requests already queued", 1.0),
    Rejected("req-2", 400, "the prompt is too long"),
    Abort("req-1"),
    Abort("req-1", "peer failed"),
    Ping(42),
    Status(42, 2, 3, 7, 4096, 60.0),
    Status(43, 0, 0, 0, None, 60.0),
    Status(44, 1, 1, 0, 4096, 60.0, 16),
    Task.of("req-1", PROMPT, PARAMS, "tcp://10.0.0.5:7201"),
    Task.of("req-1", PROMPT, PARAMS, "tcp://10.0.0.5:7201", "tcp://10.0.0.9:7300"),
    Tokens("req-1", 0, 0, [450]),
    Tokens("req-1", 1, 5, [450, 4996, 2], [LP, TokenLogprob(4996, -0.5, ((4996, -0.5),)),
                                          TokenLogprob(2, float("-inf"))],
           FinishReason.STOP, 16, 8),
    Tokens("req-1", 0, 0, [], error="worker prefill-0 failed while serving the request"),
    Register("decode-0", WorkerRole.DECODE, "tcp://10.0.0.9:7300", "http://10.0.0.9:9100/metrics",
             2048, 16, 4096, "HuggingFaceTB/SmolLM2-135M-Instruct", 0.25),
    Register("prefill-0", WorkerRole.PREFILL, None, "http://10.0.0.8:9100/metrics", 1024, 16, 4096,
             "HuggingFaceTB/SmolLM2-135M-Instruct", 0.25, HASHES),
    Reregister("decode-0", lost_work=True),
    Reregister("decode-1", lost_work=False),
    Registered("decode-0"),
    Draining("prefill-0"),
    Drained("prefill-0"),
    Deregister("prefill-0"),
    Heartbeat("decode-0", 3, 1, 1500, 2048),
    Heartbeat("prefill-0", 1, 0, 900, 1024, 0.02, 1e-3, 2e-5, 4096, 1024, 3 << 20, 0),
    Survey(7),
    Roster(7, [WorkerView("prefill-0", WorkerRole.PREFILL, False, 0.1, 1, 0, 900, 1024, 64, 0,
                          4096, 1024, 3 << 20, 0, 0.02),
               WorkerView("decode-0", WorkerRole.DECODE, True, 0.3, 2, 1, 10, 2048, 0, 32,
                          0, 0, 0, 3 << 20, None)], 3),
    Roster(8, [], 0),
    Tokens("req-1", 0, 1, [450], worker_id="decode-0"),
    KVEvents("prefill-0"),
    KVEvents("prefill-0", stored=HASHES[:3], evicted=HASHES[3:], cleared=True),
    Finished("req-1", "prefill-0", FinishStage.PREFILL),
    Finished("req-1", "decode-0", FinishStage.REQUEST, error="KV transfer failed: timeout"),
    KVHandoff("xfer-1", "req-1", PROMPT, [450, 319], [LP, None],
              [None, b"\x01\x02\x03generator-state"], [True, False], PARAMS_N2,
              "tcp://10.0.0.5:7201", 8, 4, 131072, [30, 4, 3, 64, 2], "bfloat16"),
    KVHandoff("s-1/final", "req-1", list(range(40)), [450], [None], [None], [False], PARAMS,
              "tcp://10.0.0.5:7201", 0, 1, 131072, [30, 16, 3, 64, 2], "bfloat16",
              "s-1", 2, 1),  # the final transfer of a stream whose one piece held blocks 0-1
    KVPiece("s-1/0", "s-1", "req-1", 0, 0, 2, 40, 131072, [30, 16, 3, 64, 2], "bfloat16",
            "tcp://10.0.0.5:7201"),
    KVShmHandoff(KVHandoff("xfer-2", "req-2", PROMPT, [450], [None], [None], [False], PARAMS,
                           "tcp://10.0.0.5:7201", 0, 4, 131072, [30, 4, 3, 64, 2], "bfloat16"),
                 None, ShmSegmentRef("boot-id,pid:4026531836", 4242, 17, 2 << 30, b"\x07" * 16),
                 [2 << 20, (2 << 20) + 131072, 4 << 20, 8 << 20], 12345.5),
    KVShmHandoff(None, KVPiece("s-1/0", "s-1", "req-1", 0, 0, 2, 40, 131072, [30, 16, 3, 64, 2],
                               "bfloat16", "tcp://10.0.0.5:7201"),
                 ShmSegmentRef("boot-id,pid:4026531836", 4242, 17, 2 << 30, b"\x07" * 16),
                 [2 << 20, 4 << 20], 12345.5),
    KVAck("xfer-1", True),
    KVAck("xfer-1", False, "no free blocks"),
]


def raw(*items) -> bytes:
    """Hand-built wire bytes (what a misbehaving peer might send)."""
    return msgpack.packb(list(items), use_bin_type=True)


def wire_value(value):
    """A field value as msgpack holds it: records as arrays, enums as values."""
    if isinstance(value, FinishReason | FinishStage | WorkerRole):
        return value.value
    if dataclasses.is_dataclass(value):
        return [wire_value(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list | tuple):
        return [wire_value(v) for v in value]
    return value


def fields_of(msg: Message) -> list:
    return [wire_value(getattr(msg, f.name)) for f in dataclasses.fields(msg)]


def with_field(msg: Message, name: str, value) -> bytes:
    """``msg`` on the wire with one field replaced by ``value`` (type checks bypassed)."""
    names = [f.name for f in dataclasses.fields(msg)]
    values = fields_of(msg)
    values[names.index(name)] = value
    return raw(msg.TAG, msg.VERSION, values)


# ---- round trips ----------------------------------------------------------------------

def test_every_registered_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(registered().values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message):
    data = encode(msg)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert decode(memoryview(data)) == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_wire_layout_is_tag_version_values_in_a_msgpack_array(msg: Message):
    data = encode(msg)
    assert data[0] == 0x93  # fixarray of 3: never a pickle stream (those start with 0x80)
    assert msgpack.unpackb(data, raw=False) == [msg.TAG, msg.VERSION, fields_of(msg)]


def test_bytes_fields_stay_bytes_and_strings_stay_strings():
    back = decode(encode(KVEvents("w", stored=HASHES[:2])))
    assert all(type(h) is bytes and len(h) == 16 for h in back.stored)
    assert decode(encode(Admitted("req-é"))).request_id == "req-é"


# ---- rejections ----------------------------------------------------------------------

def test_unknown_tag():
    with pytest.raises(ProtocolError, match="unknown message tag"):
        decode(raw("launch_missiles", 1, []))
    with pytest.raises(ProtocolError, match="unknown message tag"):
        decode(raw(7, 1, ["req-1"]))
    with pytest.raises(ProtocolError, match="unknown message tag"):
        decode(raw(b"admitted", 1, ["req-1"]))  # bytes, not str


@pytest.mark.parametrize("version", [0, 2, -1, "1", None])
def test_wrong_version(version):
    with pytest.raises(ProtocolError):
        decode(raw("admitted", version, ["req-1"]))


@pytest.mark.parametrize(("tag", "values"), [
    ("admitted", []),
    ("admitted", ["req-1", "extra"]),
    ("rejected", ["req-1", 429]),
    ("ping", [1, 2, 3]),
])
def test_wrong_field_count(tag, values):
    with pytest.raises(ProtocolError, match="fields"):
        decode(raw(tag, 1, values))


def test_optional_fields_must_still_be_sent():
    # Defaults exist only in Python: on the wire every field is present.
    with pytest.raises(ProtocolError, match="fields"):
        decode(raw("rejected", 1, ["req-1", 429, "busy"]))


def test_values_must_be_a_list():
    with pytest.raises(ProtocolError):
        decode(raw("admitted", 1, "req-1"))
    with pytest.raises(ProtocolError):
        decode(raw("admitted", 1, {"request_id": "req-1"}))


def test_top_level_must_be_a_three_item_array():
    for data in (msgpack.packb("admitted"), msgpack.packb(7), msgpack.packb(["admitted", 1]),
                 msgpack.packb(["admitted", 1, ["r"], 0]), msgpack.packb(None)):
        with pytest.raises(ProtocolError):
            decode(data)


SUBMIT = Submit.of("r", [1, 2], PARAMS, "tcp://x:1")
JOB = Job([1, 2], PARAMS)
HANDOFF = KVHandoff("t", "r", [1], [2], [None], [None], [False], SamplingParams(), "a", 0, 1, 8, [1, 2, 1, 1, 4], "float32")
# 40 tokens in blocks of 16: blocks 0 and 1 are full, block 2 (8 tokens) is the last
FINAL = KVHandoff("s/final", "r", list(range(40)), [2], [None], [None], [False], SamplingParams(),
                  "a", 0, 1, 8, [1, 16, 1, 1, 4], "float32", "s", 2, 2)
PIECE = KVPiece("s/1", "s", "r", 1, 1, 1, 40, 8, [1, 16, 1, 1, 4], "float32", "a")

WRONG_TYPES = [
    # (message, field, bad value)  — one per kind of mistake
    (Ping(1), "nonce", "1"),  # str where int
    (Ping(1), "nonce", True),  # bool where int
    (Ping(1), "nonce", 1.0),  # float where int
    (Ping(1), "nonce", None),  # None where not optional
    (Status(1, 1, 1, 0, 4096, 60.0), "max_model_len", 4096.5),
    (Status(1, 1, 1, 0, 4096, 60.0), "queue_timeout", "1m"),
    (Rejected("r", 429, "busy", 1.0), "status", "429"),
    (Rejected("r", 429, "busy", 1.0), "retry_after", "soon"),  # optional, but not any type
    (Admitted("r"), "request_id", 17),  # int where str
    (Admitted("r"), "request_id", b"r"),  # bytes where str
    (Admitted("r"), "request_id", None),
    (JOB, "prompt_token_ids", [1, "2"]),  # list item
    (JOB, "prompt_token_ids", [1, True]),
    (JOB, "prompt_token_ids", [1, 2.0]),
    (JOB, "prompt_token_ids", [1, None]),
    (JOB, "prompt_token_ids", 12),  # not a list
    (JOB, "prompt_token_ids", None),
    (JOB, "params", {"max_tokens": 3}),  # a record travels as an array, not a map
    (JOB, "params", None),
    (JOB, "params", [16, 1.0]),  # too few fields
    (SUBMIT, "job", [1, 2]),  # the job travels encoded, as bytes
    (SUBMIT, "block_hashes", ["0123456789abcdef"]),  # str where bytes
    (SUBMIT, "priority", None),
    (Tokens("r", 0, 0, []), "logprobs", [[-0.5, []], "x"]),
    (Tokens("r", 0, 0, [1]), "logprobs", [[1, "-0.5", []]]),
    (Tokens("r", 0, 0, [1]), "logprobs", [[1, -0.5, [[1]]]]),  # a top pair of one
    (Tokens("r", 0, 0, []), "finish_reason", "exploded"),  # not a FinishReason
    (Tokens("r", 0, 0, []), "error", 500),
    (KVEvents("w"), "stored", ["0123456789abcdef"]),  # str where bytes
    (KVEvents("w"), "stored", [None]),
    (KVEvents("w"), "cleared", 1),  # int where bool
    (KVEvents("w"), "cleared", None),
    (Register("w", WorkerRole.DECODE, "tcp://x:1", "m", 1, 16, 1024, "x", 0.25), "kv_addr", 7300),
    (Register("w", WorkerRole.DECODE, "tcp://x:1", "m", 1, 16, 1024, "x", 0.25), "role", "boss"),
    (Finished("r", "w", FinishStage.REQUEST), "stage", "halfway"),
    (HANDOFF, "generator_states", ["state"]),  # str where bytes | None
    (HANDOFF, "first_logprobs", [3]),  # int where a TokenLogprob | None
    (HANDOFF, "finished", [0]),
    (KVAck("t", True), "ok", "yes"),
]


def test_wrong_types_name_the_field():
    for msg, name, value in WRONG_TYPES:
        with pytest.raises(ProtocolError, match=rf"{msg.TAG}\.{name}"):
            decode(with_field(msg, name, value))


@pytest.mark.parametrize(("msg", "name", "value"), WRONG_TYPES,
                         ids=[f"{type(m).__name__}.{n}={v!r}" for m, n, v in WRONG_TYPES])
def test_wrong_field_type(msg: Message, name: str, value):
    assert decode(encode(msg)) == msg  # the message itself is fine ...
    with pytest.raises(ProtocolError):
        decode(with_field(msg, name, value))  # ... one bad field is not


def test_non_str_dict_keys_are_rejected_before_type_checks():
    # msgpack's strict_map_key refuses int keys while unpacking.
    data = raw("kv_events", 1, ["w", [], [], {1: 3}])
    with pytest.raises(ProtocolError):
        decode(data)


def test_int_is_accepted_where_float_is_expected():
    msg = decode(with_field(Rejected("r", 429, "busy", 1.0), "retry_after", 2))
    assert msg.retry_after == 2.0 and isinstance(msg.retry_after, float)


@pytest.mark.parametrize("data", [
    b"",
    b"\xc1",  # a byte msgpack never uses
    b"\x93\xa6submit",  # truncated
    b"\x93",
    bytes(range(256)),
    b"\x91" * 100_000,  # nested far past any stack limit
    b"GET / HTTP/1.1\r\nHost: router\r\n\r\n",
    b"\xff\xff\xff",
], ids=["empty", "reserved-byte", "truncated", "bare-array-header", "byte-ramp", "deep-nesting",
        "http", "ff"])
def test_garbage_bytes(data: bytes):
    with pytest.raises(ProtocolError):
        decode(data)


def test_message_over_the_size_limit():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    # a well-formed message is refused too once it is too big
    big = encode(Submit.of("r", [1], PARAMS, "x" * MAX_MESSAGE_BYTES))
    assert len(big) > MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(big)


def test_a_large_prompt_fits():
    prompt = list(range(30_000, 130_000))  # 100k tokens
    msg = Submit.of("r", prompt, PARAMS, "tcp://x:1")
    assert len(encode(msg)) < MAX_MESSAGE_BYTES
    assert decode(encode(msg)) == msg


# ---- nothing executes -----------------------------------------------------------------

_CALLS: list[str] = []


def _record(tag: str) -> None:
    _CALLS.append(tag)


class _Exploit:
    def __reduce__(self):
        return (_record, ("unpickled",))


def test_a_pickle_is_garbage_and_never_runs():
    _CALLS.clear()
    payload = pickle.dumps(_Exploit())
    assert pickle.loads(payload) is None and _CALLS == ["unpickled"]  # the payload is live
    _CALLS.clear()
    with pytest.raises(ProtocolError):
        decode(payload)
    with pytest.raises(ProtocolError):
        decode(pickle.dumps(Admitted("req-1")))
    assert _CALLS == []


def test_ext_types_are_rejected_in_typed_fields():
    ext = msgpack.ExtType(42, pickle.dumps(_Exploit()))
    _CALLS.clear()
    with pytest.raises(ProtocolError, match="wrong type"):
        decode(raw("admitted", 1, [ext]))
    with pytest.raises(ProtocolError):
        decode(raw(ext, 1, ["req-1"]))
    with pytest.raises(ProtocolError, match="wrong type"):
        decode(raw("job", 1, [[1, ext], params_wire()]))
    with pytest.raises(ProtocolError, match="wrong type"):
        decode(raw("job", 1, [[1], params_wire(seed=ext)]))
    with pytest.raises(ProtocolError, match="wrong type"):
        decode(with_field(SUBMIT, "job", ext))
    assert _CALLS == []


# ---- sampling params ------------------------------------------------------------------

def params_wire(**overrides) -> list:
    """SamplingParams' fields as an array on the wire, some replaced (checks bypassed)."""
    values = {f.name: wire_value(getattr(SamplingParams(), f.name))
              for f in dataclasses.fields(SamplingParams)}
    values.update(overrides)
    return list(values.values())


def test_params_travel_typed_and_come_back_equal():
    params = SamplingParams(max_tokens=None, temperature=0.0, seed=7, stop=("a", "bc"),
                            stop_token_ids=(2,), n=3, logprobs=0, ignore_eos=True)
    back = decode(encode(Task.of("r", [1], params, "tcp://x:1"))).open().params
    assert back == params and type(back) is SamplingParams
    assert back.stop == ("a", "bc") and back.stop_token_ids == (2,)  # tuples again


@pytest.mark.parametrize("override", [
    {"max_tokens": 0}, {"temperature": -0.1}, {"temperature": 101.0}, {"top_p": 0.0},
    {"top_p": 1.5}, {"top_k": -2}, {"min_p": 2.0}, {"n": 0}, {"n": 1000},
    {"presence_penalty": 3.0}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0.0},
    {"logprobs": 21}, {"logprobs": -1}, {"min_tokens": -1}, {"min_tokens": 10, "max_tokens": 5},
    {"stop": ["a"] * 17}, {"stop": [""]}, {"stop_token_ids": [-1]},
], ids=lambda p: ",".join(f"{k}={v!r}"[:30] for k, v in p.items()))
def test_params_with_invalid_values_are_refused_where_decoded(override):
    with pytest.raises(ProtocolError, match=r"job\.params"):
        decode(with_field(Job([1], SamplingParams()), "params", params_wire(**override)))


@pytest.mark.parametrize("override", [
    {"seed": "x"}, {"max_tokens": 2.5}, {"n": True}, {"ignore_eos": "yes"}, {"stop": [1, 2]},
    {"logprobs": 1.5}, {"stop_token_ids": ["eos"]}, {"temperature": "hot"},
])
def test_params_with_wrong_types_are_refused(override):
    with pytest.raises(ProtocolError, match=r"job\.params\."):
        decode(with_field(Job([1], SamplingParams()), "params", params_wire(**override)))


# ---- consistency checks: what types alone cannot say ----------------------------------

INCONSISTENT = [
    (HANDOFF, "first_logprobs", [None, None]),  # per-choice lists of different lengths
    (HANDOFF, "finished", []),
    (HANDOFF, "generator_states", [None, None]),
    (HANDOFF, "num_blocks", 2),  # 1 prompt token needs 1 block
    (HANDOFF, "num_blocks", 0),
    (HANDOFF, "layout", [1, 2]),
    (HANDOFF, "layout", [1, 0, 1, 1, 4]),  # a zero block size would divide by zero
    (HANDOFF, "kv_dtype", "int4"),  # not a cache element type
    (HANDOFF, "finished", [True]),  # nothing left to decode
    (HANDOFF, "num_cached_tokens", 5),
    (HANDOFF, "prompt_token_ids", []),
    (HANDOFF, "stream_id", "s"),  # a stream's final transfer without its pieces
    (FINAL, "num_blocks", 3),  # blocks 0-1 came as pieces: only block 2 follows
    (FINAL, "first_block", 0),  # pieces came, yet it starts at block 0
    (FINAL, "first_block", 3),  # past the prompt's last block: nothing would follow
    (FINAL, "num_pieces", 3),  # three pieces cannot have carried two blocks
    (FINAL, "num_pieces", 0),
    (FINAL, "stream_id", None),
    (FINAL, "stream_id", ""),
    (PIECE, "num_blocks", 2),  # blocks 1-2: block 2 is the prompt's last, it goes with the final
    (PIECE, "num_blocks", 0),
    (PIECE, "first_block", 0),  # piece 1 after a piece 0 of at least one block
    (PIECE, "piece", -1),
    (PIECE, "num_prompt_tokens", 32),  # 32 tokens: block 1 is the last, never a piece's
    (PIECE, "layout", [1, 16, 1, 1]),
    (PIECE, "kv_dtype", "int4"),
    (PIECE, "block_nbytes", 0),
    (PIECE, "stream_id", ""),
    (Tokens("r", 0, 0, [1, 2]), "logprobs", [[1, -0.5, []]]),  # one entry for two tokens
    (Tokens("r", 0, 0, []), "choice", -1),
    (SUBMIT, "num_prompt_tokens", -1),
    (Submit.of("r", PROMPT, PARAMS, "x", block_size=4), "block_hashes", HASHES[:3]),  # 16 tokens: 4 blocks
    (Submit.of("r", PROMPT, PARAMS, "x", block_size=4), "block_hashes", [h[:8] for h in HASHES]),
    (Submit.of("r", PROMPT, PARAMS, "x", block_size=4), "block_size", None),  # hashes, but no size
    (Submit.of("r", PROMPT, PARAMS, "x"), "block_size", 0),  # absent is None, not 0
    (Rejected("r", 429, "busy"), "status", 200),
    (Heartbeat("w", 0, 0, 5, 10), "free_blocks", 11),
    (Heartbeat("w", 0, 0, 5, 10), "prefix_hits", 1),  # more hits than queries
    (Heartbeat("w", 0, 0, 5, 10), "kv_bytes_sent", -1),
    (Register("w", WorkerRole.DECODE, "tcp://x:1", "m", 1, 16, 1024, "x", 0.25), "kv_addr", None),
    (Register("w", WorkerRole.DECODE, "tcp://x:1", "m", 1, 16, 1024, "x", 0.25), "block_size", 0),
]


@pytest.mark.parametrize(("msg", "name", "value"), INCONSISTENT,
                         ids=[f"{type(m).__name__}.{n}={v!r}"[:60] for m, n, v in INCONSISTENT])
def test_inconsistent_messages_are_refused_where_decoded(msg: Message, name: str, value):
    assert decode(encode(msg)) == msg
    with pytest.raises(ProtocolError):
        decode(with_field(msg, name, value))


# ---- property: any mutation of any message is a ProtocolError or a valid message -------

WIRE_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
              st.text(max_size=6), st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=400, deadline=None)
@given(index=st.integers(0, len(EXAMPLES) - 1), slot=st.integers(0, 20), value=WIRE_VALUES,
       drop=st.booleans())
def test_a_mutated_message_is_refused_or_still_valid(index: int, slot: int, value, drop: bool):
    msg = EXAMPLES[index]
    values = fields_of(msg)
    slot %= len(values)
    if drop:
        del values[slot]
    else:
        values[slot] = value
    try:
        back = decode(raw(msg.TAG, msg.VERSION, values))
    except ProtocolError:
        return
    assert type(back) is type(msg)
    assert encode(decode(encode(back))) == encode(back)  # consistent and re-encodable (NaN-safe)


# ---- the job inside Submit and Task ---------------------------------------------------

def test_the_gateway_states_the_header_from_the_job():
    params = SamplingParams(max_tokens=9, priority=-3)
    submit = decode(encode(Submit.of("r", PROMPT, params, "tcp://x:1", block_size=4)))
    assert (submit.num_prompt_tokens, submit.max_tokens, submit.priority) == (16, 9, -3)
    assert submit.block_hashes == HASHES and submit.open() == Job(PROMPT, params)
    assert Submit.of("r", PROMPT, params, "x").block_hashes == []  # block size unknown: not hashed


def test_a_task_carries_the_submits_job_bytes_unchanged():
    submit = Submit.of("r", PROMPT, PARAMS, "tcp://x:1", block_size=4)
    task = decode(encode(Task(submit.request_id, submit.reply_to, submit.job, "tcp://d:1")))
    assert task.job == submit.job and task.open() == Job(PROMPT, PARAMS)
    assert task == Task.of("r", PROMPT, PARAMS, "tcp://x:1", "tcp://d:1")


@pytest.mark.parametrize("job", [b"", b"\xc1", encode(Admitted("r")),
                                 raw("job", 1, [[1, "2"], params_wire()])],
                         ids=["empty", "garbage", "not-a-job", "bad-token"])
def test_a_bad_job_is_refused_where_it_is_opened(job: bytes):
    task = decode(encode(Task("r", "tcp://x:1", job)))  # the envelope itself is fine
    with pytest.raises(ProtocolError):
        task.open()
