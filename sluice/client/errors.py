"""Typed errors of the SDK, each carrying the server's status code and message."""

from __future__ import annotations


class SluiceClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class InvalidRequest(SluiceClientError):
    """400: bad input, cancelled; its subclass ModelNotFound: an unknown model or version."""


class ModelNotFound(InvalidRequest):
    """404 'Request for unknown model: ...' (Triton's status and text): no such model or version,
    or none loaded."""


class Unauthorized(SluiceClientError):
    """401: missing or wrong bearer token."""


class JobNotFound(SluiceClientError):
    """404: unknown or expired job."""


class Conflict(SluiceClientError):
    """409: the job has already finished, or its id names another request."""


class ServerError(SluiceClientError):
    """500: the model failed."""


class Unavailable(SluiceClientError):
    """503: queue full, timed out, or Redis unreachable: retry later."""


class JobTimeout(TimeoutError):
    """The job did not finish within the time the caller allowed."""


#: how the server's (and Triton's) 404 for a model begins, told from a job's 404 by it
UNKNOWN_MODEL = "Request for unknown model: "
_BY_STATUS = {
    400: InvalidRequest,
    401: Unauthorized,
    404: JobNotFound,
    409: Conflict,
    503: Unavailable,
}


def error_for_status(status: int, message: str) -> SluiceClientError:
    if status == 404 and message.startswith(UNKNOWN_MODEL):
        return ModelNotFound(status, message)
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else InvalidRequest)
    return cls(status, message)
