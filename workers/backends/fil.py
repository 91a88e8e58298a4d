"""Tree models with Triton's FIL config (`backend: "fil"`): XGBoost, LightGBM, Treelite.

Triton's FIL backend reads every format through Treelite and, on CPU, predicts with Treelite's
GTIL; so does this one, with the same post-processing (fil_backend `src/tl_model.h`): a
classifier answers the class index (binary: score > `threshold`; multiclass: the arg-max),
or with `predict_proba` the per-class scores (a binary model's one score, or `[1-p, p]` when
the output has two columns); a regressor answers its value. The fixed tensors are `input__0`
(FP32, `[n_features]`) and `output__0` (FP32). On a GPU, Triton runs the same forest with
cuML's FIL; here every instance runs on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import treelite
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import CONFIG_FILENAME, FIL_FILENAMES, ModelSpec
from sluice.workers.instances.stacked import TensorFunction
from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger(__name__)
_Number = TypeVar("_Number", int, float)

INPUT_NAME = "input__0"
OUTPUT_NAME = "output__0"
#: parameters Triton's FIL dropped in 25.09: it warns and ignores them (`output_class` is still
#: read, as `is_classifier`).
_REMOVED = {
    "algo": "use `layout` instead",
    "threads_per_tree": "use `chunk_size` instead",
    "output_class": "use `is_classifier` instead",
    "storage_type": "",
    "blocks_per_sm": "",
}
#: parameters that only tune cuML's FIL on a GPU; on CPU they change nothing.
_GPU_ONLY = ("layout", "chunk_size", "transfer_threshold", "use_experimental_optimizations")


@dataclass(frozen=True, slots=True)
class FilOptions:
    """The FIL parameters of a model's config, parsed and checked."""

    model_type: str
    is_classifier: bool
    predict_proba: bool
    threshold: float
    allow_unknown_field: bool
    #: Treelite's thread count per batch; -1: all cores (Triton's `cpu_nthread` default).
    nthread: int


#: builds a ModelConfigError naming a field of the model's config.pbtxt
_Errors = Callable[[str, str], ModelConfigError]


def _config_errors(config: Path) -> _Errors:
    return lambda field, message: ModelConfigError(f"{config}: {field}: {message}")


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """The forest in `<version>/<model file>` as a stacked-batch function (on CPU)."""
    err = _config_errors(model_dir / CONFIG_FILENAME)
    options = parse_options(spec.parameters, err)
    if index == 0:
        warn_about_parameters(spec.parameters)
    path = model_dir / str(version) / spec.model_filename
    forest = load_forest(path, options)
    classes = _class_count(forest, path)
    width = _check_tensors(spec, forest.num_feature, classes, options, err)
    if spec.instance_kind == "KIND_GPU" and index == 0:
        log.warning(
            "model %r: FIL models run on CPU in sluice (Treelite's GTIL); KIND_GPU is ignored",
            spec.name,
        )

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        rows = inputs[INPUT_NAME]
        data = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        scores = treelite.gtil.predict(forest, data, nthread=options.nthread)[:, 0, :]
        return {OUTPUT_NAME: fil_output(scores.astype(np.float32, copy=False), options, width)}

    return infer


def complete_config(cfg: ModelConfig, model_dir: Path) -> None:
    """Check the FIL parameters when the config is read, before its default file name is
    looked for: a wrong `model_type` is named as such, not as a missing `xgboost.model`."""
    parameters = {key: value.string_value for key, value in cfg.parameters.items()}
    parse_options(parameters, _config_errors(model_dir / CONFIG_FILENAME))


def parse_options(parameters: dict[str, str], err: _Errors) -> FilOptions:
    """Read the FIL parameters as Triton's FIL does (fil_backend `src/shared_state.h`)."""
    model_type = parameters.get("model_type") or "xgboost"
    if model_type not in FIL_FILENAMES:
        raise err(
            "parameters.model_type",
            f"'{model_type}' is not one of {', '.join(sorted(FIL_FILENAMES))}",
        )
    output_class = parameters.get("output_class", "")
    if output_class in ("true", "false"):
        is_classifier = output_class == "true"
    elif parameters.get("is_classifier"):
        is_classifier = _flag(parameters, "is_classifier", False, err)
    else:
        raise err(
            "parameters.is_classifier",
            "must be set: 'true' for a classifier, 'false' for a regressor",
        )
    threshold = _number(parameters, "threshold", float, 0.5, err)
    return FilOptions(
        model_type=model_type,
        is_classifier=is_classifier,
        predict_proba=_flag(parameters, "predict_proba", False, err),
        threshold=threshold if is_classifier else 0.5,
        allow_unknown_field=_flag(parameters, "xgboost_allow_unknown_field", False, err),
        nthread=_number(parameters, "cpu_nthread", int, -1, err),
    )


def warn_about_parameters(parameters: dict[str, str]) -> None:
    """Log what Triton's FIL logs about parameters it no longer reads, and what a CPU ignores."""
    for name, advice in _REMOVED.items():
        if parameters.get(name):
            log.warning(
                "The `%s` parameter has been removed from Triton's FIL backend%s",
                name,
                f"; {advice}" if advice else "",
            )
    ignored = [name for name in _GPU_ONLY if parameters.get(name)]
    if ignored:
        log.info("FIL parameters %s tune a GPU only: no effect on CPU", ", ".join(ignored))


