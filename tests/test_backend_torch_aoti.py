"""PyTorch 2 models (`platform: "torch_aoti"`, `model.pt2`), served by `sluice serve` and
driven with tritonclient, and loaded directly for what must be refused.

The models are exported here with `torch.export` and compiled once per module with
`torch._inductor.aoti_compile_and_package` (tens of seconds on two cores: two tiny packages,
one with a dynamic batch dim and one without); an ExportedProgram saved with
`torch.export.save` is the other `.pt2` kind. Answers under concurrent requests (which batch,
unlike Triton's torch_aoti) must equal the eager module's.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from sluice.shared.errors import ModelConfigError, ModelExecutionError
from sluice.shared.model_config import load_model_config
from sluice.workers.backends import load_function
from sluice.workers.backends.aoti_runner import library_entry
from sluice.workers.backends.pt2_archive import leaf_names
from sluice.workers.instances.stacked import TensorFunction
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from tests.backend_models import serving_fixtures

# torch 2.13 pickles call specs with a check it deprecates itself
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
)

#: the batcher waits this long for more rows, so that concurrent requests form batches
DELAY_US = 200_000
#: rows per request, cycled: more than one request's rows in a batch shows it batched
ROWS = (1, 3, 8, 2, 5)
BIGGEST_REQUEST = max(ROWS)
#: the batch sizes the dynamic package is exported for
MAX_EXPORTED_BATCH = 64
CPU = torch.device("cpu")


class Affine(nn.Module):
    """One positional and one keyword input, a dict of two outputs: names of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.linear(x) + shift, "double": x * 2}


class BatchSum(nn.Module):
    """Sums over the batch: its output's first dim is not the batch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True)


@dataclass(frozen=True)
class Archives:
    """The module's .pt2 files, and the eager module they were exported from."""

    eager: Affine
    aoti_dynamic: Path
    aoti_fixed: Path
    program_dynamic: Path
    program_batch_sum: Path


def _example(rows: int) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    return (torch.randn(rows, 4),), {"shift": torch.randn(rows, 3)}


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> Archives:
    import torch._inductor

    folder = tmp_path_factory.mktemp("pt2")
    torch.manual_seed(0)
    eager = Affine().eval()
    batch = Dim("batch", min=1, max=MAX_EXPORTED_BATCH)
    args, kwargs = _example(2)
    dynamic = torch.export.export(
        eager, args, kwargs, dynamic_shapes={"x": {0: batch}, "shift": {0: batch}}
    )
    fixed = torch.export.export(eager, args, kwargs)
    paths = Archives(
        eager,
        folder / "aoti_dynamic.pt2",
        folder / "aoti_fixed.pt2",
        folder / "program_dynamic.pt2",
        folder / "program_batch_sum.pt2",
    )
    with torch._inductor.config.patch(compile_threads=1):  # no compile pool on 2 cores
        torch._inductor.aoti_compile_and_package(dynamic, package_path=str(paths.aoti_dynamic))
        torch._inductor.aoti_compile_and_package(fixed, package_path=str(paths.aoti_fixed))
    torch.export.save(dynamic, str(paths.program_dynamic))
    batch_sum = torch.export.export(
        BatchSum(), (torch.randn(2, 4),), dynamic_shapes={"x": {0: Dim("batch")}}
    )
    torch.export.save(batch_sum, str(paths.program_batch_sum))
    return paths


#: (name, dims) of each tensor
Tensors = tuple[tuple[str, str], ...]
#: Affine's tensors by ordinal names: x [4] and shift [3] in, y [3] and double [4] out
INPUTS: Tensors = (("INPUT__0", "4"), ("INPUT__1", "3"))
OUTPUTS: Tensors = (("OUTPUT__0", "3"), ("OUTPUT__1", "4"))


