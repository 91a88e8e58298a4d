"""A TensorFlow SavedModel's serving signature, read as Triton's tensorflow backend reads it,
and Triton's auto-complete and checks of a model's config against it.

The signature comes from `saved_model.pb` itself (the MetaGraph of the config's graph tag, the
SignatureDef of its signature key), without running TensorFlow. Tensors are named by the
signature's keys, as Triton binds them: the graph's tensor names (`serving_default_x:0`) are
not config names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from sluice.shared.datatypes import wire_to_config
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec
from sluice.workers.backends import complete_batching
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

log = logging.getLogger(__name__)

#: the graph tag and signature Triton uses when TF_GRAPH_TAG / TF_SIGNATURE_DEF are not set.
DEFAULT_TAG = "serve"
DEFAULT_SIGNATURE = "serving_default"
TAG_PARAMETER = "TF_GRAPH_TAG"
SIGNATURE_PARAMETER = "TF_SIGNATURE_DEF"
#: signature keys that are no serving signature (Triton skips them when falling back).
_NOT_SERVING = ("__saved_model_init_op", "__saved_model_train_op")
#: TensorFlow's data types as Triton's config data types (no BF16: Triton's TF backend has none).
_CONFIG_TYPES = {
    types_pb2.DT_BOOL: "TYPE_BOOL",
    types_pb2.DT_UINT8: "TYPE_UINT8",
    types_pb2.DT_UINT16: "TYPE_UINT16",
    types_pb2.DT_UINT32: "TYPE_UINT32",
    types_pb2.DT_UINT64: "TYPE_UINT64",
    types_pb2.DT_INT8: "TYPE_INT8",
    types_pb2.DT_INT16: "TYPE_INT16",
    types_pb2.DT_INT32: "TYPE_INT32",
    types_pb2.DT_INT64: "TYPE_INT64",
    types_pb2.DT_HALF: "TYPE_FP16",
    types_pb2.DT_FLOAT: "TYPE_FP32",
    types_pb2.DT_DOUBLE: "TYPE_FP64",
    types_pb2.DT_STRING: "TYPE_STRING",
}


@dataclass(frozen=True, slots=True)
class SignatureTensor:
    """One input or output of the signature: its key, config data type and shape (-1:
    unknown; rank 0 also for an unknown rank, as Triton reads it)."""

    name: str
    data_type: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Signature:
    """The serving signature a model runs: its key, inputs and outputs, sorted by key."""

    key: str
    inputs: tuple[SignatureTensor, ...]
    outputs: tuple[SignatureTensor, ...]

    def batchable(self) -> bool:
        """Every tensor has a first dim of -1 (Triton's test of the signature)."""
        return all(t.shape and t.shape[0] == -1 for t in (*self.inputs, *self.outputs))


def read_signature(path: Path, model: str, parameters: dict[str, str]) -> Signature:
    """The signature TF_SIGNATURE_DEF names (default `serving_default`) in the MetaGraph
    TF_GRAPH_TAG names (default `serve`); without that key, as Triton, the first other
    serving signature, with a warning."""
    tag = parameters.get(TAG_PARAMETER) or DEFAULT_TAG
    wanted = parameters.get(SIGNATURE_PARAMETER) or DEFAULT_SIGNATURE
    graph = next((g for g in _saved_model(path).meta_graphs if tag in g.meta_info_def.tags), None)
    if graph is None:
        raise ModelConfigError(f"unable to load model '{model}', expected '{tag}' tag")
    signatures = graph.signature_def
    key = wanted
    if key not in signatures:
        key = next((k for k in sorted(signatures) if k not in _NOT_SERVING), "")
        if not key:
            raise ModelConfigError(f"unable to load model '{model}', expected '{wanted}' signature")
        log.warning("unable to find serving signature '%s': using signature '%s'", wanted, key)
    definition = signatures[key]
    return Signature(
        key,
        tuple(_tensor(n, definition.inputs[n], "input", model) for n in sorted(definition.inputs)),
        tuple(
            _tensor(n, definition.outputs[n], "output", model) for n in sorted(definition.outputs)
        ),
    )


def _saved_model(path: Path) -> Any:
    saved = saved_model_pb2.SavedModel()
    try:
        if (path / "saved_model.pb").is_file():
            saved.ParseFromString((path / "saved_model.pb").read_bytes())
        else:
            text_format.Parse((path / "saved_model.pbtxt").read_text(encoding="utf-8"), saved)
    except (OSError, UnicodeDecodeError, text_format.ParseError) as exc:
        raise ModelConfigError(f"{path}: not a SavedModel directory: {exc}") from exc
    except Exception as exc:  # protobuf's DecodeError, raised by its C++ parser untyped
        raise ModelConfigError(f"{path}: cannot read saved_model.pb: {exc}") from exc
    return saved


def _tensor(name: str, info: Any, label: str, model: str) -> SignatureTensor:
    if info.dtype not in _CONFIG_TYPES:
        raise ModelConfigError(
            f"unable to process {label} '{name}' for '{model}', unsupported datatype "
            f"'{types_pb2.DataType.Name(info.dtype)}'"
        )
    dims = () if info.tensor_shape.unknown_rank else (d.size for d in info.tensor_shape.dim)
    return SignatureTensor(name, _CONFIG_TYPES[info.dtype], tuple(dims))


# -- auto-complete ---------------------------------------------------------------------------


def complete(cfg: ModelConfig, signature: Signature) -> None:
    """Triton's auto-complete from the signature: max_batch_size (4 when the signature and the
    config's own tensors say it batches and none is set), dynamic batching above 1, and the
    inputs or outputs the config leaves out."""
    batching = _batching(cfg, signature)
    if batching:
        complete_batching(cfg)
    for ios, tensors in ((cfg.input, signature.inputs), (cfg.output, signature.outputs)):
        if not ios:
            for tensor in tensors:
                _fill(ios.add(), tensor, batching, cfg.name)


def _batching(cfg: ModelConfig, signature: Signature) -> bool:
    """Whether the model batches: the signature can, and the config's dims, where it gives
    them, leave the batch dim out (Triton's hint for a max_batch_size of 0)."""
    if not signature.batchable():
        if cfg.max_batch_size > 0:
            raise ModelConfigError(
                f"unable to autofill for '{cfg.name}', configuration specified max-batch "
                f"{cfg.max_batch_size} but model signature does not support batching"
            )
        return False
    if cfg.max_batch_size > 0:
        return True
    batching, hinted = True, False
    pairs = ((cfg.input, signature.inputs), (cfg.output, signature.outputs))
    for ios, tensors in pairs:
        ranks = {t.name: len(t.shape) for t in tensors}
        for io in ios:
            dims = io.reshape.shape if io.HasField("reshape") else io.dims
            if not dims or io.name not in ranks:
                continue
            says = ranks[io.name] == len(dims) + 1
            if hinted and says != batching:
                raise ModelConfigError(
                    f"unable to autofill for '{cfg.name}', model tensor configurations are "
                    "contradicting each other in terms of whether batching is supported"
                )
            batching, hinted = says, True
    return batching


def _fill(io: Any, tensor: SignatureTensor, batching: bool, model: str) -> None:
    """One config tensor: dims without the batch dim; none left: `dims: [1]` reshaped to []."""
    if not tensor.shape:
        raise ModelConfigError(
            f"Unable to autofill for '{model}': the rank of model tensor '{tensor.name}' is 0 "
            "which is not supported"
        )
    io.name = tensor.name
    io.data_type = DataType.Value(tensor.data_type)
    dims = tensor.shape[1:] if batching else tensor.shape
    if dims:
        io.dims.extend(dims)
        return
    io.dims.append(1)
    io.reshape.SetInParent()


# -- checks at load --------------------------------------------------------------------------


def check_config(spec: ModelSpec, signature: Signature) -> None:
    """Triton's checks of the config against the signature, with its messages: every input
    of the signature by name, dims (a -1 of the signature matches any) and data type; each
    output (a subset) by name, exact dims and data type."""
    types = {
        (label, io.name): wire_to_config(io.datatype)
        for label, ios in (("input", spec.inputs), ("output", spec.outputs))
        for io in ios
    }
    for (_, name), data_type in types.items():
        if data_type not in _CONFIG_TYPES.values():
            raise ModelConfigError(
                f"unsupported datatype '{data_type}' for tensor '{name}' for model '{spec.name}'"
            )
    if len(signature.inputs) != len(spec.inputs):
        raise _unable(
            spec,
            f"configuration expects {len(spec.inputs)} inputs, model provides "
            f"{len(signature.inputs)}",
        )
    for label, ios, tensors in (
        ("input", spec.inputs, signature.inputs),
        ("output", spec.outputs, signature.outputs),
    ):
        by_name = {t.name: t for t in tensors}
        for io in ios:
            tensor = by_name.get(io.name)
            if tensor is None:
                raise ModelConfigError(
                    f"unexpected inference {label} '{io.name}', allowed {label}s are: "
                    + ", ".join(sorted(by_name))
                )
            if tensor.shape:
                dims = io.reshape if io.reshape is not None else io.dims
                _compare_dims(spec, tensor, list(dims), exact=label == "output")
            if types[label, io.name] != tensor.data_type:
                raise _unable(
                    spec,
                    f"configuration expects datatype {types[label, io.name]} for {label} "
                    f"'{io.name}', model provides {tensor.data_type}",
                )


def _compare_dims(spec: ModelSpec, tensor: SignatureTensor, dims: list[int], exact: bool) -> None:
    model = list(tensor.shape)
    where = f"model '{spec.name}', tensor '{tensor.name}'"
    if spec.max_batch_size > 0:  # auto-complete saw to it that model[0] is -1
        dims = [-1, *dims]
    if len(model) != len(dims) or any(
        m != c for m, c in zip(model, dims, strict=True) if exact or m != -1
    ):
        batch = (
            " (an initial batch dimension because max_batch_size > 0 followed by the explicit "
            "tensor shape, making complete shape "
            if spec.max_batch_size > 0
            else " (shape "
        )
        raise ModelConfigError(
            f"{where}: the model expects {len(model)} dimensions (shape {_shape(model)}) but the "
            f"model configuration specifies {len(dims)} dimensions{batch}{_shape(dims)})"
        )


def _shape(dims: list[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _unable(spec: ModelSpec, reason: str) -> ModelConfigError:
    return ModelConfigError(f"unable to load model '{spec.name}', {reason}")
