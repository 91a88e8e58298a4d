"""Parse and normalise a model's config.pbtxt the way Triton does.

The text is parsed by protobuf against Triton's own `ModelConfig` message, so a config that
Triton accepts parses here unchanged. Validation and defaults follow core
`src/model_config_utils.cc`; every error names the file and the offending field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from sluice.shared.batch_delay import DELAY_MODES, BatchDelay
from sluice.shared.config_view import ConfigView
from sluice.shared.datatypes import config_to_wire
from sluice.shared.errors import ModelConfigError
from sluice.shared.partitions import PARAMETER as PARTITIONS
from sluice.shared.partitions import parse_partitions
from sluice.shared.response_cache_rules import cache_problem
from sluice.shared.sequence_controls import check_controls
from tritonclient.grpc.model_config_pb2 import (
    DataType,
    ModelConfig,
    ModelInput,
    ModelInstanceGroup,
    ModelOutput,
)

CONFIG_FILENAME = "config.pbtxt"

#: fills, in place, what a model's own files say and its config leaves out (Triton's
#: auto-complete: a Python model's `auto_complete_config`, an ONNX file's inputs); called
#: with the parsed config and the model directory before the config is validated.
Completer = Callable[[ModelConfig, Path], None]


@dataclass(frozen=True, slots=True)
class BackendRule:
    """How Triton picks a backend from `platform` / `backend`, and what it fills in."""

    #: sluice's name for the backend (ModelSpec.kind), which picks the worker's loader.
    kind: str
    #: the `backend` Triton fills in ("" for ensembles, which run on no backend).
    backend: str
    #: the platforms that select it; the first is what Triton fills in when only `backend` is
    #: given (none: the backend has no platform name).
    platforms: tuple[str, ...]
    #: the model file's default name in a version folder ("" : none).
    filename: str


BACKEND_RULES = (
    BackendRule("pytorch", "pytorch", ("pytorch_libtorch", "libtorch"), "model.pt"),
    BackendRule("torch_aoti", "pytorch", ("torch_aoti",), "model.pt2"),
    BackendRule("python", "python", (), "model.py"),
    BackendRule("onnxruntime", "onnxruntime", ("onnxruntime_onnx",), "model.onnx"),
    BackendRule("fil", "fil", (), "xgboost.model"),
    BackendRule("tensorflow", "tensorflow", ("tensorflow_savedmodel",), "model.savedmodel"),
    BackendRule("openvino", "openvino", (), "model.xml"),
    BackendRule("tensorrt", "tensorrt", ("tensorrt_plan",), "model.plan"),
    BackendRule("ensemble", "", ("ensemble",), ""),
)
#: the kinds Triton's autofill recognises by their model file, in the order it looks.
_DETECTED_KINDS = ("tensorflow", "tensorrt", "onnxruntime", "openvino", "pytorch", "python")
#: FIL's default file name follows its `model_type` parameter (fil_backend docs/model_config.md).
FIL_FILENAMES = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}
_THREAD_PARAMETERS = ("INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT")
#: sluice's own parameter: "fixed" always waits the batching delay out, as Triton does;
#: "adaptive" (opt-in) skips it while a model's requests arrive further apart than it.
#: Absent: the server's --batch-delay, itself "fixed" unless set.
DELAY_PARAMETER = "BATCH_DELAY"
#: Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS: a sequence with no request for this long ends.
SEQUENCE_IDLE_DEFAULT_US = 1_000_000
_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output; `dims` excludes the implicit batch dim (-1 = variable)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None
    optional: bool
    allow_ragged_batch: bool


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    """What the dynamic batcher needs; `preferred_batch_sizes` is normalised and ascending."""

    max_batch_size: int
    dynamic: bool
    max_queue_delay_us: int
    preferred_batch_sizes: tuple[int, ...]
    preserve_ordering: bool
    #: the model's own BATCH_DELAY ("fixed" or "adaptive"); None: the server's default.
    delay_mode: BatchDelay | None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A validated model config: what workers load and what the gateway reports."""

    name: str
    kind: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingPolicy
    instance_count: int
    instance_kind: str
    model_filename: str
    parameters: dict[str, str]
    intra_op_threads: int | None
    inter_op_threads: int | None
    version_policy: tuple[str, tuple[int, ...]]
    #: the config as the gateways and the worker's own units read it.
    config: ConfigView

    @property
    def partitions(self) -> int:
        """How many partitions its streams are split into (shared/partitions.py)."""
        return self.config.partitions

    @property
    def config_json(self) -> dict[str, Any]:
        """The config as Triton's JSON: what the model record publishes and a Python model's
        `args['model_config']` holds."""
        return self.config.json


