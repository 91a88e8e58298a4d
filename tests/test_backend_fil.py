"""Tree models with Triton's FIL config, served by `sluice serve` and driven with tritonclient.

Each model is trained here on a data set scikit-learn ships, saved in one of FIL's formats
(XGBoost legacy name, JSON, UBJSON; LightGBM text; a Treelite checkpoint of a scikit-learn
forest) beside the config.pbtxt Triton's FIL documentation gives, and its answers under
concurrent requests (which batch) are compared with the framework's own predictions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightgbm
import numpy as np
import pytest
import torch
import treelite
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost
from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris
from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.workers.backends import fil
from sluice.workers.backends.fil import FilOptions, fil_output, parse_options
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, serving_alone, start_service, stop_service

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = "breast_cancer_xgb"
#: the batcher waits this long for more rows, so that concurrent requests form batches
DELAY_US = 200_000
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


def fil_config(
    name: str, features: int, out: int, *, parameters: dict[str, str], input_name: str = "input__0"
) -> str:
    """A config.pbtxt as Triton's FIL documentation writes it."""
    params = ",\n".join(
        f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in parameters.items()
    )
    return (
        textwrap.dedent(
            f"""\
        name: "{name}"
        backend: "fil"
        max_batch_size: 32768
        input [ {{ name: "{input_name}" data_type: TYPE_FP32 dims: [ {features} ] }} ]
        output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {out} ] }} ]
        instance_group [ {{ kind: KIND_AUTO }} ]
        dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} }}
        parameters [
        """
        )
        + f"{params}\n]\n"
    )


def _write(repo: Path, name: str, config: str, filename: str) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name / "1" / filename


def _model(
    repo: Path, name: str, dims: tuple[int, int], parameters: dict[str, str], filename: str
) -> Path:
    """Write the model's FIL config; the path its model file goes to."""
    return _write(repo, name, fil_config(name, *dims, parameters=parameters), filename)


def _saved(
    repo: Path,
    name: str,
    dims: tuple[int, int],
    parameters: dict[str, str],
    filename: str,
    save: Callable[[str], object],
) -> None:
    """Write the model's FIL config and `save` its model file."""
    save(str(_model(repo, name, dims, parameters, filename)))


