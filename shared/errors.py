"""Typed errors, each carrying the HTTP status and Triton status name it maps to.

Workers publish errors as data (code + message); the gateway turns any of these into the
KServe v2 error body `{"error": "..."}` in one place.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base class: `http_status` and `code` travel with the error across the wire."""

    http_status = 500
    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(SluiceError):
    """The request is malformed or does not match the model's inputs (Triton INVALID_ARG)."""

    http_status = 400
    code = "INVALID_ARG"


class PayloadTooLarge(SluiceError):
    """A body over --max-body-bytes, as sent or once inflated (HTTP 413)."""

    http_status = 413
    code = "INVALID_ARG"


class ModelNotFound(SluiceError):
    """An unknown model or version: Triton 2.51 answers 404 (gRPC NOT_FOUND)."""

    http_status = 404
    code = "NOT_FOUND"


class JobNotFound(SluiceError):
    http_status = 404
    code = "NOT_FOUND_JOB"


class ModelNotReady(SluiceError):
    http_status = 400
    code = "UNAVAILABLE_MODEL"


class Unauthorized(SluiceError):
    http_status = 401
    code = "UNAUTHENTICATED"


class UnknownRoute(SluiceError):
    """A path, or a method on it, that the API does not serve (HTTP 404)."""

    http_status = 404
    code = "NOT_FOUND"


class MethodNotAllowed(SluiceError):
    """A known path asked with a method it does not serve (HTTP 405, Triton's text)."""

    http_status = 405
    code = "UNAVAILABLE"

    def __init__(self) -> None:
        super().__init__("Method Not Allowed")


class Conflict(SluiceError):
    """The request is at odds with the state it acts on: a finished job cancelled (HTTP 409)."""

    http_status = 409
    code = "FAILED_PRECONDITION"


class RequestTimeout(SluiceError):
    """A request not received whole within the server's time limit (HTTP 408)."""

    http_status = 408
    code = "DEADLINE_EXCEEDED"


class HeaderFieldsTooLarge(SluiceError):
    """Too many header fields, or too many bytes of them (HTTP 431)."""

    http_status = 431
    code = "INVALID_ARG"


class Unavailable(SluiceError):
    """Queue full, timed out, or Redis unreachable (Triton UNAVAILABLE → 503).

    `retry_after_s` becomes a Retry-After header: set when the cause is passing (Redis away),
    so that clients and proxies back off instead of retrying at once.
    """

    http_status = 503
    code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutOfMemory(Unavailable):
    """Redis refused a write for memory (maxmemory, noeviction): HTTP 503, gRPC
    RESOURCE_EXHAUSTED. Nothing of the refused request was kept; it may be sent again once
    Redis has room (queues drain, jobs expire)."""

    code = "RESOURCE_EXHAUSTED"


class Cancelled(SluiceError):
    """The client went away before its request ran (Triton CANCELLED → 400)."""

    http_status = 400
    code = "CANCELLED"


class ModelExecutionError(SluiceError):
    """The model raised while computing a batch."""

    http_status = 500
    code = "INTERNAL"


class NotFound(SluiceError):
    """Something a model looked for is missing: a Python model's NOT_FOUND error (Triton: 404).
    An unknown model is ModelNotFound, a 400 as Triton answers it."""

    http_status = 404
    code = "NOT_FOUND_ENTITY"


class Unsupported(SluiceError):
    """What the server or the model does not support (Triton UNSUPPORTED: HTTP 501)."""

    http_status = 501
    code = "UNSUPPORTED"


class AlreadyExists(SluiceError):
    """Triton ALREADY_EXISTS (HTTP 400, which Triton gives codes with no better match)."""

    http_status = 400
    code = "ALREADY_EXISTS"


class UnknownError(SluiceError):
    """Triton UNKNOWN: a model's error of no given kind (HTTP 400, as Triton answers it)."""

    http_status = 400
    code = "UNKNOWN"


class ModelConfigError(SluiceError):
    """A config.pbtxt or model file that cannot be loaded; names the file and the field."""

    code = "INVALID_CONFIG"


_BY_CODE: dict[str, type[SluiceError]] = {
    cls.code: cls
    for cls in (
        InvalidInput,
        ModelNotFound,
        ModelNotReady,
        Unavailable,
        OutOfMemory,
        Cancelled,
        ModelExecutionError,
        NotFound,
        Unsupported,
        AlreadyExists,
        UnknownError,
    )
}


def error_from_code(code: str, message: str) -> SluiceError:
    """Rebuild a typed error received from a worker."""
    return _BY_CODE.get(code, SluiceError)(message)