@dataclass(frozen=True, slots=True)
class _Errors:
    """Builds ModelConfigErrors that all start with the config file's path."""

    path: Path

    def __call__(self, field: str, message: str) -> ModelConfigError:
        return ModelConfigError(f"{self.path}: {field}: {message}")


def load_model_config(
    model_dir: Path, *, config_json: str | None = None, complete: Completer | None = None
) -> ModelSpec:
    """Read, validate and normalise `<model_dir>/config.pbtxt`, or `config_json` instead of it
    (a repository load's config override, Triton's ModelConfig as JSON); raise ModelConfigError.
    `complete` fills in what the model's own files say, before validation."""
    path = model_dir / CONFIG_FILENAME
    err = _Errors(path)
    if config_json is not None:
        cfg = _parse_json(config_json, path)
    elif path.is_file():
        cfg = _parse(path)
    else:  # Triton's default (no --strict-model-config): the model's files say what it is
        cfg = ModelConfig()
    if cfg.name and cfg.name != model_dir.name:
        raise err("name", f"'{cfg.name}' must equal the directory name '{model_dir.name}'")
    cfg.name = cfg.name or model_dir.name
    if not cfg.platform and not cfg.backend:
        detect_backend(cfg, model_dir)
    kind = _resolve_backend(cfg, err)
    filename = PurePosixPath(cfg.default_model_filename)
    if filename.is_absolute() or ".." in filename.parts or "\\" in cfg.default_model_filename:
        # a config can come from the wire (a load's config parameter): no file elsewhere
        message = f"'{cfg.default_model_filename}' must name a file in the version directory"
        raise err("default_model_filename", message)
    if complete is not None:
        complete(cfg, model_dir)
    if cfg.max_batch_size < 0:
        raise err("max_batch_size", f"must be >= 0, got {cfg.max_batch_size}")
    # a Python model may declare no tensors (its auto_complete_config may add none)
    required = kind != "python"
    inputs = _tensors(cfg.input, "input", cfg.max_batch_size, err, required=required)
    outputs = _tensors(cfg.output, "output", cfg.max_batch_size, err, required=required)
    parameters = {key: value.string_value for key, value in cfg.parameters.items()}
    batching = _batching(cfg, parameters, err)
    instance_count, instance_kind = _instances(cfg, err)
    intra, inter = (_thread_count(parameters, key, err) for key in _THREAD_PARAMETERS)
    version_policy = _version_policy(cfg)
    try:  # checked here so that the error names the file; the view reads it again
        parse_partitions(parameters.get(PARTITIONS))
    except ValueError as exc:
        raise err(f"parameters.{PARTITIONS}", str(exc)) from None
    _fill_pinned_memory(cfg)
    _fill_sequence_idle(cfg)
    if cfg.HasField("sequence_batching"):
        check_controls(cfg.sequence_batching, cfg.name)
    triton_json = triton_config_json(cfg)
    problem = cache_problem(triton_json)
    if problem is not None:
        raise ModelConfigError(problem)
    return ModelSpec(
        name=cfg.name,
        kind=kind,
        platform=cfg.platform or cfg.backend,
        backend=cfg.backend,
        max_batch_size=cfg.max_batch_size,
        inputs=inputs,
        outputs=outputs,
        batching=batching,
        instance_count=instance_count,
        instance_kind=instance_kind,
        model_filename=cfg.default_model_filename or _default_filename(kind, parameters),
        parameters=parameters,
        intra_op_threads=intra,
        inter_op_threads=inter,
        version_policy=version_policy,
        config=ConfigView.from_json(triton_json),
    )


def triton_config_json(config: ModelConfig) -> dict[str, Any]:
    """The config as Triton's GET /v2/models/{m}/config returns it: int64s are JSON numbers."""
    data = json_format.MessageToDict(
        config,
        preserving_proto_field_name=True,
        use_integers_for_enums=False,
        always_print_fields_with_no_presence=True,
    )
    return _int64_to_numbers(config.DESCRIPTOR, data)


def _parse(path: Path) -> ModelConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read: {exc}") from exc
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        # The message starts with "line:col : ", so this reads as "path:line:col : ...".
        sep = ":" if exc.GetLine() is not None else ": "
        raise ModelConfigError(f"{path}{sep}{exc}") from exc


def _parse_json(text: str, path: Path) -> ModelConfig:
    try:
        return json_format.Parse(text, ModelConfig())
    except json_format.ParseError as exc:
        raise ModelConfigError(f"{path} (config override): {exc}") from exc


