"""Build the example models into a model repository, offline.

    python examples/build_models.py [--repository examples/model_repository] [--force]
                                    [--models mlp,charlm]

The config.pbtxt and labels files are written by hand and committed; only the model files in
`<model>/1/` are generated here. Models whose file exists are skipped unless --force.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

DEFAULT_REPOSITORY = Path(__file__).resolve().parent / "model_repository"


class NotBuilt(Exception):
    """A model this machine cannot build; the others are built all the same."""


def save_torchscript(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """Trace and save: model.pt is TorchScript, the format Triton's PyTorch backend loads."""
    partial = path.with_suffix(".partial")
    with torch.no_grad(), warnings.catch_warnings():
        # torch 2.13 deprecates torch.jit for torch.export; model.pt must stay TorchScript.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.trace(model, example).save(str(partial))
    partial.replace(path)  # a killed build leaves no model.pt that a rerun would skip


def reference_mlp() -> nn.Module:
    """The benchmarks' reference MLP: same seed and construction order, so outputs match it."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 512),
    ).eval()


def build_mlp(version_dir: Path) -> None:
    save_torchscript(reference_mlp(), torch.zeros(1, 512), version_dir / "model.pt")


def build_mlp_onnx(version_dir: Path) -> None:
    """The reference MLP, same weights, as ONNX with a dynamic batch dimension."""
    path = version_dir / "model.onnx"
    partial = path.with_suffix(".partial")
    names = {"input_names": ["INPUT__0"], "output_names": ["OUTPUT__0"]}
    batch = {"INPUT__0": {0: "batch"}, "OUTPUT__0": {0: "batch"}}
    with torch.no_grad(), warnings.catch_warnings():
        # the TorchScript-based exporter needs no onnxscript; torch 2.13 calls it legacy
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            reference_mlp(),
            (torch.zeros(1, 512),),
            str(partial),
            **names,
            dynamic_axes=batch,
            opset_version=17,
            dynamo=False,
        )
    partial.replace(path)


def build_mlp_openvino(version_dir: Path) -> None:
    """The reference MLP, same weights, as OpenVINO IR (model.xml + model.bin): mlp_onnx's
    export converted by OpenVINO, its weights kept in FP32 so it answers as `mlp` does."""
    import openvino  # here: the other models build without the [openvino] extra

    with tempfile.TemporaryDirectory() as exported:
        build_mlp_onnx(Path(exported))
        model = openvino.convert_model(Path(exported) / "model.onnx")
    partial = version_dir / "model.partial.xml"
    openvino.save_model(model, partial, compress_to_fp16=False)
    partial.with_suffix(".bin").replace(version_dir / "model.bin")
    partial.replace(version_dir / "model.xml")  # last: a killed build leaves no model.xml


def build_mlp_pt2(version_dir: Path) -> None:
    """The reference MLP, same weights, exported with a dynamic batch dim (1..64, as mlp's
    max_batch_size) and compiled by AOTInductor for this machine's CPU. It needs a C++ compiler
    (g++) and costs about 30 s of CPU the first time (most of it compiling the C++ wrapper),
    less once torch's compile cache (/tmp/torchinductor_<user>) holds its kernels."""
    import torch._inductor

    compiler = os.environ.get("CXX") or "g++"  # the one AOTInductor runs
    if shutil.which(compiler) is None:
        raise NotBuilt(f"compiling a .pt2 needs a C++ compiler: {compiler} is not on the PATH")
    path = version_dir / "model.pt2"
    partial = path.with_suffix(".partial.pt2")  # the packager wants the .pt2 suffix
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings():
        # torch 2.13 pickles the call spec with a check that it deprecates itself
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)
        program = torch.export.export(
            reference_mlp(), (torch.zeros(2, 512),), dynamic_shapes=({0: batch},)
        )
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    partial.replace(path)


def build_mlp_tf(version_dir: Path) -> None:
    """The reference MLP, same weights, as a Keras SavedModel: its serving signature takes
    `INPUT__0` [batch, 512] and answers `OUTPUT__0`, equal to the TorchScript MLP's answer."""
    import keras  # imported here: TensorFlow takes seconds to import, the other builds skip it

    layers = [m for m in reference_mlp() if isinstance(m, nn.Linear)]
    x = keras.Input(shape=(512,), name="INPUT__0")
    y = x
    for i, layer in enumerate(layers):
        dense = keras.layers.Dense(layer.out_features, activation=None if i == 2 else "relu")
        y = dense(y)
        dense.set_weights([layer.weight.detach().numpy().T, layer.bias.detach().numpy()])
    model = keras.Model(x, {"OUTPUT__0": y})
    rows = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference_mlp()(rows).numpy()
    np.testing.assert_allclose(model(rows.numpy())["OUTPUT__0"], expected, atol=1e-5)
    path = version_dir / "model.savedmodel"
    partial = path.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.export(str(partial), verbose=False)
    shutil.rmtree(path, ignore_errors=True)  # --force: the directory cannot be replaced whole
    partial.replace(path)


