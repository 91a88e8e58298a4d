"""The gateway <-> worker wire format (shared/protocol.py): round trips, zero copy, rejection."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
)
from sluice.shared.protocol import (
    SCHEMA,
    ProtocolError,
    Request,
    Result,
    Tensor,
    decode_requests,
    decode_results,
    encode_requests,
    encode_results,
)

Fields = dict[bytes, bytes]


def as_redis(fields: dict[str, bytes]) -> Fields:
    """What redis-py hands back for an entry written with str field names."""
    return {key.encode(): value for key, value in fields.items()}


def tensor(name: str, array: np.ndarray, datatype: str) -> Tensor:
    return Tensor(name, datatype, tuple(array.shape), array.tobytes())


def raw_entry(items: Any, blob: bytes = b"", schema: Any = SCHEMA) -> Fields:
    return {b"h": msgpack.packb([schema, items]), b"d": blob}


def request_item(heads: Any, **overrides: Any) -> list[Any]:
    item = {
        "id": "r1",
        "version": 1,
        "enqueue_ns": 5,
        "reply_to": "replies:g1",
        "heads": heads,
        "outputs": None,
        "params": {},
    }
    item.update(overrides)
    return list(item.values())


FP32 = np.arange(12, dtype="<f4").reshape(3, 4) / 3
INT64 = np.array([[-(2**62), 7]], dtype="<i8")
UINT8 = np.array([0, 1, 255], dtype="<u1")
BOOL = np.array([[True, False], [False, True]])
FP16 = np.array([1.5, -2.25, 65504.0], dtype="<f2")
WORDS = [b"hello", b"", "w\u00f6rld".encode(), b"\x00\xff"]


def sample_requests() -> list[Request]:
    return [
        Request(
            "req-1",
            1,
            1_700_000_000_000_000_001,
            "replies:gw-a",
            [tensor("A", FP32, "FP32"), tensor("B", INT64, "INT64")],
            None,
            {},
        ),
        Request(
            "req-2",
            0,
            42,
            "replies:gw-a",
            [
                tensor("FLAGS", BOOL, "BOOL"),
                Tensor("TEXT", "BYTES", (1, 4), serialize_bytes_elements(WORDS)),
                tensor("H", FP16, "FP16"),
            ],
            ("OUT0", "OUT1"),
            {"priority": 2, "timeout": 1500, "tag": "x", "flag": True},
        ),
        Request("req-3", 3, 43, "replies:gw-b", [tensor("U", UINT8, "UINT8")], (), {}),
    ]


# --- requests ------------------------------------------------------------------------------


def test_request_round_trip_keeps_every_field() -> None:
    original = sample_requests()
    decoded = decode_requests(as_redis(encode_requests(original)))
    assert len(decoded) == 3
    for got, want in zip(decoded, original, strict=True):
        assert (got.id, got.version, got.enqueue_ns, got.reply_to) == (
            want.id,
            want.version,
            want.enqueue_ns,
            want.reply_to,
        )
        assert got.outputs == want.outputs
        assert got.parameters == want.parameters
        assert [(t.name, t.datatype, t.shape) for t in got.inputs] == [
            (t.name, t.datatype, t.shape) for t in want.inputs
        ]
        for g, w in zip(got.inputs, want.inputs, strict=True):
            assert bytes(g.data) == bytes(w.data)


def test_fields_as_resp_sends_them_decode_like_a_dict() -> None:
    fields = as_redis(encode_requests(sample_requests()))
    flat = [x for pair in reversed(fields.items()) for x in pair]  # d before h: any order
    assert decode_requests(flat) == decode_requests(fields)
    results = as_redis(encode_results([Result("r", [], ("INVALID_ARG", "bad"))]))
    assert decode_results([x for pair in results.items() for x in pair]) == decode_results(results)


def test_outputs_none_and_empty_tuple_stay_distinct() -> None:
    decoded = decode_requests(as_redis(encode_requests(sample_requests())))
    assert decoded[0].outputs is None
    assert decoded[1].outputs == ("OUT0", "OUT1")
    assert decoded[2].outputs == ()


def test_parameters_dict_round_trips() -> None:
    decoded = decode_requests(as_redis(encode_requests(sample_requests())))
    assert decoded[1].parameters == {"priority": 2, "timeout": 1500, "tag": "x", "flag": True}
    assert decoded[0].parameters == {}


def test_decoded_tensors_are_views_into_the_blob() -> None:
    fields = as_redis(encode_requests(sample_requests()))
    blob = fields[b"d"]
    decoded = decode_requests(fields)
    expected = {
        "A": FP32,
        "B": INT64,
        "FLAGS": BOOL,
        "H": FP16,
        "U": UINT8,
    }
    assert [t.datatype for r in decoded for t in r.inputs] == [
        "FP32",
        "INT64",
        "BOOL",
        "BYTES",
        "FP16",
        "UINT8",
    ]
    for request in decoded:
        for t in request.inputs:
            assert isinstance(t.data, memoryview)
            assert t.data.obj is blob
    for request in decoded:
        for t in request.inputs:
            if t.name in expected:
                array = np.frombuffer(t.data, dtype=NUMPY_DTYPE[t.datatype]).reshape(t.shape)
                np.testing.assert_array_equal(array, expected[t.name])
    text = decoded[1].inputs[1]
    assert deserialize_bytes_elements(text.data) == WORDS


def test_blob_is_the_inputs_concatenated_in_header_order() -> None:
    fields = encode_requests(sample_requests())
    assert fields["d"] == b"".join(
        [
            FP32.tobytes(),
            INT64.tobytes(),
            BOOL.tobytes(),
            serialize_bytes_elements(WORDS),
            FP16.tobytes(),
            UINT8.tobytes(),
        ]
    )


def test_memoryview_of_a_typed_array_counts_bytes_not_elements() -> None:
    array = np.array([1.0, 2.0, 3.0], dtype="<f8")
    request = Request("r", 1, 0, "q", [Tensor("X", "FP64", (3,), memoryview(array))])
    decoded = decode_requests(as_redis(encode_requests([request])))
    data = decoded[0].inputs[0].data
    assert data.nbytes == 24
    np.testing.assert_array_equal(np.frombuffer(data, dtype="<f8"), array)


def test_empty_entry_and_empty_tensor() -> None:
    assert decode_requests(as_redis(encode_requests([]))) == []
    request = Request("r", 1, 0, "q", [Tensor("E", "FP32", (0, 4), b"")])
    (decoded,) = decode_requests(as_redis(encode_requests([request])))
    assert decoded.inputs[0].shape == (0, 4)
    assert bytes(decoded.inputs[0].data) == b""


# --- results -------------------------------------------------------------------------------


def test_result_round_trip_with_outputs_and_errors() -> None:
    out = np.array([[0.25, -1.0]], dtype="<f4")
    labels = serialize_bytes_elements([b"cat", b"dog"])
    results = [
        Result("req-1", [tensor("OUT0", out, "FP32"), Tensor("LABEL", "BYTES", (2,), labels)]),
        Result("req-2", [], ("INVALID_ARG", "input 'A': bad shape")),
        Result("req-3", [tensor("N", np.array([3], dtype="<i4"), "INT32")]),
    ]
    fields = as_redis(encode_results(results))
    decoded = decode_results(fields)
    assert [r.id for r in decoded] == ["req-1", "req-2", "req-3"]
    assert decoded[0].error is None
    assert decoded[1].error == ("INVALID_ARG", "input 'A': bad shape")
    assert decoded[1].outputs == []
    first = decoded[0].outputs
    assert [(t.name, t.datatype, t.shape) for t in first] == [
        ("OUT0", "FP32", (1, 2)),
        ("LABEL", "BYTES", (2,)),
    ]
    assert all(isinstance(t.data, memoryview) and t.data.obj is fields[b"d"] for t in first)
    np.testing.assert_array_equal(np.frombuffer(first[0].data, dtype="<f4").reshape(1, 2), out)
    assert deserialize_bytes_elements(first[1].data) == [b"cat", b"dog"]
    assert np.frombuffer(decoded[2].outputs[0].data, dtype="<i4").tolist() == [3]


# --- malformed entries ---------------------------------------------------------------------


def good_fields() -> Fields:
    return as_redis(encode_requests(sample_requests()))


@pytest.mark.parametrize("missing", [b"h", b"d"])
def test_missing_field(missing: bytes) -> None:
    fields = good_fields()
    del fields[missing]
    with pytest.raises(ProtocolError, match="lacks field"):
        decode_requests(fields)
    with pytest.raises(ProtocolError, match="lacks field"):
        decode_results(fields)


@pytest.mark.parametrize("schema", [0, 2, "1", None])
def test_wrong_schema_number(schema: Any) -> None:
    with pytest.raises(ProtocolError, match="schema"):
        decode_requests(raw_entry([], schema=schema))


def test_truncated_blob() -> None:
    fields = good_fields()
    fields[b"d"] = fields[b"d"][:-1]
    with pytest.raises(ProtocolError, match="runs past the end"):
        decode_requests(fields)


def test_truncated_header() -> None:
    fields = good_fields()
    fields[b"h"] = fields[b"h"][:-3]
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_requests(fields)


def test_nbytes_not_matching_the_shape() -> None:
    heads = [["X", "FP32", [2, 2], 12]]
    with pytest.raises(ProtocolError, match="do not fit shape"):
        decode_requests(raw_entry([request_item(heads)], b"\0" * 16))


def test_negative_dim_rejected() -> None:
    heads = [["X", "FP32", [-1, 2], 0]]
    with pytest.raises(ProtocolError, match="shape must be non-negative integers"):
        decode_requests(raw_entry([request_item(heads)]))


def test_unknown_datatype() -> None:
    heads = [["X", "FP128", [1], 16]]
    with pytest.raises(ProtocolError, match="bad name or datatype in tensor header"):
        decode_requests(raw_entry([request_item(heads)], b"\0" * 16))


@pytest.mark.parametrize("header", [{"a": 1}, "text", 7, None])
def test_non_list_header(header: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_requests({b"h": msgpack.packb(header), b"d": b""})


def test_items_not_a_list() -> None:
    with pytest.raises(ProtocolError, match="not a list"):
        decode_requests(raw_entry({"x": 1}))


@pytest.mark.parametrize(
    "item",
    [
        "not-a-request",
        ["too", "short"],
        request_item([], id=7),
        request_item([], reply_to=None),
        request_item([], params=[]),
        request_item("heads-not-a-list"),
        request_item([["X", "FP32", [1]]]),  # tensor header missing nbytes
        request_item([["X", "FP32", "ab", 4]]),  # shape of non-integers
    ],
)
def test_malformed_request_items(item: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_requests(raw_entry([item], b"\0" * 4))


@pytest.mark.parametrize("item", ["x", ["id-only"], ["r", "heads", None]])
def test_malformed_result_items(item: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_results(raw_entry([item]))


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\xff" * 10, b"\x92\x01", bytes(range(256)), b"\x91" * 5000],
    ids=["empty", "never-used-byte", "ff", "short-array", "all-bytes", "deep-nesting"],
)
def test_random_bytes_header(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_requests({b"h": raw, b"d": b""})


def test_oversized_header_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="too large"):
        decode_requests({b"h": b"\x90" * ((1 << 20) + 1), b"d": b""})


@pytest.mark.parametrize(
    "item",
    [
        request_item([["X", "FP32", [1], "4"]]),  # nbytes a string: `nbytes < 0` TypeError
        request_item([["X", "FP32", [1], None]]),  # nbytes None: TypeError
        request_item([["X", "BYTES", [1], 1.5]]),  # nbytes a float: slice TypeError
        request_item([["X", ["FP32"], [1], 4]]),  # unhashable datatype: TypeError
        request_item([["X", "FP32", [float("inf")], 4]]),  # int(inf): OverflowError
        request_item([], version="v"),  # int("v"): plain ValueError
        request_item([], version=None),  # int(None): TypeError
        request_item([], enqueue_ns=[1]),  # int([1]): TypeError
        request_item([], outputs=5),  # tuple(5): TypeError
    ],
    ids=[
        "nbytes-str",
        "nbytes-none",
        "nbytes-float",
        "datatype-list",
        "shape-inf",
        "version-str",
        "version-none",
        "enqueue-list",
        "outputs-int",
    ],
)
def test_wrongly_typed_request_fields_raise_protocol_error(item: Any) -> None:
    try:
        decode_requests(raw_entry([item], b"\0" * 4))
    except ProtocolError:
        return
    pytest.fail("accepted a malformed request header")


def test_wrongly_typed_result_error_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_results(raw_entry([["r", [], 5]]))


# --- fuzz ----------------------------------------------------------------------------------

# Values that can appear in a msgpack header built by hand (no bin/ext: the decoder refuses those)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["FP32", "BYTES", "INT8", "x"]),
)
msgpack_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=8),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
    ),
    max_leaves=40,
)
# Near-valid request items: the right arity, each field drawn from a mix of good and bad values
tensor_heads = st.lists(
    st.tuples(
        st.one_of(st.just("X"), msgpack_values),
        st.one_of(st.sampled_from(["FP32", "UINT8", "BYTES"]), msgpack_values),
        st.one_of(st.lists(st.integers(-2, 4), max_size=3), msgpack_values),
        st.one_of(st.integers(-4, 64), msgpack_values),
    ).map(list),
    max_size=3,
)
near_valid_items = st.tuples(
    st.one_of(st.just("r"), msgpack_values),
    st.one_of(st.integers(0, 3), msgpack_values),
    st.one_of(st.integers(0, 2**63), msgpack_values),
    st.one_of(st.just("q"), msgpack_values),
    st.one_of(tensor_heads, msgpack_values),
    st.one_of(st.none(), st.lists(st.text(max_size=3), max_size=2), msgpack_values),
    st.one_of(st.just({}), msgpack_values),
).map(list)


def decode_or_protocol_error(fields: Fields) -> None:
    with contextlib.suppress(ProtocolError):
        decode_requests(fields)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_fuzz_random_bytes_never_raise_other_errors(header: bytes, blob: bytes) -> None:
    decode_or_protocol_error({b"h": header, b"d": blob})


# derandomized: a fixed set of examples per run, so the result does not depend on luck
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(msgpack_values, st.binary(max_size=64))
def test_fuzz_random_msgpack_structures_never_raise_other_errors(value: Any, blob: bytes) -> None:
    decode_or_protocol_error({b"h": msgpack.packb(value), b"d": blob})


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(msgpack_values, max_size=3), st.binary(max_size=64))
def test_fuzz_random_items_never_raise_other_errors(items: list[Any], blob: bytes) -> None:
    decode_or_protocol_error(raw_entry(items, blob))


@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    report_multiple_bugs=False,
    phases=[Phase.generate],
)
@given(st.lists(near_valid_items, min_size=1, max_size=2), st.binary(max_size=64))
def test_fuzz_near_valid_items_never_raise_other_errors(items: list[Any], blob: bytes) -> None:
    decode_or_protocol_error(raw_entry(items, blob))


def test_streamed_responses_carry_their_number_and_final_flag() -> None:
    """A decoupled request's responses add [seq, final] to their item; an ordinary result's
    item stays three long (what older readers decode)."""
    token = tensor("OUT", np.array([7], dtype="<i4"), "INT32")
    results = [
        Result("plain", [token]),
        Result("s", [token], None, 0, False),
        Result("s", [], ("INVALID_ARG", "bad token"), 1, False),
        Result("s", [], None, 2, True),
    ]
    fields = as_redis(encode_results(results))
    items = msgpack.unpackb(fields[b"h"])[1]
    assert [len(item) for item in items] == [3, 5, 5, 5]
    decoded = decode_results(fields)
    assert [(r.id, r.seq, r.final) for r in decoded] == [
        ("plain", None, True),
        ("s", 0, False),
        ("s", 1, False),
        ("s", 2, True),
    ]
    assert decoded[2].error == ("INVALID_ARG", "bad token") and decoded[3].outputs == []


@pytest.mark.parametrize("tail", [[-1, False], ["0", True], [0, 1], [True, True]])
def test_a_malformed_sequence_number_or_final_flag_is_refused(tail: list[Any]) -> None:
    with pytest.raises(ProtocolError, match="sequence number"):
        decode_results(raw_entry([["r", [], None, *tail]]))


def test_response_parameters_follow_an_items_fields_and_keep_their_types() -> None:
    """A Triton Python model's response parameters ride last on their item; a result
    without any keeps its item as it was."""
    params: dict[str, bool | int | str] = {"flag": True, "n": -3, "text": "é"}
    results = [
        Result("plain", [], parameters=params),
        Result("s", [], None, 0, False, params),
        Result("bare", []),
    ]
    fields = as_redis(encode_results(results))
    assert [len(item) for item in msgpack.unpackb(fields[b"h"])[1]] == [4, 6, 3]
    decoded = decode_results(fields)
    assert [(r.parameters, r.seq) for r in decoded] == [(params, None), (params, 0), (None, None)]
    assert type(decoded[0].parameters["flag"]) is bool  # type: ignore[index]


@pytest.mark.parametrize("params", [[1], {"x": 1.5}, {"x": None}, {"x": [1]}])
def test_response_parameters_that_are_not_names_to_bool_int_or_str_are_refused(
    params: Any,
) -> None:
    with pytest.raises(ProtocolError, match="response parameters"):
        decode_results(raw_entry([["r", [], None, params]]))
