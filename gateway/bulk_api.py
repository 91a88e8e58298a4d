"""Bulk jobs over HTTP: upload a file, follow its progress, download the results file.

    POST   /v2/models/{m}[/versions/{v}]/bulk?format=npz|npy|jsonl[&id=..]  -> 202 + Location
    GET    /v2/bulk/{id}          -> status and progress
    GET    /v2/bulk/{id}/output   -> the results file (202 with the status until it is done)
    DELETE /v2/bulk/{id}          -> stop feeding it

rq and its Redis calls are synchronous, so each call runs in a thread; none is on the infer path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import orjson
import redis
from sluice.shared import bulk
from sluice.shared.bulk_files import FORMATS
from sluice.shared.errors import InvalidInput, JobNotFound, Unavailable
from sluice.shared.http_messages import HttpResponse
from sluice.shared.redis_client import REDIS_ERRORS, sync_client

T = TypeVar("T")
JSON = (b"content-type", b"application/json")
#: Content-Type of an upload -> its format, when `?format=` is not given.
FORMAT_BY_TYPE = {
    "application/x-npz": "npz",
    "application/zip": "npz",
    "application/x-npy": "npy",
    "application/x-ndjson": "jsonl",
    "application/jsonl": "jsonl",
    "application/json-lines": "jsonl",
}
NPZ, NDJSON = b"application/x-npz", b"application/x-ndjson"


async def _in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except REDIS_ERRORS as exc:
        raise Unavailable(f"bulk jobs unavailable: {exc}") from None


def _status_response(status: bulk.BulkStatus, code: int = 200) -> HttpResponse:
    headers = [JSON, (b"location", f"/v2/bulk/{status.id}".encode())]
    return HttpResponse(code, orjson.dumps(status.to_json()), headers)


class BulkApi:
    def __init__(self, redis_url: str) -> None:
        self._url = redis_url
        self._redis: redis.Redis | None = None

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:  # gateways that never see a bulk job never connect
            self._redis = sync_client(self._url)
        return self._redis

    async def submit(
        self, model: str, version: int | None, content_type: str, query: str, body: bytes
    ) -> HttpResponse:
        params = dict(parse_qsl(query))
        fmt = params.get("format") or FORMAT_BY_TYPE.get(content_type.split(";")[0].strip())
        if fmt not in FORMATS:
            raise InvalidInput(
                "bulk upload: say the file's format with '?format=npz|npy|jsonl' or a "
                f"Content-Type of {sorted(FORMAT_BY_TYPE)}"
            )
        window = params.get("window", str(bulk.DEFAULT_WINDOW))
        if not (window.isascii() and window.isdecimal() and int(window) > 0):
            raise InvalidInput("'window' must be a positive number of items")
        status = await _in_thread(
            bulk.submit_bulk,
            self.redis,
            model,
            body,
            fmt,
            bulk_id=params.get("id"),
            version=version,
            window=int(window),
        )
        return _status_response(status, 202)

    async def route(self, method: str, rest: list[str]) -> HttpResponse:
        bulk_id = rest[0]
        if rest[1:] == [] and method == "GET":
            return _status_response(await _in_thread(bulk.bulk_status, self.redis, bulk_id))
        if rest[1:] == [] and method == "DELETE":
            return _status_response(await _in_thread(bulk.cancel_bulk, self.redis, bulk_id))
        if rest[1:] == ["output"] and method == "GET":
            return await self._output(bulk_id)
        raise JobNotFound(f"unknown bulk path /v2/bulk/{'/'.join(rest)}")

    async def _output(self, bulk_id: str) -> HttpResponse:
        status, data = await _in_thread(bulk.bulk_output, self.redis, bulk_id)
        if data is None:
            return _status_response(status, 202)
        jsonl = status.format == "jsonl"
        extension = "jsonl" if jsonl else "npz"
        headers = [
            (b"content-type", NDJSON if jsonl else NPZ),
            (b"content-disposition", f'attachment; filename="{bulk_id}.{extension}"'.encode()),
        ]
        return HttpResponse(200, data, headers)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
