"""Tree models with Triton's FIL config, served by `sluice serve` and driven with tritonclient.

Each model is trained here on a data set scikit-learn ships, saved in one of FIL's formats
(XGBoost legacy name, JSON, UBJSON; LightGBM text; a Treelite checkpoint of a scikit-learn
forest) beside the config.pbtxt Triton's FIL documentation gives, and its answers under
concurrent requests (which batch) are compared with the framework's own predictions.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightgbm
import numpy as np
import pytest
import treelite
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost
from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris
from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, serving_alone, start_service, stop_service
from tests.fil_models import classifier, fil_config, model_path, save_model, write_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = "breast_cancer_xgb"
#: rows per request, cycled: more than one request's rows in a batch shows it batched
ROWS = (1, 3, 8, 2, 5)
BIGGEST_REQUEST = max(ROWS)


@dataclass(frozen=True)
class Case:
    """A served model and what its answers must equal."""

    rows: np.ndarray
    expected: Callable[[np.ndarray], np.ndarray]
    #: labels must match exactly; scores to float32 precision
    exact: bool
    #: its config delays batches (the example's `dynamic_batching {}` does not wait)
    waits: bool = True


def build_cases(repo: Path) -> dict[str, Case]:
    """Train, save and configure every model; what each must answer."""
    cancer_x, cancer_y = load_breast_cancer(return_X_y=True)
    iris_x, iris_y = load_iris(return_X_y=True)
    diabetes_x, diabetes_y = load_diabetes(return_X_y=True)
    cancer_x, iris_x, diabetes_x = (a.astype(np.float32) for a in (cancer_x, iris_x, diabetes_x))
    cases: dict[str, Case] = {}

    binary = xgboost.XGBClassifier(n_estimators=20, max_depth=3).fit(cancer_x, cancer_y)
    proba = binary.predict_proba
    # XGBoost 2.1 and later save UBJSON under the legacy name; the default model_type
    path = model_path(repo, "xgb_legacy_name", (30, 1), {"is_classifier": "true"}, "xgboost.model")
    binary.get_booster().save_model(str(path.with_suffix(".ubj")))
    path.with_suffix(".ubj").rename(path)
    cases["xgb_legacy_name"] = Case(cancer_x, lambda x: binary.predict(x)[:, None], exact=True)
    save_model(
        repo, "xgb_json", (30, 1), classifier("xgboost_json"), "xgboost.json", binary.save_model
    )
    cases["xgb_json"] = Case(cancer_x, lambda x: binary.predict(x)[:, None], exact=True)
    params = classifier("xgboost_ubj", predict_proba="true")
    save_model(repo, "xgb_ubj_proba", (30, 2), params, "xgboost.ubj", binary.save_model)
    cases["xgb_ubj_proba"] = Case(cancer_x, proba, exact=False)
    params = classifier("xgboost_json", threshold="0.9")
    save_model(repo, "xgb_threshold", (30, 1), params, "xgboost.json", binary.save_model)
    cases["xgb_threshold"] = Case(cancer_x, lambda x: (proba(x)[:, 1:] > 0.9) * 1.0, exact=True)
    # the pre-25.09 parameter name, which Triton still honours
    params = {"model_type": "xgboost_json", "output_class": "true", "predict_proba": "true"}
    save_model(repo, "xgb_output_class", (30, 1), params, "xgboost.json", binary.save_model)
    cases["xgb_output_class"] = Case(cancer_x, lambda x: proba(x)[:, 1:], exact=False)

    multi = xgboost.XGBClassifier(n_estimators=10, max_depth=3).fit(iris_x, iris_y)
    save_model(repo, "xgb_iris", (4, 1), classifier("xgboost_ubj"), "xgboost.ubj", multi.save_model)
    cases["xgb_iris"] = Case(iris_x, lambda x: multi.predict(x)[:, None], exact=True)
    params = classifier("xgboost_json", predict_proba="true")
    save_model(repo, "xgb_iris_proba", (4, 3), params, "xgboost.json", multi.save_model)
    cases["xgb_iris_proba"] = Case(iris_x, multi.predict_proba, exact=False)

    regressor = xgboost.XGBRegressor(n_estimators=20, max_depth=3).fit(diabetes_x, diabetes_y)
    params = {"model_type": "xgboost_json", "is_classifier": "false"}
    save_model(repo, "xgb_diabetes", (10, 1), params, "xgboost.json", regressor.save_model)
    cases["xgb_diabetes"] = Case(diabetes_x, lambda x: regressor.predict(x)[:, None], exact=False)

    lgb_multi = lightgbm.LGBMClassifier(n_estimators=10, verbose=-1).fit(iris_x, iris_y)
    save_model(
        repo,
        "lgb_iris",
        (4, 1),
        classifier("lightgbm"),
        "model.txt",
        lgb_multi.booster_.save_model,
    )
    cases["lgb_iris"] = Case(iris_x, lambda x: lgb_multi.predict(x)[:, None], exact=True)
    lgb_binary = lightgbm.LGBMClassifier(n_estimators=10, verbose=-1).fit(cancer_x, cancer_y)
    params = classifier("lightgbm", predict_proba="true")
    save_model(
        repo, "lgb_cancer_proba", (30, 1), params, "model.txt", lgb_binary.booster_.save_model
    )
    cases["lgb_cancer_proba"] = Case(
        cancer_x, lambda x: lgb_binary.predict_proba(x)[:, 1:], exact=False
    )

    forest = RandomForestClassifier(n_estimators=10, max_depth=4, random_state=0)
    forest.fit(iris_x, iris_y)
    params = classifier("treelite_checkpoint", predict_proba="true")
    save_model(
        repo,
        "sk_forest",
        (4, 3),
        params,
        "checkpoint.tl",
        treelite.sklearn.import_model(forest).serialize,
    )
    cases["sk_forest"] = Case(iris_x, forest.predict_proba, exact=False)
    boosted = GradientBoostingRegressor(n_estimators=20, random_state=0)
    boosted.fit(diabetes_x, diabetes_y)
    params = {"model_type": "treelite_checkpoint", "is_classifier": "false"}
    save_model(
        repo,
        "sk_boosted",
        (10, 1),
        params,
        "checkpoint.tl",
        treelite.sklearn.import_model(boosted).serialize,
    )
    cases["sk_boosted"] = Case(diabetes_x, lambda x: boosted.predict(x)[:, None], exact=False)
    return cases


JSON_CLASSIFIER = {"model_type": "xgboost_json", "is_classifier": "true"}
#: broken configs of the breast-cancer classifier: (features, output width, parameters,
#: input name) and a text the UNAVAILABLE reason must hold
BROKEN: dict[str, tuple[tuple[int, int, dict[str, str], str], str]] = {
    "bad_features": (
        (29, 1, JSON_CLASSIFIER, "input__0"),
        "input[0].dims: [29] but the model takes 30 features",
    ),
    "bad_input_name": (
        (30, 1, JSON_CLASSIFIER, "x"),
        "input: a FIL model has the one input 'input__0', got ['x']",
    ),
    "bad_proba_dims": (
        (30, 3, {**JSON_CLASSIFIER, "predict_proba": "true"}, "input__0"),
        "output[0].dims: [3] but this model answers [1] or [2] per row",
    ),
    "no_is_classifier": (
        (30, 1, {"model_type": "xgboost_json"}, "input__0"),
        "parameters.is_classifier: must be set",
    ),
    "bad_model_type": (
        (30, 1, {**JSON_CLASSIFIER, "model_type": "catboost"}, "input__0"),
        "parameters.model_type: 'catboost' is not one of",
    ),
    "bad_threshold": (
        (30, 1, {**JSON_CLASSIFIER, "threshold": "high"}, "input__0"),
        "parameters.threshold: must be float, got 'high'",
    ),
}


def _write_broken(repo: Path, source: Path) -> None:
    for name, ((features, width, parameters, input_name), _) in BROKEN.items():
        config = fil_config(name, features, width, parameters=parameters, input_name=input_name)
        write_model(repo, name, config, "xgboost.json").write_bytes(source.read_bytes())


@pytest.fixture(scope="module")
def repo_and_cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Case]]:
    repo = tmp_path_factory.mktemp("fil") / "models"
    cases = build_cases(repo)
    _write_broken(repo, repo / "xgb_json" / "1" / "xgboost.json")
    cases[EXAMPLE] = _build_example(repo)
    return repo, cases


def _build_example(repo: Path) -> Case:
    """The example repository's FIL model: its committed config, its builder's model file."""
    source = EXAMPLES / "model_repository" / EXAMPLE
    path = write_model(repo, EXAMPLE, (source / "config.pbtxt").read_text(), "xgboost.ubj")
    spec = importlib.util.spec_from_file_location("build_models", EXAMPLES / "build_models.py")
    assert spec is not None and spec.loader is not None
    builders = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builders)
    builders.build_breast_cancer_xgb(path.parent)
    model = xgboost.XGBClassifier()
    model.load_model(str(path))
    rows = load_breast_cancer(return_X_y=True)[0].astype(np.float32)
    return Case(rows, lambda x: model.predict(x)[:, None], exact=True, waits=False)


@pytest.fixture(scope="module")
def cases(repo_and_cases: tuple[Path, dict[str, Case]]) -> dict[str, Case]:
    return repo_and_cases[1]


@pytest.fixture(scope="module")
def service(repo_and_cases: tuple[Path, dict[str, Case]]) -> Iterator[Service]:
    with serving_alone(repo_and_cases[0]) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[httpclient.InferenceServerClient]:
    """One client for the module: 8 connections, so that requests overlap."""
    client = httpclient.InferenceServerClient(service.http_url, concurrency=8)
    yield client
    client.close()


def _request(rows: np.ndarray) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("input__0", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows, binary_data=True)
    return [tensor]


def _batch_sizes(client: httpclient.InferenceServerClient, model: str) -> set[int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"] for b in stats["batch_stats"]}


def _served(client: httpclient.InferenceServerClient, model: str, rows: np.ndarray) -> np.ndarray:
    """Every row answered, sent concurrently in requests of ROWS rows each."""
    pending: list[tuple[int, Any]] = []
    start = 0
    for count in (ROWS * (len(rows) // sum(ROWS) + 1))[: len(rows)]:
        if start >= len(rows):
            break
        pending.append((start, client.async_infer(model, _request(rows[start : start + count]))))
        start += count
    parts = [(at, request.get_result().as_numpy("output__0")) for at, request in pending]
    return np.concatenate([part for _, part in sorted(parts, key=lambda p: p[0])])


@pytest.mark.parametrize(
    "model",
    [
        "xgb_legacy_name",
        "xgb_json",
        "xgb_ubj_proba",
        "xgb_threshold",
        "xgb_output_class",
        "xgb_iris",
        "xgb_iris_proba",
        "xgb_diabetes",
        "lgb_iris",
        "lgb_cancer_proba",
        "sk_forest",
        "sk_boosted",
        EXAMPLE,
    ],
)
def test_answers_equal_the_frameworks_own_predictions_in_batches(
    client: httpclient.InferenceServerClient, cases: dict[str, Case], model: str
) -> None:
    case = cases[model]
    served = _served(client, model, case.rows)
    expected = case.expected(case.rows).astype(np.float32)
    assert served.dtype == np.float32
    assert served.shape == expected.shape
    if case.exact:
        np.testing.assert_array_equal(served, expected)
    else:
        np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    if case.waits:
        assert max(_batch_sizes(client, model)) > BIGGEST_REQUEST, "no batch held two requests"


def test_config_and_metadata_are_tritons_fil_tensors(service: Service) -> None:
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        metadata = client.get_model_metadata("xgb_iris_proba", as_json=True)
        config = client.get_model_config("xgb_iris_proba", as_json=True)["config"]
        rows = load_iris(return_X_y=True)[0][:2].astype(np.float32)
        tensor = grpcclient.InferInput("input__0", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        answer = client.infer("xgb_iris_proba", [tensor]).as_numpy("output__0")
    assert metadata["inputs"] == [{"name": "input__0", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert metadata["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": ["-1", "3"]}]
    assert config["backend"] == "fil"
    assert config["default_model_filename"] == "xgboost.json"
    assert answer.shape == (2, 3)
    np.testing.assert_allclose(answer.sum(axis=1), 1.0, rtol=1e-5)


def test_a_request_with_the_wrong_feature_count_is_refused_naming_it(
    client: httpclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer("xgb_json", _request(np.zeros((2, 29), np.float32)))
    assert "input__0" in str(err.value)


@pytest.mark.parametrize("model", sorted(BROKEN))
def test_a_broken_config_is_unavailable_naming_the_field(
    client: httpclient.InferenceServerClient, model: str
) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index[model]["state"] == "UNAVAILABLE"
    assert BROKEN[model][1] in index[model]["reason"]
    assert index["xgb_json"]["state"] == "READY"


def test_without_treelite_a_fil_model_is_unavailable_naming_the_extra(
    repo_and_cases: tuple[Path, dict[str, Case]], redis_url: str, tmp_path: Path
) -> None:
    """A worker whose Python cannot import treelite (the [fil] extra) serves the others."""
    repo = tmp_path / "models"
    source = repo_and_cases[0] / "xgb_json"
    write_model(
        repo, "xgb_json", (source / "config.pbtxt").read_text(), "xgboost.json"
    ).write_bytes((source / "1" / "xgboost.json").read_bytes())
    add = Path(__file__).parent / "triton_python_repo" / "add_sub"
    (repo / "add_sub" / "1").mkdir(parents=True)
    (repo / "add_sub" / "config.pbtxt").write_bytes((add / "config.pbtxt").read_bytes())
    (repo / "add_sub" / "1" / "model.py").write_bytes((add / "1" / "model.py").read_bytes())
    hide = tmp_path / "hide"
    hide.mkdir()
    # sitecustomize runs at every interpreter's start: treelite cannot be found or imported
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["treelite"] = None\n')
    path = os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])
    svc = start_service(
        ["--model-repository", str(repo), "--redis-url", redis_url], env={"PYTHONPATH": path}
    )
    try:
        with httpclient.InferenceServerClient(svc.http_url) as client:
            index = {m["name"]: m for m in client.get_model_repository_index()}
            assert index["add_sub"]["state"] == "READY"
    finally:
        stop_service(svc)
    assert index["xgb_json"]["state"] == "UNAVAILABLE"
    assert "pip install 'sluice-serve[fil]'" in index["xgb_json"]["reason"]
    assert "treelite" in index["xgb_json"]["reason"]


def test_the_worker_warns_as_triton_of_old_parameters_and_legacy_names(service: Service) -> None:
    log = "".join(service.log)
    assert "The `output_class` parameter has been removed" in log
    assert (
        "model_type 'xgboost' names XGBoost's legacy binary format, but the file is UBJSON" in log
    )
