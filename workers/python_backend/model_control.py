"""`pb_utils.load_model` / `unload_model`: Triton's model loading API from a model.

A model's load or unload is the fleet's desired state, as one through the repository API
(shared/model_loads.py): every worker serving the repository applies it, and a load returns
once one of them reports the model READY. As in Triton it works in explicit mode only, and a
failure raises TritonModelException with Triton's texts. The call blocks its caller; it runs on
a thread of its own with a Redis client of its own, so a model may call it from `initialize`,
`execute` or an `async def execute`, while the worker's event loop goes on loading models.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sluice.shared.errors import SluiceError, Unavailable
from sluice.shared.model_loads import load_checked, unload_checked
from sluice.shared.redis_client import REDIS_ERRORS, AsyncClient, async_client
from sluice.shared.repository_control import NOT_EXPLICIT, ControlMode
from sluice.workers.python_backend import bls
from sluice.workers.python_backend.context import current_instance_name
from sluice.workers.python_backend.errors import TritonModelException

#: how long a load waits for the fleet (as long as a BLS call waits for its answer).
LOAD_WAIT_S = 300.0

_redis_url: str | None = None
_control_mode: ControlMode = "none"


def configure(redis_url: str, control_mode: ControlMode) -> None:
    """The worker's Redis and --model-control-mode; set before the models run."""
    global _redis_url, _control_mode
    _redis_url, _control_mode = redis_url, control_mode


def load_model(model_name: str, config: str = "", files: Any = None) -> None:
    """Load (or reload) `model_name` fleet-wide, with `config` (model config JSON) and
    `files` (`{"file:1/model.py": bytes}`) overriding the repository's, as Triton's."""
    if files is not None and not isinstance(files, Mapping):
        raise TritonModelException(
            f"failed to load model '{model_name}', files should be a dictionary of file paths "
            "and file contents"
        )
    blobs = {str(path): bytes(content) for path, content in (files or {}).items()}
    _control(
        "load",
        lambda redis: load_checked(redis, model_name, config or None, blobs or None, LOAD_WAIT_S),
    )


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload `model_name` fleet-wide (with an ensemble's composing models if
    `unload_dependents`); returns at once, as Triton's does."""
    _control("unload", lambda redis: unload_checked(redis, model_name, unload_dependents))


def _control(what: str, action: Callable[[AsyncClient], Awaitable[None]]) -> None:
    caller = current_instance_name()
    try:
        if _control_mode != "explicit" or _redis_url is None:
            raise Unavailable(NOT_EXPLICIT)
        _run_apart(_redis_url, action)
        bls.forget_records()  # readiness as of now, for the model's next BLS calls
    except SluiceError as exc:
        message = exc.message
    except REDIS_ERRORS as exc:
        message = f"Redis is unreachable ({exc})"
    else:
        return
    raise TritonModelException(
        f"Failed to {what} model: Failed to process the request for model '{caller}', "
        f"message: {message}"
    )


def _run_apart(redis_url: str, action: Callable[[AsyncClient], Awaitable[None]]) -> None:
    """Run `action` to its end on a thread and event loop of its own (the caller may be on a
    running loop itself); what it raises is raised here."""
    failure: list[BaseException] = []

    async def run() -> None:
        redis = async_client(redis_url)
        try:
            await action(redis)
        finally:
            await redis.aclose()

    def thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    runner = threading.Thread(target=thread, name="model-control", daemon=True)
    runner.start()
    runner.join()
    if failure:
        raise failure[0]
