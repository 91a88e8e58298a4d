"""`pb_utils.InferenceResponseSender`: how a decoupled model answers a request, as often as it
likes and from any thread, until it sends the final flag."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sluice.workers.python_backend.errors import TritonModelException
from sluice.workers.python_backend.messages import InferenceResponse

#: Triton's TRITONSERVER_RESPONSE_COMPLETE_FINAL.
COMPLETE_FINAL = 1

#: hands one response on: (response or None for a flag-only one, final).
Deliver = Callable[[InferenceResponse | None, bool], None]


class InferenceResponseSender:
    """The response sender of one request (`request.get_response_sender()`)."""

    def __init__(self, deliver: Deliver, cancelled: Callable[[], bool]) -> None:
        self._deliver = deliver
        self._cancelled = cancelled
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send `response` (with `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` the request's
        last, which may also be None: the final flag alone)."""
        if flags not in (0, COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if response is None and flags == 0:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"Expected an 'InferenceResponse' object, found type '{type(response)}'."
            )
        final = flags == COMPLETE_FINAL
        with self._lock:
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            self._closed = final
            self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """Whether the request's client went away: the model should stop and send FINAL."""
        return self._cancelled()