def detect_backend(cfg: ModelConfig, model_dir: Path) -> None:
    """Fill `backend` (TF's `platform`, the file name) of a config that names neither, from its
    `default_model_filename` or else the files of its first version directory (in name
    order), as Triton's autofill does; nothing recognised leaves both empty."""
    rules = [next(r for r in BACKEND_RULES if r.kind == kind) for kind in _DETECTED_KINDS]
    if cfg.default_model_filename:
        rule = next((r for r in rules if r.filename == cfg.default_model_filename), None)
    else:
        first = _first_version_dir(model_dir)
        rule = next((r for r in rules if first and _holds(first, r.filename)), None)
    if rule is not None:
        cfg.backend = rule.backend
        cfg.platform = rule.platforms[0] if rule.kind == "tensorflow" else ""
        cfg.default_model_filename = rule.filename


def _first_version_dir(model_dir: Path) -> Path | None:
    try:
        versions = sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    except OSError:
        return None  # loading the model says why
    return versions[0] if versions else None


def _holds(version_dir: Path, filename: str) -> bool:
    """A SavedModel is a directory, a TensorRT plan a file, the others either."""
    path = version_dir / filename
    if filename == "model.savedmodel":
        return path.is_dir()
    if filename == "model.plan":
        return path.is_file()
    return path.exists()


def _resolve_backend(cfg: ModelConfig, err: _Errors) -> str:
    """Fill platform/backend/default filename as Triton's autofill does; return the kind."""
    platform, backend = cfg.platform, cfg.backend
    if not platform and not backend:  # and its files did not tell (detect_backend)
        raise ModelConfigError(
            f"{err.path}: Invalid model name: Could not determine backend for model "
            f"'{cfg.name}' with no backend in model configuration. Expected model name of the "
            "form 'model.<backend_name>'."
        )
    if platform:
        rule = next((r for r in BACKEND_RULES if platform in r.platforms), None)
        if rule is None:
            raise err("platform", f"unsupported platform '{platform}'")
        if backend and backend != rule.backend:
            raise err("backend", f"backend '{backend}' does not match platform '{platform}'")
    else:
        rule = next((r for r in BACKEND_RULES if r.backend == backend), None)
        if rule is None:
            raise err("backend", f"unsupported backend '{backend}'")
        if rule.platforms:
            cfg.platform = rule.platforms[0]
        if not cfg.default_model_filename:
            parameters = {key: value.string_value for key, value in cfg.parameters.items()}
            cfg.default_model_filename = _default_filename(rule.kind, parameters)
    cfg.backend = rule.backend
    return rule.kind


def _default_filename(kind: str, parameters: dict[str, str]) -> str:
    if kind == "fil":
        return FIL_FILENAMES.get(parameters.get("model_type", "xgboost"), "xgboost.model")
    return next(r.filename for r in BACKEND_RULES if r.kind == kind)


def _tensors(
    ios: Sequence[ModelInput] | Sequence[ModelOutput],
    label: str,
    max_batch_size: int,
    err: _Errors,
    *,
    required: bool,
) -> tuple[TensorSpec, ...]:
    if not ios and required:
        raise err(label, "must list at least one tensor")
    seen: set[str] = set()
    specs = []
    for i, io in enumerate(ios):
        field = f"{label}[{i}]"
        if not io.name:
            raise err(f"{field}.name", "must be set")
        if io.name in seen:
            raise err(f"{field}.name", f"duplicate {label} name '{io.name}'")
        seen.add(io.name)
        if io.data_type == DataType.TYPE_INVALID:
            raise err(f"{field}.data_type", f"must be set for '{io.name}'")
        dims = tuple(io.dims)
        if not dims:
            raise err(f"{field}.dims", f"must not be empty for '{io.name}'")
        _check_dims(dims, f"{field}.dims", err)
        reshape = None
        if io.HasField("reshape"):
            reshape = tuple(io.reshape.shape)
            _check_reshape(dims, reshape, max_batch_size, f"{field}.reshape.shape", err)
        specs.append(
            TensorSpec(
                name=io.name,
                datatype=config_to_wire(DataType.Name(io.data_type)),
                dims=dims,
                reshape=reshape,
                optional=getattr(io, "optional", False),
                allow_ragged_batch=getattr(io, "allow_ragged_batch", False),
            )
        )
    return tuple(specs)


def _check_dims(shape: tuple[int, ...], field: str, err: _Errors) -> None:
    if any(d < 1 and d != -1 for d in shape):
        raise err(field, f"dimensions must be >= 1, or -1 for a variable size; got {list(shape)}")


