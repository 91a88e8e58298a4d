"""The module a Triton Python model imports as `triton_python_backend_utils`.

`install()` registers it under that name before a model file is imported, as Triton's stub
attaches its classes to the module at start-up. What a model may call is listed in the README
("Triton Python-backend models"); what sluice does not support raises a TritonModelException
that says so.
"""

from __future__ import annotations

import logging
import sys

from sluice.workers.python_backend import bls
from sluice.workers.python_backend.context import model_dir
from sluice.workers.python_backend.custom_metrics import Metric, MetricFamily
from sluice.workers.python_backend.errors import TritonError, TritonModelException
from sluice.workers.python_backend.messages import (
    FLAG_SEQUENCE_END,
    FLAG_SEQUENCE_START,
    RELEASE_ALL,
    RELEASE_RESCHEDULE,
    InferenceRequest,
    InferenceResponse,
)
from sluice.workers.python_backend.model_config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from sluice.workers.python_backend.model_control import load_model, unload_model
from sluice.workers.python_backend.sender import COMPLETE_FINAL, InferenceResponseSender
from sluice.workers.python_backend.tensors import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)

MODULE_NAME = "triton_python_backend_utils"

__all__ = [
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "Logger",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "install",
    "is_model_ready",
    "load_model",
    "model_dir",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = FLAG_SEQUENCE_START
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = FLAG_SEQUENCE_END
TRITONSERVER_RESPONSE_COMPLETE_FINAL = COMPLETE_FINAL
TRITONSERVER_REQUEST_RELEASE_ALL = RELEASE_ALL
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = RELEASE_RESCHEDULE
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2

_log = logging.getLogger("triton_python_backend")


class Logger:
    """Triton's model logger, onto Python logging (VERBOSE is DEBUG)."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3
    _LEVELS = {
        INFO: logging.INFO,
        WARNING: logging.WARNING,
        ERROR: logging.ERROR,
        VERBOSE: logging.DEBUG,
    }

    @staticmethod
    def log(message: str, level: int = INFO) -> None:
        _log.log(Logger._LEVELS.get(level, logging.INFO), message)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info(message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning(message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug(message)


class PreferredMemory:
    """Accepted and ignored: sluice hands every tensor over on the CPU."""

    def __init__(
        self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0
    ) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_model_dir() -> str:
    """The directory holding the running model's model.py (its version directory)."""
    current = model_dir.get()
    if current is None:
        raise TritonModelException("get_model_dir() is only available inside a model")
    return str(current)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether the fleet serves the model (the version, if given), as Triton's; an unknown
    model is not ready."""
    try:
        version = int(model_version) if model_version else 0
    except ValueError:
        raise TritonModelException(
            f"failed to convert model version '{model_version}' to an integer"
        ) from None
    return bls.is_ready(model_name, version)


def install() -> None:
    """Make `import triton_python_backend_utils` give this module."""
    sys.modules.setdefault(MODULE_NAME, sys.modules[__name__])