def load_forest(path: Path, options: FilOptions) -> treelite.Model:
    """The model file through Treelite's loader for `model_type`, as Triton loads it."""
    if not path.is_file():
        raise ModelConfigError(f"{path}: no such model file (model_type '{options.model_type}')")
    model_type = options.model_type
    if model_type == "xgboost":
        model_type = _modern_xgboost_format(path) or model_type
    try:
        if model_type == "xgboost":
            return treelite.frontend.load_xgboost_model_legacy_binary(path)
        if model_type in ("xgboost_json", "xgboost_ubj"):
            return treelite.frontend.load_xgboost_model(
                path,
                format_choice="json" if model_type == "xgboost_json" else "ubjson",
                allow_unknown_field=options.allow_unknown_field,
            )
        if model_type == "lightgbm":
            return treelite.frontend.load_lightgbm_model(path)
        return treelite.Model.deserialize(path)
    except (treelite.TreeliteError, MemoryError, RuntimeError, ValueError, OSError) as exc:
        raise ModelConfigError(
            f"{path}: cannot load as model_type '{model_type}': {exc or type(exc).__name__}"
        ) from exc


def fil_output(scores: np.ndarray, options: FilOptions, width: int) -> np.ndarray:
    """Triton FIL's `output__0` from Treelite's scores (rows x classes, post-processed)."""
    if options.is_classifier and not options.predict_proba:
        if scores.shape[1] > 1:
            # the first class whose score beats every earlier one, starting from 0
            best = scores.argmax(axis=1)
            labels = np.where(scores.max(axis=1) > 0.0, best, 0)
        else:
            labels = scores[:, 0] > options.threshold
        return labels.astype(np.float32).reshape(-1, 1)
    if options.is_classifier and scores.shape[1] == 1 and width == 2:
        return np.concatenate([1.0 - scores, scores], axis=1)
    return scores


def _modern_xgboost_format(path: Path) -> str | None:
    """XGBoost 2.1 and later write UBJSON (or JSON) whatever the file's name: say which, so
    that a `xgboost.model` saved by them loads although it is not the legacy binary."""
    with path.open("rb") as file:
        head = file.read(64).lstrip()
    if not head.startswith(b"{"):
        return None
    found = "xgboost_json" if head[1:].lstrip().startswith(b'"') else "xgboost_ubj"
    log.warning(
        "%s: model_type 'xgboost' names XGBoost's legacy binary format, but the file is %s: "
        "loading it as model_type '%s' (set that in config.pbtxt)",
        path,
        "JSON" if found == "xgboost_json" else "UBJSON",
        found,
    )
    return found


def _class_count(forest: treelite.Model, path: Path) -> int:
    header = forest.get_header_accessor()
    if int(header.get_field("num_target")[0]) != 1:
        raise ModelConfigError(f"{path}: multi-output models are not supported (as in Triton)")
    return int(header.get_field("num_class")[0])


def _check_tensors(
    spec: ModelSpec, features: int, classes: int, options: FilOptions, err: _Errors
) -> int:
    """Check the config's tensors against Triton FIL's fixed ones; the output's width."""
    if spec.max_batch_size < 1:
        raise err("max_batch_size", "a FIL model batches its rows: must be >= 1")
    names = [t.name for t in spec.inputs]
    if names != [INPUT_NAME]:
        raise err("input", f"a FIL model has the one input '{INPUT_NAME}', got {names}")
    _check_fp32(spec.inputs[0].datatype, "input[0].data_type", err)
    if spec.inputs[0].dims != (features,):
        raise err(
            "input[0].dims",
            f"{list(spec.inputs[0].dims)} but the model takes {features} features: [{features}]",
        )
    names = [t.name for t in spec.outputs]
    if names != [OUTPUT_NAME]:
        shap = " (sluice does not compute 'treeshap_output')" if "treeshap_output" in names else ""
        raise err("output", f"a FIL model has the one output '{OUTPUT_NAME}', got {names}{shap}")
    _check_fp32(spec.outputs[0].datatype, "output[0].data_type", err)
    widths = _output_widths(classes, options)
    dims = spec.outputs[0].dims
    if len(dims) != 1 or dims[0] not in widths:
        expected = " or ".join(f"[{w}]" for w in widths)
        raise err(
            "output[0].dims",
            f"{list(dims)} but this model answers {expected} per row (is_classifier: "
            f"{str(options.is_classifier).lower()}, predict_proba: "
            f"{str(options.predict_proba).lower()}, {classes} class score"
            f"{'s' if classes > 1 else ''})",
        )
    return dims[0]


def _output_widths(classes: int, options: FilOptions) -> tuple[int, ...]:
    if options.is_classifier and not options.predict_proba:
        return (1,)
    if options.is_classifier and classes == 1:
        return (1, 2)  # a binary model's score, or both classes' as Triton's QA configs ask
    return (classes,)


def _check_fp32(datatype: str, field: str, err: _Errors) -> None:
    if datatype != "FP32":
        raise err(field, f"FIL models take and answer TYPE_FP32 only, got {datatype}")


def _flag(parameters: dict[str, str], name: str, default: bool, err: _Errors) -> bool:
    value = parameters.get(name, "")
    if not value:
        return default
    if value.lower() not in ("true", "false"):
        raise err(f"parameters.{name}", f"must be 'true' or 'false', got '{value}'")
    return value.lower() == "true"


def _number(
    parameters: dict[str, str], name: str, kind: type[_Number], default: _Number, err: _Errors
) -> _Number:
    value = parameters.get(name, "")
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        raise err(f"parameters.{name}", f"must be {kind.__name__}, got '{value}'") from None
