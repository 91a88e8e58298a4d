"""Hypothesis strategies for the HTTP fuzz tests: random bodies, near-valid infer requests
(valid drafts with one mutation), odd header lengths, paths and methods.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_from_bytes

import numpy as np
from hypothesis import strategies as st

from tests.http_fuzz_client import HEADER_LENGTH

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "BF16",
    "FP32",
    "FP64",
    "BYTES",
]
NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "BF16": np.uint16,
    "FP32": np.float32,
    "FP64": np.float64,
}
#: every model of tests/model_repo, and some that do not exist.
MODELS = ["batch8", "broken", "dtypes", "named_args", "nobatch", "varlen", "versioned"]
MODEL_NAMES = st.sampled_from([*MODELS, "missing", "", "BATCH8", "batch8 ", "..", "%2F"])
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
KEYS = [
    "inputs",
    "outputs",
    "id",
    "parameters",
    "name",
    "datatype",
    "shape",
    "data",
    "binary_data_size",
    "binary_data",
    "binary_data_output",
    "priority",
    "timeout",
    "deadline_us",
    "IN",
    "OUT",
    "x",
    "scale",
]


LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=8)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([*KEYS, *DATATYPES, *MODELS])
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=24,
)
#: bodies shaped like an infer request, so the fuzz reaches past the first checks.
INFER_LIKE = st.fixed_dictionaries(
    {"inputs": st.lists(st.dictionaries(st.sampled_from(KEYS), JSON_VALUES, max_size=6))},
    optional={"outputs": JSON_VALUES, "id": JSON_VALUES, "parameters": JSON_VALUES},
)
PRINTABLE = st.text(
    alphabet=st.sampled_from(string.ascii_letters + string.digits + " -_.+:/=,;"), max_size=24
)


def dump(value: Any, ascii_only: bool) -> bytes:
    if ascii_only:
        return json.dumps(value).encode()
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


#: the inputs of a valid request, [(name, datatype, shape, values)], for each of the quick
#: models (batching delays would slow the fuzz down).
def valid_inputs(model: str) -> list[tuple[str, str, list[int], list[Any]]]:
    if model == "nobatch":
        return [("IN", "FP32", [2, 3], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])]
    if model == "named_args":
        return [("x", "FP32", [1, 3], [1.0, 2.0, 3.0]), ("scale", "FP32", [1, 1], [3.0])]
    if model == "versioned":
        return [("IN", "INT32", [1, 1], [7])]
    values: dict[str, list[Any]] = {"BOOL": [True, False], "BYTES": ["ab", ""]}
    return [
        (f"IN_{dt}", dt, [1, 2], values.get(dt, [1, 2] if dt != "BF16" else [0x3F80, 0x4000]))
        for dt in DATATYPES
    ]


QUICK_MODELS = ["nobatch", "named_args", "versioned", "dtypes"]


def _binary(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        raw = [v.encode() for v in values]
        return b"".join(len(v).to_bytes(4, "little") + v for v in raw)
    return np.asarray(values, dtype=NUMPY[datatype]).tobytes()


@dataclass
class Draft:
    """An infer request under construction: JSON header items plus each input's binary."""

    path: str
    header: dict[str, Any]
    binaries: list[bytes | None]
    length_delta: int = 0
    length_text: str | None = None
    tail_extra: bytes = b""
    tail_cut: int = 0

    def encode(self, ascii_only: bool) -> tuple[bytes, dict[str, str]]:
        head = dump(self.header, ascii_only)
        tail = b"".join(b for b in self.binaries if b is not None) + self.tail_extra
        if self.tail_cut:
            tail = tail[: -self.tail_cut]
        headers: dict[str, str] = {}
        if tail or self.length_delta or self.length_text is not None:
            headers[HEADER_LENGTH] = self.length_text or str(len(head) + self.length_delta)
        return head + tail, headers


def make_draft(path: str, model: str, binary: list[bool]) -> Draft:
    """A valid request; `binary[i]` sends input i in binary (BF16 always is)."""
    items, binaries = [], []
    for (name, datatype, shape, values), as_binary in zip(valid_inputs(model), binary, strict=True):
        item: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if as_binary or datatype == "BF16":
            data = _binary(datatype, values)
            item["parameters"] = {"binary_data_size": len(data)}
            binaries.append(data)
        else:
            item["data"] = values
            binaries.append(None)
        items.append(item)
    return Draft(f"{path}/infer", {"inputs": items}, binaries)


