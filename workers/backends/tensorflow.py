"""TensorFlow SavedModels (`platform: "tensorflow_savedmodel"`), as Triton's tensorflow backend
serves them.

The version folder's `model.savedmodel` is a SavedModel directory; the model runs its serving
signature (`serving_default`, or the `TF_SIGNATURE_DEF` parameter's, in the MetaGraph of the
`TF_GRAPH_TAG` parameter, default `serve`), bound by the signature's input and output keys
(tf_signature.py). The batch's inputs arrive as torch tensors in host memory and reach
TensorFlow through DLPack, without a copy where TensorFlow can read them in place; outputs come
back as numpy views of TensorFlow's own buffers.

TensorFlow's thread pools are the process's, fixed when it first runs: the first model sizes
them to the worker's torch threads (INTRA_OP_THREAD_COUNT / INTER_OP_THREAD_COUNT, else torch's
defaults), or to its own TF_NUM_INTRA_THREADS / TF_NUM_INTER_THREADS, so that TensorFlow and
torch models served side by side share the cores the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
import torch
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec
from sluice.workers.backends import newest_model_file
from sluice.workers.backends.tf_signature import (
    DEFAULT_TAG,
    TAG_PARAMETER,
    check_config,
    complete,
    read_signature,
)
from sluice.workers.instances.stacked import TensorFunction
from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_FILENAME = "model.savedmodel"
#: TensorFlow reads a tensor in place only at this alignment (its allocator's); it aborts the
#: process on a misaligned one, so those are copied.
_ALIGNMENT = 64
_THREAD_PARAMETERS = ("TF_NUM_INTRA_THREADS", "TF_NUM_INTER_THREADS")


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """The version's SavedModel, its config checked against the serving signature."""
    path = model_dir / str(version) / spec.model_filename
    signature = read_signature(path, spec.name, spec.parameters)
    check_config(spec, signature)
    configure_runtime(spec)
    placement = _placement(spec)
    try:
        with tf.device(placement):
            loaded = tf.saved_model.load(str(path), tags=[_tag(spec)])
    except Exception as exc:  # TensorFlow raises many error classes of its own
        raise ModelConfigError(f"{path}: cannot load the SavedModel: {exc}") from exc
    return SavedModelRun(loaded, signature.key, placement, [o.name for o in spec.outputs])


class SavedModelRun:
    """One instance: runs a batch through the signature's function. It holds the loaded
    SavedModel too, which owns the variables the function reads."""

    def __init__(self, loaded: Any, key: str, placement: str, outputs: list[str]) -> None:
        self._loaded = loaded
        self._function = loaded.signatures[key]
        self._placement = placement
        self._outputs = outputs

    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        feed = {name: _tf_tensor(value) for name, value in inputs.items()}
        with tf.device(self._placement):
            results = self._function(**feed)
        return {name: _numpy(results[name]) for name in self._outputs}


def complete_config(cfg: ModelConfig, model_dir: Path) -> None:
    """Triton's auto-complete from the newest version's serving signature (tf_signature)."""
    path = newest_model_file(model_dir, cfg.default_model_filename or DEFAULT_FILENAME)
    if path is None:
        return  # the scan reports the missing model
    parameters = {key: value.string_value for key, value in cfg.parameters.items()}
    complete(cfg, read_signature(path, cfg.name, parameters))


def configure_runtime(spec: ModelSpec) -> None:
    """Before TensorFlow first runs: its thread pools as torch's (or the model's TF_NUM_*
    parameters), and GPU memory taken as needed rather than all at once (Triton's default).
    Later models cannot change the pools; one that asks for others is warned about."""
    intra, inter = (_thread_count(spec, key) for key in _THREAD_PARAMETERS)
    wanted = (intra or torch.get_num_threads(), inter or torch.get_num_interop_threads())
    threading = tf.config.threading
    try:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
        threading.set_intra_op_parallelism_threads(wanted[0])
        threading.set_inter_op_parallelism_threads(wanted[1])
    except RuntimeError:  # TensorFlow already runs: its pools are set for the process
        current = (
            threading.get_intra_op_parallelism_threads(),
            threading.get_inter_op_parallelism_threads(),
        )
        if current != wanted:
            log.warning(
                "model %r: TensorFlow already runs %d intra-op and %d inter-op threads in this "
                "worker, not the %d and %d asked for (serve it from a worker of its own to "
                "honour them)",
                spec.name,
                *current,
                *wanted,
            )


def _thread_count(spec: ModelSpec, key: str) -> int:
    """A TF_NUM_*_THREADS parameter: a count >= 0 (0, or none: the worker's torch count)."""
    value = spec.parameters.get(key, "0").strip()
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ModelConfigError(
            f"parameter '{key}' must be non-negative number for TensorFlow model '{spec.name}'"
        )
    return count


def _tag(spec: ModelSpec) -> str:
    return spec.parameters.get(TAG_PARAMETER) or DEFAULT_TAG


def _placement(spec: ModelSpec) -> str:
    """The first GPU when the instance kind allows one and TensorFlow has one, else the CPU."""
    if spec.instance_kind in ("KIND_GPU", "KIND_AUTO") and tf.config.list_physical_devices("GPU"):
        return "/GPU:0"
    if spec.instance_kind == "KIND_GPU":
        log.warning("model %r asks for KIND_GPU but TensorFlow has no GPU: CPU", spec.name)
    return "/CPU:0"


def _tf_tensor(value: Any) -> Any:
    """A torch tensor shared with TensorFlow through DLPack where it is aligned and dense,
    else copied; BYTES (numpy object arrays) as TensorFlow strings."""
    if not isinstance(value, torch.Tensor):
        return tf.constant(value)
    if value.is_contiguous() and value.numel() and value.data_ptr() % _ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
    return tf.convert_to_tensor(value.numpy())


def _numpy(tensor: Any) -> Any:
    """A numpy view of a host tensor's buffer; strings and device tensors as copies."""
    if tensor.dtype == tf.string or "GPU" in tensor.device:
        return tensor.numpy()
    return np.from_dlpack(tensor)