def build_digits(version_dir: Path) -> None:
    """A small CNN on scikit-learn's bundled 8x8 digits; input [N,1,8,8] in 0..1, 10 logits."""
    from sklearn.datasets import load_digits  # only here: `--models mlp` needs torch alone
    from sklearn.model_selection import train_test_split

    torch.manual_seed(0)
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=0, stratify=digits.target
    )
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x_train, y_train = images[train_idx], labels[train_idx]
    for _ in range(15):
        for batch in torch.randperm(len(y_train)).split(32):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(images[test_idx]).argmax(1) == labels[test_idx]).float().mean()
    print(f"digits: test accuracy {accuracy.item():.3f} on {len(test_idx)} held-out images")
    save_torchscript(model, torch.zeros(1, 1, 8, 8), version_dir / "model.pt")


def build_breast_cancer_xgb(version_dir: Path) -> None:
    """An XGBoost classifier on scikit-learn's bundled breast-cancer data, saved as UBJSON for
    Triton's FIL config (`model_type: xgboost_ubj`)."""
    import xgboost
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    features, labels = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features.astype("float32"), labels, test_size=0.2, random_state=0, stratify=labels
    )
    model = xgboost.XGBClassifier(n_estimators=50, max_depth=3, random_state=0, n_jobs=1)
    model.fit(x_train, y_train)
    accuracy = (model.predict(x_test) == y_test).mean()
    print(f"breast_cancer_xgb: test accuracy {accuracy:.3f} on {len(y_test)} held-out rows")
    path = version_dir / "xgboost.ubj"
    partial = path.with_suffix(".partial.ubj")  # the suffix picks XGBoost's format
    model.save_model(str(partial))
    partial.replace(path)


def build_charlm(version_dir: Path, steps: int = 250) -> None:
    """charlm's GRU (defined by its own model.py) trained on the text of Python's
    `pydoc_data.topics` to predict the next character, in about half a minute on one core."""
    from pydoc_data.topics import topics

    charlm = runpy.run_path(str(version_dir / "model.py"))
    text = "\n".join(topics[key] for key in sorted(topics))
    data = torch.tensor(charlm["encode"](text))
    torch.manual_seed(0)
    model = charlm["CharGRU"]()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    window, held_out = 128, len(data) * 9 // 10
    for _ in range(steps):
        starts = torch.randint(0, held_out - window - 1, (32,))
        batch = torch.stack([data[s : s + window + 1] for s in starts.tolist()])
        logits, _ = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        tail = data[held_out:][None, :4096]
        loss = nn.functional.cross_entropy(model(tail[:, :-1])[0][0], tail[0, 1:])
    print(f"charlm: {loss.item():.2f} nats per character on held-out text")
    path = version_dir / "model.pt"
    partial = path.with_suffix(".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(path)


#: model name -> the file its builder writes in `<model>/1/`, and the builder.
BUILDERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "mlp": ("model.pt", build_mlp),
    "mlp_onnx": ("model.onnx", build_mlp_onnx),
    "mlp_openvino": ("model.xml", build_mlp_openvino),
    "mlp_pt2": ("model.pt2", build_mlp_pt2),
    "mlp_tf": ("model.savedmodel", build_mlp_tf),
    "digits": ("model.pt", build_digits),
    "breast_cancer_xgb": ("xgboost.ubj", build_breast_cancer_xgb),
    "charlm": ("model.pt", build_charlm),
}


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the example models, offline.")
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--force", action="store_true", help="rebuild existing model.pt files")
    parser.add_argument("--models", help="comma-separated models to build (default: all)")
    args = parser.parse_args()
    wanted = args.models.split(",") if args.models else list(BUILDERS)
    unknown = set(wanted) - BUILDERS.keys()
    if unknown:
        parser.error(f"no such example model: {', '.join(sorted(unknown))}")
    torch.set_num_threads(1)  # CPU kernels then reduce in one order: the same weights everywhere
    for name, (filename, build) in BUILDERS.items():
        if name not in wanted:
            continue
        version_dir = args.repository / name / "1"
        if (version_dir / filename).exists() and not args.force:
            print(f"{name}: {version_dir / filename} exists, skipped (--force rebuilds)")
            continue
        version_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            build(version_dir)
        except NotBuilt as reason:
            print(f"{name}: not built: {reason}")
            continue
        print(f"{name}: wrote {version_dir / filename} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
