"""Bulk jobs as the gateway's operations: upload a file, follow its progress, fetch the results.

The HTTP routes (gateway/app.py):

    POST   /v2/models/{m}[/versions/{v}]/bulk?format=npz|npy|jsonl[&id=..]  -> 202 + Location
    GET    /v2/bulk/{id}          -> status and progress
    GET    /v2/bulk/{id}/output   -> the results file (202 with the status until it is done)
    DELETE /v2/bulk/{id}          -> stop feeding it

rq and its Redis calls are synchronous, so each call runs in a thread; none is on the infer path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from sluice.shared import bulk
from sluice.shared.bulk_arrays import MAX_BYTES
from sluice.shared.bulk_files import FORMATS
from sluice.shared.errors import InvalidInput
from sluice.shared.jobs import MAX_BULK_JOBS
from sluice.shared.redis_client import REDIS_ERRORS, UNWRITTEN, redis_failure, sync_client

T = TypeVar("T")
#: media type of an upload -> its format, when the format is not named.
FORMAT_BY_TYPE = {
    "application/x-npz": "npz",
    "application/zip": "npz",
    "application/x-npy": "npy",
    "application/x-ndjson": "jsonl",
    "application/jsonl": "jsonl",
    "application/json-lines": "jsonl",
}


@dataclass(frozen=True, slots=True)
class BulkUpload:
    """An uploaded file and how to run it, as given: checked by `BulkApi.submit`."""

    body: bytes
    #: npz, npy or jsonl; None: the one `content_type` names.
    format: str | None
    #: the media type the file was sent as (`type/subtype; parameters`).
    content_type: str = ""
    bulk_id: str | None = None
    #: requests in flight at once, as text (None: the default).
    window: str | None = None


async def _in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except REDIS_ERRORS as exc:
        raise redis_failure(exc, UNWRITTEN, "bulk jobs unavailable") from None


class BulkApi:
    def __init__(
        self,
        redis_url: str,
        max_bytes: int = MAX_BYTES,
        max_jobs: int = MAX_BULK_JOBS,
    ) -> None:
        self._url = redis_url
        self._redis: redis.Redis | None = None
        #: how far an upload's arrays may inflate (--max-body-bytes), and bulk jobs kept.
        self.max_bytes = max_bytes
        self.max_jobs = max_jobs

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:  # gateways that never see a bulk job never connect
            self._redis = sync_client(self._url)
        return self._redis

    async def submit(self, model: str, version: int | None, upload: BulkUpload) -> bulk.BulkStatus:
        media_type = upload.content_type.split(";")[0].strip()
        fmt = upload.format or FORMAT_BY_TYPE.get(media_type)
        if fmt not in FORMATS:
            raise InvalidInput(
                "bulk upload: say the file's format with '?format=npz|npy|jsonl' or a "
                f"Content-Type of {sorted(FORMAT_BY_TYPE)}"
            )
        window = upload.window or str(bulk.DEFAULT_WINDOW)
        if not (window.isascii() and window.isdecimal() and int(window) > 0):
            raise InvalidInput("'window' must be a positive number of items")
        return await _in_thread(
            bulk.submit_bulk,
            self.redis,
            model,
            upload.body,
            fmt,
            bulk_id=upload.bulk_id,
            version=version,
            window=int(window),
            max_bytes=self.max_bytes,
            max_jobs=self.max_jobs,
        )

    async def status(self, bulk_id: str) -> bulk.BulkStatus:
        return await _in_thread(bulk.bulk_status, self.redis, bulk_id)

    async def cancel(self, bulk_id: str) -> bulk.BulkStatus:
        return await _in_thread(bulk.cancel_bulk, self.redis, bulk_id)

    async def output(self, bulk_id: str) -> tuple[bulk.BulkStatus, bytes | None]:
        """The job's status, and its results file once it is done."""
        return await _in_thread(bulk.bulk_output, self.redis, bulk_id)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
