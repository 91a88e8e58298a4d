"""`pb_utils.TritonError` and `TritonModelException`, and Triton's codes as sluice's errors.

A model's per-request error travels as a sluice error code, so that each transport answers
it with the status Triton gives that code (HTTP: shared/errors.py; gRPC: the code's status).
"""

from __future__ import annotations

from sluice.shared.errors import (
    AlreadyExists,
    Cancelled,
    InvalidInput,
    ModelExecutionError,
    NotFound,
    SluiceError,
    Unavailable,
    UnknownError,
    Unsupported,
)


class TritonModelException(Exception):
    """What a model raises to fail a whole `execute` call (or pb_utils raises at it)."""


class TritonError:
    """An error a model answers one request with: `InferenceResponse(error=TritonError(...))`."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


_SLUICE_BY_TRITON: dict[int, type[SluiceError]] = {
    TritonError.UNKNOWN: UnknownError,
    TritonError.INTERNAL: ModelExecutionError,
    TritonError.NOT_FOUND: NotFound,
    TritonError.INVALID_ARG: InvalidInput,
    TritonError.UNAVAILABLE: Unavailable,
    TritonError.UNSUPPORTED: Unsupported,
    TritonError.ALREADY_EXISTS: AlreadyExists,
    TritonError.CANCELLED: Cancelled,
}


def to_sluice(error: TritonError) -> SluiceError:
    """A model's error as the sluice error that answers with Triton's status for its code."""
    return _SLUICE_BY_TRITON.get(error.code(), UnknownError)(error.message())


def from_sluice_code(code: str, message: str) -> TritonError:
    """A sluice error (a BLS call's result) as the TritonError a model sees."""
    for triton_code, cls in _SLUICE_BY_TRITON.items():
        if cls.code == code:
            return TritonError(message, triton_code)
    if code.startswith("NOT_FOUND"):
        return TritonError(message, TritonError.NOT_FOUND)
    if code.startswith("UNAVAILABLE"):
        return TritonError(message, TritonError.UNAVAILABLE)
    return TritonError(message, TritonError.INTERNAL)