@st.composite
def valid_drafts(draw: st.DrawFn) -> Draft:
    model = draw(st.sampled_from(QUICK_MODELS))
    path = f"/v2/models/{model}"
    if model == "versioned":
        path += draw(st.sampled_from(["", "/versions/1", "/versions/2"]))
    count = len(valid_inputs(model))
    draft = make_draft(path, model, draw(st.lists(st.booleans(), min_size=count, max_size=count)))
    if draw(st.booleans()):
        draft.header["id"] = draw(st.text(max_size=10))
    return draft


def _mutate(draw: st.DrawFn, draft: Draft) -> str:  # noqa: C901 (one branch per mutation)
    items: list[dict[str, Any]] = draft.header["inputs"]
    index = draw(st.integers(0, len(items) - 1))
    item = items[index]
    kind = draw(
        st.sampled_from(
            [
                "name",
                "datatype",
                "shape",
                "data",
                "binary_data_size",
                "input_parameters",
                "drop_field",
                "drop_input",
                "duplicate_input",
                "parameters",
                "outputs",
                "id",
                "length",
                "tail",
                "inputs",
            ]
        )
    )
    if kind == "name":
        item["name"] = draw(st.text(max_size=8) | st.sampled_from(KEYS) | JSON_VALUES)
    elif kind == "datatype":
        item["datatype"] = draw(st.sampled_from([*DATATYPES, "fp32", "TYPE_FP32", ""]) | LEAVES)
    elif kind == "shape":
        item["shape"] = draw(
            st.lists(st.integers(-2, 5) | st.integers(-(2**64), 2**64), max_size=4) | JSON_VALUES
        )
    elif kind == "data":
        item.pop("parameters", None)
        draft.binaries[index] = None
        item["data"] = draw(JSON_VALUES | st.lists(LEAVES, max_size=8))
    elif kind == "binary_data_size":
        item["parameters"] = {"binary_data_size": draw(LEAVES)}
    elif kind == "input_parameters":
        item["parameters"] = draw(JSON_VALUES)
    elif kind == "drop_field":
        if item:
            item.pop(draw(st.sampled_from(sorted(item))))
    elif kind == "drop_input":
        items.pop(index)
        draft.binaries.pop(index)
    elif kind == "duplicate_input":
        items.append(dict(item))
        draft.binaries.append(draft.binaries[index])
    elif kind == "parameters":
        draft.header["parameters"] = draw(
            st.dictionaries(
                st.sampled_from(
                    ["priority", "timeout", "deadline_us", "binary_data_output", "sequence_id"]
                ),
                LEAVES,
                max_size=3,
            )
            | JSON_VALUES
        )
    elif kind == "outputs":
        draft.header["outputs"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["OUT", "OUTPUT__0", "OUT_FP32", "nope"])},
                    optional={"parameters": st.dictionaries(st.just("binary_data"), LEAVES)},
                ),
                max_size=3,
            )
            | JSON_VALUES
        )
    elif kind == "id":
        draft.header["id"] = draw(JSON_VALUES)
    elif kind == "length":
        draft.length_delta = draw(st.integers(-12, 12))
        draft.length_text = draw(st.none() | PRINTABLE)
    elif kind == "tail":
        draft.tail_extra = draw(st.binary(max_size=16))
        draft.tail_cut = draw(st.integers(0, 6))
    elif kind == "inputs":
        draft.header["inputs"] = draw(JSON_VALUES)
    return kind if draft.header["inputs"] else "inputs"


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str], list[str]]:
    draft = draw(valid_drafts())
    done: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        done.append(_mutate(draw, draft))
        if done[-1] == "inputs":  # the input items are gone: nothing left to mutate
            break
    body, headers = draft.encode(draw(st.booleans()))
    return draft.path, body, headers, done


def path_segments() -> st.SearchStrategy[str]:
    words = st.sampled_from(
        [
            "v2",
            "models",
            "health",
            "live",
            "ready",
            "repository",
            "index",
            "stats",
            "config",
            "infer",
            "versions",
            "1",
            "2",
            "0",
            "03",
            "-1",
            "",
            "..",
            ".",
            *MODELS,
        ]
    )
    return (
        words
        | st.text(max_size=6).map(lambda t: quote(t, safe=""))
        | st.binary(max_size=4).map(lambda b: quote_from_bytes(b, safe=""))
    )