def config(
    name: str,
    inputs: Tensors = INPUTS,
    outputs: Tensors = OUTPUTS,
    *,
    max_batch_size: int = 16,
    first_type: str = "TYPE_FP32",
) -> str:
    """A config.pbtxt for a torch_aoti model; the first input has type `first_type`."""
    types = [first_type] + ["TYPE_FP32"] * (len(inputs) - 1)
    ins = ", ".join(
        f'{{ name: "{n}" data_type: {t} dims: [ {d} ] }}'
        for (n, d), t in zip(inputs, types, strict=True)
    )
    outs = ", ".join(f'{{ name: "{n}" data_type: TYPE_FP32 dims: [ {d} ] }}' for n, d in outputs)
    batching = f"dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} }}"
    return textwrap.dedent(
        f"""\
        name: "{name}"
        platform: "torch_aoti"
        max_batch_size: {max_batch_size}
        input [ {ins} ]
        output [ {outs} ]
        instance_group [ {{ kind: KIND_CPU }} ]
        {batching if max_batch_size else ""}
        """
    )


def _place(repo: Path, name: str, archive: Path, text: str) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(text)
    shutil.copyfile(archive, repo / name / "1" / "model.pt2")
    return repo / name


def _load(model_dir: Path) -> TensorFunction:
    return load_function(load_model_config(model_dir), model_dir, 1, CPU, 0)


# -- served: batches under concurrent requests ---------------------------------------------------

#: served model -> (archive, config inputs, config outputs)
SERVED: dict[str, tuple[str, Tensors, Tensors]] = {
    "ordinal": ("aoti_dynamic", INPUTS, OUTPUTS),
    "forward_names": (
        "aoti_dynamic",
        (("ARGS[0]", "4"), ("KWARGS[shift]", "3")),
        (("RESULT[double]", "4"),),
    ),
    "program": ("program_dynamic", (("x", "4"), ("shift", "3")), (("y", "3"), ("double", "4"))),
}
#: config output name -> the eager module's
EAGER_NAME = {"OUTPUT__0": "y", "OUTPUT__1": "double", "RESULT[double]": "double"}