def _classifier(model_type: str, **extra: str) -> dict[str, str]:
    return {"model_type": model_type, "is_classifier": "true", **extra}


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
    path = _model(repo, "xgb_legacy_name", (30, 1), {"is_classifier": "true"}, "xgboost.model")
    binary.get_booster().save_model(str(path.with_suffix(".ubj")))
    path.with_suffix(".ubj").rename(path)
    cases["xgb_legacy_name"] = Case(cancer_x, lambda x: binary.predict(x)[:, None], exact=True)
    _saved(
        repo, "xgb_json", (30, 1), _classifier("xgboost_json"), "xgboost.json", binary.save_model
    )
    cases["xgb_json"] = Case(cancer_x, lambda x: binary.predict(x)[:, None], exact=True)
    params = _classifier("xgboost_ubj", predict_proba="true")
    _saved(repo, "xgb_ubj_proba", (30, 2), params, "xgboost.ubj", binary.save_model)
    cases["xgb_ubj_proba"] = Case(cancer_x, proba, exact=False)
    params = _classifier("xgboost_json", threshold="0.9")
    _saved(repo, "xgb_threshold", (30, 1), params, "xgboost.json", binary.save_model)
    cases["xgb_threshold"] = Case(cancer_x, lambda x: (proba(x)[:, 1:] > 0.9) * 1.0, exact=True)
    # the pre-25.09 parameter name, which Triton still honours
    params = {"model_type": "xgboost_json", "output_class": "true", "predict_proba": "true"}
    _saved(repo, "xgb_output_class", (30, 1), params, "xgboost.json", binary.save_model)
    cases["xgb_output_class"] = Case(cancer_x, lambda x: proba(x)[:, 1:], exact=False)

    multi = xgboost.XGBClassifier(n_estimators=10, max_depth=3).fit(iris_x, iris_y)
    _saved(repo, "xgb_iris", (4, 1), _classifier("xgboost_ubj"), "xgboost.ubj", multi.save_model)
    cases["xgb_iris"] = Case(iris_x, lambda x: multi.predict(x)[:, None], exact=True)
    params = _classifier("xgboost_json", predict_proba="true")
    _saved(repo, "xgb_iris_proba", (4, 3), params, "xgboost.json", multi.save_model)
    cases["xgb_iris_proba"] = Case(iris_x, multi.predict_proba, exact=False)

    regressor = xgboost.XGBRegressor(n_estimators=20, max_depth=3).fit(diabetes_x, diabetes_y)
    params = {"model_type": "xgboost_json", "is_classifier": "false"}
    _saved(repo, "xgb_diabetes", (10, 1), params, "xgboost.json", regressor.save_model)
    cases["xgb_diabetes"] = Case(diabetes_x, lambda x: regressor.predict(x)[:, None], exact=False)

    lgb_multi = lightgbm.LGBMClassifier(n_estimators=10, verbose=-1).fit(iris_x, iris_y)
    _saved(
        repo,
        "lgb_iris",
        (4, 1),
        _classifier("lightgbm"),
        "model.txt",
        lgb_multi.booster_.save_model,
    )
    cases["lgb_iris"] = Case(iris_x, lambda x: lgb_multi.predict(x)[:, None], exact=True)
    lgb_binary = lightgbm.LGBMClassifier(n_estimators=10, verbose=-1).fit(cancer_x, cancer_y)
    params = _classifier("lightgbm", predict_proba="true")
    _saved(repo, "lgb_cancer_proba", (30, 1), params, "model.txt", lgb_binary.booster_.save_model)
    cases["lgb_cancer_proba"] = Case(
        cancer_x, lambda x: lgb_binary.predict_proba(x)[:, 1:], exact=False
    )

    forest = RandomForestClassifier(n_estimators=10, max_depth=4, random_state=0)
    forest.fit(iris_x, iris_y)
    params = _classifier("treelite_checkpoint", predict_proba="true")
    _saved(
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
    _saved(
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
        _write(repo, name, config, "xgboost.json").write_bytes(source.read_bytes())


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
    path = _write(repo, EXAMPLE, (source / "config.pbtxt").read_text(), "xgboost.ubj")
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
    _write(repo, "xgb_json", (source / "config.pbtxt").read_text(), "xgboost.json").write_bytes(
        (source / "1" / "xgboost.json").read_bytes()
    )
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


# The backend module on its own: Triton FIL's post-processing and parameter reading.


def _options(**given: str) -> FilOptions:
    return parse_options(
        {"is_classifier": "true", **given}, lambda field, message: ModelConfigError(field)
    )


def test_a_multiclass_label_is_the_first_best_class_and_0_when_no_score_is_positive() -> None:
    scores = np.array([[0.2, 0.5, 0.5], [0.0, 0.0, 0.0], [-2.0, -1.0, -3.0]], np.float32)
    labels = fil_output(scores, _options(), width=1)
    assert labels.tolist() == [[1.0], [0.0], [0.0]]


def test_a_binary_label_needs_a_score_above_the_threshold() -> None:
    scores = np.array([[0.3], [0.30001], [0.9]], np.float32)
    assert fil_output(scores, _options(threshold="0.3"), width=1).tolist() == [[0], [1], [1]]


def test_binary_probabilities_come_as_one_score_or_both_classes() -> None:
    scores = np.array([[0.25], [1.0]], np.float32)
    proba = _options(predict_proba="true")
    assert fil_output(scores, proba, width=1).tolist() == [[0.25], [1.0]]
    assert fil_output(scores, proba, width=2).tolist() == [[0.75, 0.25], [0.0, 1.0]]


def test_a_regressor_answers_its_scores_and_ignores_the_threshold() -> None:
    scores = np.array([[-3.5], [120.0]], np.float32)
    options = _options(is_classifier="false", threshold="7")
    assert options.threshold == 0.5
    assert fil_output(scores, options, width=1).tolist() == [[-3.5], [120.0]]


def test_the_older_output_class_wins_over_is_classifier_as_in_triton() -> None:
    assert not _options(output_class="false").is_classifier
    assert _options(output_class="maybe").is_classifier  # not a flag: is_classifier decides


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"predict_proba": "yes"}, "parameters.predict_proba"),
        ({"cpu_nthread": "all"}, "parameters.cpu_nthread"),
        ({"is_classifier": ""}, "parameters.is_classifier"),
        ({"model_type": "xgboost_binary"}, "parameters.model_type"),
    ],
)
def test_a_bad_parameter_is_named(given: dict[str, str], field: str) -> None:
    with pytest.raises(ModelConfigError) as err:
        _options(**given)
    assert str(err.value) == field


