"""The sluice Python SDK: synchronous inference and asynchronous jobs over HTTP.

    from sluice.client import Client, as_completed

    client = Client("http://127.0.0.1:8000")                  # or https://..., ca_file=...
    outputs = client.infer("mlp", {"INPUT__0": x})            # numpy or torch in, numpy out
    Client(url, tensors="torch")                              # ... or torch tensors out
    job = client.submit("mlp", {"INPUT__0": x}, job_id="a1")  # returns at once
    job.status()                                              # "queued" | "done" | "failed"
    outputs = job.result(timeout_s=30)                        # or job.result(30)
    every = job.responses(timeout_s=30)                       # a decoupled model's, in order
    for job in as_completed([client.submit(...) for ...]): ...

`AsyncClient` offers the same with `await`; `RedisClient` submits jobs straight to Redis.
Errors are typed exceptions (`sluice.client.errors`)
carrying the server's status code and message. Tensors travel in Triton's binary extension.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson

from . import errors
from ._http import AsyncTransport, Endpoint, SyncTransport
from ._wire import (
    Tensorish,
    TensorKind,
    as_kind,
    decode_job_responses,
    decode_response,
    encode_request,
)
from .direct import RedisClient, RedisJob
from .errors import JobTimeout, SluiceClientError

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "Job",
    "RedisClient",
    "RedisJob",
    "SluiceClientError",
    "as_completed",
    "errors",
]

#: the longest single long-poll the server allows; longer waits poll again.
_POLL_S = 30.0
Outputs = dict[str, Any]  # numpy arrays, or torch tensors with tensors="torch"


def _model_path(model: str, version: str | int | None, action: str) -> str:
    versioned = f"/versions/{version}" if version is not None else ""
    return f"/v2/models/{model}{versioned}/{action}"


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _status(response: tuple[int, dict[str, str], bytes]) -> str:
    status, headers, body = response
    if status == 202:
        return str(orjson.loads(body)["status"])
    if status == 200:
        return "done"
    decode_response(status, headers, body)  # raises the typed error (404, ...)
    return "failed"


def _cancelled(response: tuple[int, dict[str, str], bytes]) -> bool:
    """True if the gateway cancelled the job; False if it had already finished (409)."""
    status, headers, body = response
    if status == 409:
        return False
    if status >= 400:
        decode_response(status, headers, body)  # raises the typed error (404, ...)
    return True


def _last(responses: list[Outputs]) -> Outputs:
    """A job's result: its last response's outputs (none for a decoupled job that sent none)."""
    return responses[-1] if responses else {}


def _next_wait_s(deadline_s: float | None) -> float:
    if deadline_s is None:
        return _POLL_S
    return max(0.0, min(_POLL_S, deadline_s - time.monotonic()))


class Client:
    """Blocking client for one sluice gateway (or any KServe v2 server for `infer`)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        timeout_s: float = 300.0,
        auth_token: str | None = None,
        tensors: TensorKind = "numpy",
        ca_file: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`https://` URLs use TLS with the system's CAs, or `ca_file`'s, or `ssl_context`;
        port 443 by default (8000 for http:// or no scheme)."""
        self._http = SyncTransport(
            Endpoint(url, ca_file, ssl_context), timeout_s, _auth(auth_token)
        )
        self._tensors = tensors

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Tensorish],
        *,
        outputs: list[str] | None = None,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> Outputs:
        body, headers = encode_request(inputs, outputs, None, parameters)
        return as_kind(
            decode_response(
                *self._http.request("POST", _model_path(model, version, "infer"), body, headers)
            ),
            self._tensors,
        )

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Tensorish],
        *,
        job_id: str | None = None,
        outputs: list[str] | None = None,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> Job:
        """Queue a job and return at once; `job_id` makes resubmission idempotent."""
        body, headers = encode_request(inputs, outputs, job_id, parameters)
        status, response_headers, data = self._http.request(
            "POST", _model_path(model, version, "jobs"), body, headers
        )
        if status != 202:
            decode_response(status, response_headers, data)
        return Job(self, str(orjson.loads(data)["id"]))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Job:
    """A submitted job; ask it for its status, result, or to cancel."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def status(self) -> str:
        return _status(self.client._http.request("GET", f"/v2/jobs/{self.id}"))

    def result(self, timeout_s: float | None = None) -> Outputs:
        """Wait for the outputs (long-polling the gateway), at most `timeout_s` seconds (None:
        no limit); raises the job's error if it failed. A decoupled model's job: its last
        response's (`responses` gives them all)."""
        return _last(self.responses(timeout_s))

    def responses(self, timeout_s: float | None = None) -> list[Outputs]:
        """Wait for the job to finish, at most `timeout_s` seconds (None: no limit): every
        response of a decoupled model's job in order (zero or more), an ordinary job's one;
        raises the job's (or a response's) error."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = _next_wait_s(deadline_s)
            status, headers, body = self.client._http.request(
                "GET", f"/v2/jobs/{self.id}?wait={wait_s:.3f}", timeout_s=wait_s + 30
            )
            if status != 202:
                decoded = decode_job_responses(status, headers, body)
                return [as_kind(outputs, self.client._tensors) for outputs in decoded]
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise JobTimeout(f"job {self.id} not finished after {timeout_s} s")

    def cancel(self) -> bool:
        """True if cancelled; False if it had already finished."""
        return _cancelled(self.client._http.request("DELETE", f"/v2/jobs/{self.id}"))


def as_completed(jobs: Iterable[Job], timeout_s: float | None = None) -> Iterator[Job]:
    """Yield jobs as they finish (done or failed), like concurrent.futures.as_completed;
    JobTimeout once `timeout_s` seconds passed with some not finished (None: no limit)."""
    remaining = list(jobs)
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    while remaining:
        for job in list(remaining):
            if job.status() != "queued":
                remaining.remove(job)
                yield job
        if remaining:
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise JobTimeout(f"{len(remaining)} jobs not finished after {timeout_s} s")
            head = remaining[0]  # block on one job instead of spinning over all
            head.client._http.request("GET", f"/v2/jobs/{head.id}?wait=1", timeout_s=31)


class AsyncClient:
    """The asyncio flavour of `Client`: the same methods, awaited."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        timeout_s: float = 300.0,
        auth_token: str | None = None,
        tensors: TensorKind = "numpy",
        ca_file: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """As `Client`'s: TLS for `https://` URLs."""
        self._http = AsyncTransport(
            Endpoint(url, ca_file, ssl_context), timeout_s, _auth(auth_token)
        )
        self._tensors = tensors

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Tensorish],
        *,
        outputs: list[str] | None = None,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> Outputs:
        body, headers = encode_request(inputs, outputs, None, parameters)
        response = await self._http.request(
            "POST", _model_path(model, version, "infer"), body, headers
        )
        return as_kind(decode_response(*response), self._tensors)

    async def submit(
        self,
        model: str,
        inputs: Mapping[str, Tensorish],
        *,
        job_id: str | None = None,
        outputs: list[str] | None = None,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> AsyncJob:
        body, headers = encode_request(inputs, outputs, job_id, parameters)
        status, response_headers, data = await self._http.request(
            "POST", _model_path(model, version, "jobs"), body, headers
        )
        if status != 202:
            decode_response(status, response_headers, data)
        return AsyncJob(self, str(orjson.loads(data)["id"]))

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = job_id

    async def status(self) -> str:
        return _status(await self.client._http.request("GET", f"/v2/jobs/{self.id}"))

    async def result(self, timeout_s: float | None = None) -> Outputs:
        """As `Job.result`: at most `timeout_s` seconds (None: no limit)."""
        return _last(await self.responses(timeout_s))

    async def responses(self, timeout_s: float | None = None) -> list[Outputs]:
        """As `Job.responses`: at most `timeout_s` seconds (None: no limit)."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = _next_wait_s(deadline_s)
            status, headers, body = await self.client._http.request(
                "GET", f"/v2/jobs/{self.id}?wait={wait_s:.3f}", timeout_s=wait_s + 30
            )
            if status != 202:
                decoded = decode_job_responses(status, headers, body)
                return [as_kind(outputs, self.client._tensors) for outputs in decoded]
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise JobTimeout(f"job {self.id} not finished after {timeout_s} s")

    async def cancel(self) -> bool:
        return _cancelled(await self.client._http.request("DELETE", f"/v2/jobs/{self.id}"))