@pytest.fixture(scope="module")
def repo(archives: Archives, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("torch_aoti") / "models"
    for name, (archive, inputs, outputs) in SERVED.items():
        _place(repo, name, getattr(archives, archive), config(name, inputs, outputs))
    _place(repo, "fixed_batched", archives.aoti_fixed, config("fixed_batched", max_batch_size=8))
    fixed_dims = (("INPUT__0", "2, 4"), ("INPUT__1", "2, 3"))
    unbatched = config("fixed_unbatched", fixed_dims, (("OUTPUT__0", "2, 3"),), max_batch_size=0)
    _place(repo, "fixed_unbatched", archives.aoti_fixed, unbatched)
    return repo


_service, _client = serving_fixtures()


def _request(names: tuple[str, ...], x: np.ndarray, shift: np.ndarray) -> list[Any]:
    tensors = []
    for name, array in zip(names, (x, shift), strict=True):
        tensor = httpclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    return tensors


def _batch_sizes(client: httpclient.InferenceServerClient, model: str) -> set[int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"] for b in stats["batch_stats"]}


@pytest.mark.parametrize("model", sorted(SERVED))
def test_concurrent_requests_batch_and_answer_as_the_eager_module(
    client: httpclient.InferenceServerClient, archives: Archives, model: str
) -> None:
    _, inputs, outputs = SERVED[model]
    names = tuple(name for name, _ in inputs)
    generator = np.random.default_rng(7)
    requests = []
    for rows in ROWS * 4:
        x = generator.standard_normal((rows, 4), dtype=np.float32)
        shift = generator.standard_normal((rows, 3), dtype=np.float32)
        requests.append((x, shift, client.async_infer(model, _request(names, x, shift))))
    for x, shift, pending in requests:
        result = pending.get_result()
        with torch.no_grad():
            expected = archives.eager(torch.from_numpy(x), shift=torch.from_numpy(shift))
        for name, _ in outputs:
            eager = expected[EAGER_NAME.get(name, name)].numpy()
            np.testing.assert_allclose(result.as_numpy(name), eager, rtol=1e-5, atol=1e-6)
    assert max(_batch_sizes(client, model)) > BIGGEST_REQUEST, "no batch held two requests"


def test_a_fixed_batch_dim_serves_unbatched_and_is_refused_batched(
    client: httpclient.InferenceServerClient, archives: Archives
) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["fixed_batched"]["state"] == "UNAVAILABLE"
    reason = index["fixed_batched"]["reason"]
    assert "input 'INPUT__0' (ARGS[0]): exported with a fixed first dim of 2" in reason
    assert "Dim('batch')" in reason
    assert index["fixed_unbatched"]["state"] == "READY", index["fixed_unbatched"]["reason"]
    args, kwargs = _example(2)
    x, shift = args[0].numpy(), kwargs["shift"].numpy()
    result = client.infer("fixed_unbatched", _request(("INPUT__0", "INPUT__1"), x, shift))
    expected = archives.eager(*args, **kwargs)
    np.testing.assert_allclose(
        result.as_numpy("OUTPUT__0"), expected["y"].detach().numpy(), rtol=1e-5, atol=1e-6
    )


# -- loaded directly: binding and what is refused -----------------------------------------------


@pytest.mark.parametrize("archive", ["aoti_dynamic", "program_dynamic"])
def test_tensors_bind_in_config_order_when_the_names_say_nothing(
    archives: Archives, tmp_path: Path, archive: str
) -> None:
    text = config("m", (("a", "4"), ("b", "3")), (("c", "3"), ("d", "4")))
    infer = _load(_place(tmp_path, "m", getattr(archives, archive), text))
    args, kwargs = _example(5)
    result = infer({"a": args[0], "b": kwargs["shift"]})
    expected = archives.eager(*args, **kwargs)
    torch.testing.assert_close(result["c"], expected["y"])
    torch.testing.assert_close(result["d"], expected["double"])


@pytest.mark.parametrize("archive", ["aoti_dynamic", "program_dynamic"])
def test_ordinal_names_bind_in_call_spec_order_whatever_the_config_order(
    archives: Archives, tmp_path: Path, archive: str
) -> None:
    text = config("m", INPUTS[::-1], (("OUTPUT__1", "4"),))
    infer = _load(_place(tmp_path, "m", getattr(archives, archive), text))
    args, kwargs = _example(3)
    result = infer({"INPUT__1": kwargs["shift"], "INPUT__0": args[0]})
    assert set(result) == {"OUTPUT__1"}
    torch.testing.assert_close(result["OUTPUT__1"], args[0] * 2)


def test_an_exported_programs_inputs_bind_by_forwards_parameter_names(
    archives: Archives, tmp_path: Path
) -> None:
    text = config("m", (("shift", "3"), ("x", "4")))
    infer = _load(_place(tmp_path, "m", archives.program_dynamic, text))
    args, kwargs = _example(2)
    result = infer({"x": args[0], "shift": kwargs["shift"]})
    torch.testing.assert_close(result["OUTPUT__0"], archives.eager(*args, **kwargs)["y"])


def test_a_package_with_files_beside_its_library_runs_through_torchs_loader(
    archives: Archives, tmp_path: Path
) -> None:
    """A plain CPU package runs through its library's C API (without the GIL); any other
    (weights or kernels as files of their own) through torch's loader, with equal answers."""
    assert library_entry(archives.aoti_dynamic) is not None
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(archives.aoti_dynamic) as old, zipfile.ZipFile(other, "w") as new:
        for item in old.infolist():
            new.writestr(item, old.read(item))
        prefix = old.namelist()[0].split("/")[0]
        new.writestr(f"{prefix}/data/aotinductor/model/extra.bin", b"\0")
    assert library_entry(other) is None
    args, kwargs = _example(4)
    expected = archives.eager(*args, **kwargs)
    for archive in (archives.aoti_dynamic, other):
        infer = _load(_place(tmp_path / archive.stem, "m", archive, config("m")))
        result = infer({"INPUT__0": args[0], "INPUT__1": kwargs["shift"]})
        torch.testing.assert_close(result["OUTPUT__0"], expected["y"])


#: a config of Affine that its .pt2 contradicts -> what the load error must say
BROKEN = {
    "wrong_dtype": (
        config("m", first_type="TYPE_FP64"),
        "input 'INPUT__0' (ARGS[0]): config.pbtxt says TYPE_FP64 but the model takes FP32",
    ),
    "bytes": (
        config("m", first_type="TYPE_STRING"),
        "input 'INPUT__0' (ARGS[0]): BYTES cannot reach a .pt2 model (torch has no string tensors)",
    ),
    "wrong_dims": (
        config("m", (("INPUT__0", "5"), INPUTS[1])),
        "input 'INPUT__0' (ARGS[0]): dims[0] is 5 in config.pbtxt but 4 in the model",
    ),
    "variable_where_fixed": (
        config("m", (INPUTS[0], ("INPUT__1", "-1"))),
        "input 'INPUT__1' (KWARGS[shift]): dims[0] is -1 in config.pbtxt but 3 in the model",
    ),
    "wrong_rank": (
        config("m", (("INPUT__0", "2, 2"), INPUTS[1])),
        "input 'INPUT__0' (ARGS[0]): the model takes 1 dims after the batch dim, "
        "config.pbtxt gives 2",
    ),
    "batch_beyond_export": (
        config("m", max_batch_size=MAX_EXPORTED_BATCH * 2),
        f"exported for batches of at most {MAX_EXPORTED_BATCH}, below max_batch_size "
        f"{MAX_EXPORTED_BATCH * 2}",
    ),
    "unknown_names": (
        config("m", (("x", "4"), ("y", "3"), ("z", "1"))),
        "input: config.pbtxt declares 3 ['x', 'y', 'z'] but the model has 2 "
        "['ARGS[0]', 'KWARGS[shift]']; name them INPUT__<i> or by these names",
    ),
    "ordinal_beyond": (
        config("m", outputs=(OUTPUTS[0], ("OUTPUT__2", "4"))),
        "output 'OUTPUT__2': the model has only 2 outputs ['RESULT[y]', 'RESULT[double]']",
    ),
    "input_left_unbound": (
        config("m", (("ARGS[0]", "4"),)),
        "input: the model also takes ['KWARGS[shift]'], which config.pbtxt does not bind",
    ),
}


@pytest.mark.parametrize("archive", ["aoti_dynamic", "program_dynamic"])
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_config_the_model_contradicts_is_refused_naming_the_field(
    archives: Archives, tmp_path: Path, archive: str, case: str
) -> None:
    text, message = BROKEN[case]
    model_dir = _place(tmp_path, "m", getattr(archives, archive), text)
    with pytest.raises(ModelConfigError) as err:
        _load(model_dir)
    assert str(err.value).startswith(f"{model_dir / '1' / 'model.pt2'}: ")
    assert message in str(err.value)


def test_a_fixed_batch_dim_of_an_exported_program_is_refused_too(
    archives: Archives, tmp_path: Path
) -> None:
    fixed = torch.export.export(archives.eager, *_example(2))
    torch.export.save(fixed, str(tmp_path / "fixed.pt2"))
    model_dir = _place(tmp_path, "m", tmp_path / "fixed.pt2", config("m"))
    with pytest.raises(ModelConfigError, match="exported with a fixed first dim of 2"):
        _load(model_dir)


def test_outputs_whose_first_dim_is_not_the_batch_fail_the_batch_clearly(
    archives: Archives, tmp_path: Path
) -> None:
    text = config("m", (("INPUT__0", "4"),), (("OUTPUT__0", "4"),))
    infer = _load(_place(tmp_path, "m", archives.program_batch_sum, text))
    with pytest.raises(ModelExecutionError, match=r"returned 1 rows for a batch of 3.*Dim"):
        infer({"INPUT__0": torch.ones(3, 4)})


def _with_metadata(source: Path, target: Path, **changes: str) -> Path:
    """A copy of an AOTInductor package whose metadata says otherwise, as the same package
    compiled elsewhere would."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            data = old.read(item)
            if item.filename.endswith(".wrapper_metadata.json"):
                data = json.dumps({**json.loads(data), **changes}).encode()
            new.writestr(item, data)
    return target


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would run it")
def test_a_cuda_package_on_a_worker_without_a_gpu_is_refused(
    archives: Archives, tmp_path: Path
) -> None:
    cuda = _with_metadata(archives.aoti_dynamic, tmp_path / "cuda.pt2", AOTI_DEVICE_KEY="cuda")
    model_dir = _place(tmp_path, "m", cuda, config("m"))
    with pytest.raises(ModelConfigError, match="compiled for CUDA but this worker has no GPU"):
        _load(model_dir)


def test_a_package_for_another_cpu_is_refused_before_it_can_crash_the_worker(
    archives: Archives, tmp_path: Path
) -> None:
    capabilities = torch.cpu.get_capabilities()
    other = "aarch64" if capabilities["architecture"] != "aarch64" else "x86_64"
    arm = _with_metadata(archives.aoti_dynamic, tmp_path / "arm.pt2", AOTI_MACHINE=other)
    with pytest.raises(ModelConfigError, match=f"compiled for {other}, this worker is"):
        _load(_place(tmp_path, "arm", arm, config("arm")))


def test_a_package_for_vector_instructions_this_cpu_lacks_is_refused(
    archives: Archives, tmp_path: Path
) -> None:
    capabilities = torch.cpu.get_capabilities()
    isas = (("AMX_TILE", "amx_tile"), ("AVX512", "avx512_f"), ("AVX2", "avx2"))
    lacking = [isa for isa, capability in isas if not capabilities.get(capability)]
    if not lacking:
        pytest.skip("this CPU has every vector ISA AOTInductor compiles for")
    package = _with_metadata(archives.aoti_dynamic, tmp_path / "isa.pt2", AOTI_CPU_ISA=lacking[0])
    with pytest.raises(ModelConfigError, match=f"compiled for a CPU with {lacking[0]}, which"):
        _load(_place(tmp_path, "isa", package, config("isa")))


def test_a_file_that_is_no_pt2_archive_is_refused_saying_what_it_needs(
    archives: Archives, tmp_path: Path
) -> None:
    scripted = tmp_path / "scripted.pt2"  # TorchScript is a zip archive too
    torch.jit.save(torch.jit.script(BatchSum()), str(scripted))
    with pytest.raises(ModelConfigError, match="neither an AOTInductor package"):
        _load(_place(tmp_path, "scripted", scripted, config("scripted")))
    garbage = tmp_path / "garbage.pt2"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(ModelConfigError, match=r"cannot read the \.pt2 archive"):
        _load(_place(tmp_path, "garbage", garbage, config("garbage")))
    (garbage.parent / "garbage" / "1" / "model.pt2").unlink()
    with pytest.raises(ModelConfigError, match=r"model\.pt2: no such file"):
        _load(garbage.parent / "garbage")


def test_forward_based_names_follow_tritons_grammar() -> None:
    leaf = torch.zeros(1)
    _, in_spec = pytree.tree_flatten(((leaf, {"a": leaf, "b": [leaf, leaf]}), {"k": leaf}))
    _, out_spec = pytree.tree_flatten((leaf, {"p": (leaf,)}))
    assert leaf_names(pytree.treespec_dumps(in_spec), "inputs") == [
        "ARGS[0]",
        "ARGS[1][a]",
        "ARGS[1][b][0]",
        "ARGS[1][b][1]",
        "KWARGS[k]",
    ]
    assert leaf_names(pytree.treespec_dumps(out_spec), "outputs") == [
        "RESULT[0]",
        "RESULT[1][p][0]",
    ]
    _, single = pytree.tree_flatten(leaf)
    assert leaf_names(pytree.treespec_dumps(single), "outputs") == ["RESULT"]
