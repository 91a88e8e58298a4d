"""Typed errors of the SDK, each carrying the server's status code and message."""

from __future__ import annotations


class SluiceClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class InvalidRequest(SluiceClientError):
    """400: bad input, unknown model, cancelled."""


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


_BY_STATUS = {
    400: InvalidRequest,
    401: Unauthorized,
    404: JobNotFound,
    409: Conflict,
    503: Unavailable,
}


def error_for_status(status: int, message: str) -> SluiceClientError:
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else InvalidRequest)
    return cls(status, message)
