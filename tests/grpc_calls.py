"""What the gRPC tests share: tritonclient.grpc inputs from numpy arrays, the status of a
refused call, an input of every datatype (their extreme values), and the wait for a cancel."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from sluice.shared import keys
from sluice.shared.datatypes import NUMPY_DTYPE
from sluice.shared.redis_client import sync_client
from tritonclient.utils import InferenceServerException


def grpc_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def status_of(err: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(err.value.status())


def _extremes(datatype: str) -> np.ndarray:
    """Two values of the datatype that a lossy path would change: its limits, or inexact
    floats, or bytes that are not text."""
    dtype = NUMPY_DTYPE[datatype]
    if datatype == "BYTES":
        return np.array([[b"hello", b"\x00\xffbin"]], np.object_)
    if datatype == "BOOL":
        return np.array([[True, False]])
    if dtype.kind == "f":
        return np.array([[1.5, -2.25]], dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, info.max]], dtype)


ARRAYS = {datatype: _extremes(datatype) for datatype in NUMPY_DTYPE if datatype != "BF16"}


def dtypes_inputs() -> list[grpcclient.InferInput]:
    inputs = [grpc_input(f"IN_{dt}", a, dt) for dt, a in ARRAYS.items()]
    inputs.append(grpc_input("IN_BF16", np.array([[1.5, -2.25]], ml_dtypes.bfloat16), "BF16"))
    return inputs


@contextlib.contextmanager
def expect_a_cancel(redis_url: str, model: str) -> Iterator[None]:
    """What runs inside must make the gateway publish a cancel for one of `model`'s requests."""
    redis = sync_client(redis_url)
    cancels = redis.pubsub()
    cancels.subscribe(keys.cancel_channel(model))
    try:
        yield
        message = None
        while message is None or message["type"] != "message":
            message = cancels.get_message(timeout=10)
            assert message is not None, f"no cancel published for {model}"
    finally:
        cancels.close()
        redis.close()