def test_missing_values_go_where_xgboost_sends_them(tmp_path: Path) -> None:
    """NaN features take each split's default branch, as in XGBoost's own predict."""
    x, y = load_breast_cancer(return_X_y=True)
    x = x.astype(np.float32)
    model = xgboost.XGBClassifier(n_estimators=10, max_depth=3).fit(x, y)
    parameters = _classifier("xgboost_json", predict_proba="true")
    _saved(tmp_path, "nan", (30, 2), parameters, "xgboost.json", model.save_model)
    spec = load_model_config(tmp_path / "nan", complete=fil.complete_config)
    infer = fil.load_instance(spec, tmp_path / "nan", 1, torch.device("cpu"), 0)
    rows = x[:50].copy()
    rows[np.random.default_rng(0).random(rows.shape) < 0.3] = np.nan
    served = infer({"input__0": torch.from_numpy(rows)})["output__0"]
    np.testing.assert_allclose(served, model.predict_proba(rows), rtol=1e-5, atol=1e-6)


def test_a_json_file_under_the_legacy_name_loads_as_json(tmp_path: Path) -> None:
    x, y = load_iris(return_X_y=True)
    model = xgboost.XGBClassifier(n_estimators=5, max_depth=2).fit(x, y)
    path = tmp_path / "xgboost.model"
    model.save_model(str(tmp_path / "m.json"))
    (tmp_path / "m.json").rename(path)
    forest = fil.load_forest(path, _options())
    assert forest.num_feature == 4


def test_a_file_that_is_no_model_is_refused_with_its_path_and_format(tmp_path: Path) -> None:
    path = tmp_path / "model.txt"
    path.write_text("not a LightGBM model\n")
    with pytest.raises(ModelConfigError) as err:
        fil.load_forest(path, _options(model_type="lightgbm"))
    assert str(err.value).startswith(f"{path}: cannot load as model_type 'lightgbm': ")


def test_unknown_json_fields_load_only_when_allowed(tmp_path: Path) -> None:
    x, y = load_iris(return_X_y=True)
    path = tmp_path / "xgboost.json"
    xgboost.XGBClassifier(n_estimators=3, max_depth=2).fit(x, y).save_model(str(path))
    document = json.loads(path.read_text())
    document["learner"]["written_by_a_newer_xgboost"] = 1
    path.write_text(json.dumps(document))
    with pytest.raises(ModelConfigError, match="cannot load as model_type 'xgboost_json'"):
        fil.load_forest(path, _options(model_type="xgboost_json"))
    allowed = _options(model_type="xgboost_json", xgboost_allow_unknown_field="true")
    with pytest.warns(UserWarning, match="written_by_a_newer_xgboost"):
        assert fil.load_forest(path, allowed).num_feature == 4


def test_a_shap_output_is_refused_saying_so(tmp_path: Path) -> None:
    x, y = load_breast_cancer(return_X_y=True)
    config = fil_config("shap", 30, 1, parameters=_classifier("xgboost_json")).replace(
        "output [ {", 'output [ { name: "treeshap_output" data_type: TYPE_FP32 dims: [ 31 ] }, {'
    )
    path = _write(tmp_path, "shap", config, "xgboost.json")
    xgboost.XGBClassifier(n_estimators=3, max_depth=2).fit(x, y).save_model(str(path))
    spec = load_model_config(tmp_path / "shap", complete=fil.complete_config)
    with pytest.raises(ModelConfigError) as err:
        fil.load_instance(spec, tmp_path / "shap", 1, torch.device("cpu"), 0)
    assert str(err.value).endswith(
        "output: a FIL model has the one output 'output__0', got ['treeshap_output', "
        "'output__0'] (sluice does not compute 'treeshap_output')"
    )