def _check_reshape(
    dims: tuple[int, ...], shape: tuple[int, ...], max_batch_size: int, field: str, err: _Errors
) -> None:
    if not shape and max_batch_size == 0:
        raise err(field, "cannot be empty for a non-batching model (no scalar tensors)")
    _check_dims(shape, field, err)
    # Triton compares the element counts between variable-size dims, e.g. [2,4,-1,6] ~ [8,-1,1,6].
    if _segment_counts(dims) != _segment_counts(shape):
        raise err(field, f"{list(shape)} has a different element count than dims {list(dims)}")


def _segment_counts(shape: tuple[int, ...]) -> list[int]:
    counts = [1]
    for d in shape:
        if d == -1:
            counts.append(1)
        else:
            counts[-1] *= d
    return counts


def _batching(cfg: ModelConfig, parameters: dict[str, str], err: _Errors) -> BatchingPolicy:
    dynamic = cfg.HasField("dynamic_batching")
    db = cfg.dynamic_batching
    if dynamic:
        if cfg.max_batch_size == 0:
            raise err("dynamic_batching", "requires max_batch_size > 0")
        for size in db.preferred_batch_size:
            if not 0 < size <= cfg.max_batch_size:
                raise err(
                    "dynamic_batching.preferred_batch_size",
                    f"{size} must be > 0 and <= max_batch_size {cfg.max_batch_size}",
                )
        if not db.preferred_batch_size:
            db.preferred_batch_size.append(cfg.max_batch_size)
    return BatchingPolicy(
        max_batch_size=cfg.max_batch_size,
        dynamic=dynamic,
        max_queue_delay_us=db.max_queue_delay_microseconds,
        preferred_batch_sizes=tuple(sorted(set(db.preferred_batch_size))),
        preserve_ordering=db.preserve_ordering,
        delay_mode=_delay_mode(parameters, err),
    )


def _delay_mode(parameters: dict[str, str], err: _Errors) -> BatchDelay | None:
    mode = parameters.get(DELAY_PARAMETER)
    if mode is None:
        return None
    for known in DELAY_MODES:
        if mode == known:
            return known
    expected = " or ".join(f"'{m}'" for m in DELAY_MODES)
    raise err(f"parameters.{DELAY_PARAMETER}", f"must be {expected}, got '{mode}'")


def _instances(cfg: ModelConfig, err: _Errors) -> tuple[int, str]:
    """Fill group defaults (name, count 1, KIND_AUTO); sluice runs one kind per model."""
    if not cfg.instance_group:
        # Triton names the group it adds after the model, without an index.
        cfg.instance_group.add(name=cfg.name)
    for i, group in enumerate(cfg.instance_group):
        group.name = group.name or f"{cfg.name}_{i}"
        group.count = max(group.count, 1)
        if group.kind != cfg.instance_group[0].kind:
            raise err(f"instance_group[{i}].kind", "every group must have the same kind")
    kind = ModelInstanceGroup.Kind.Name(cfg.instance_group[0].kind)
    return sum(group.count for group in cfg.instance_group), kind


def _thread_count(parameters: dict[str, str], key: str, err: _Errors) -> int | None:
    """Like the PyTorch backend: the value must be an integer; <= 0 leaves torch's default."""
    if key not in parameters:
        return None
    try:
        value = int(parameters[key])
    except ValueError:
        raise err(f"parameters.{key}", f"must be an integer, got '{parameters[key]}'") from None
    return value if value > 0 else None


def _version_policy(cfg: ModelConfig) -> tuple[str, tuple[int, ...]]:
    policy = cfg.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return "all", ()
    if choice == "specific":
        return "specific", tuple(sorted(set(policy.specific.versions)))
    if choice is None:
        policy.latest.num_versions = 1
    return "latest", (policy.latest.num_versions,)


def _fill_pinned_memory(cfg: ModelConfig) -> None:
    """Triton reports pinned input/output memory as enabled unless the config says otherwise."""
    for name in ("input_pinned_memory", "output_pinned_memory"):
        if not cfg.optimization.HasField(name):
            getattr(cfg.optimization, name).enable = True


def _fill_sequence_idle(cfg: ModelConfig) -> None:
    """Triton's default idle time of a sequence, where the config sets none."""
    if (
        cfg.HasField("sequence_batching")
        and not cfg.sequence_batching.max_sequence_idle_microseconds
    ):
        cfg.sequence_batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_US


def _int64_to_numbers(desc: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    """JSON mapping prints 64-bit integers as strings; Triton prints them as numbers."""
    for field in desc.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            data[field.name] = {k: _convert(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            data[field.name] = [_convert(field, v) for v in value]
        else:
            data[field.name] = _convert(field, value)
    return data


def _convert(field: FieldDescriptor, value: Any) -> Any:
    if field.type in _INT64_TYPES:
        return int(value)
    if field.message_type is not None:
        return _int64_to_numbers(field.message_type, value)
    return value
