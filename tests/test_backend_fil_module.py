"""The FIL backend module on its own: Triton FIL's post-processing of scores (labels,
thresholds, probabilities), its parameters, and loading model files directly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xgboost
from sklearn.datasets import load_breast_cancer, load_iris
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.workers.backends import fil
from sluice.workers.backends.fil import FilOptions, fil_output, parse_options

from tests.fil_models import classifier, fil_config, save_model, write_model


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
    parameters = classifier("xgboost_json", predict_proba="true")
    save_model(tmp_path, "nan", (30, 2), parameters, "xgboost.json", model.save_model)
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
    config = fil_config("shap", 30, 1, parameters=classifier("xgboost_json")).replace(
        "output [ {", 'output [ { name: "treeshap_output" data_type: TYPE_FP32 dims: [ 31 ] }, {'
    )
    path = write_model(tmp_path, "shap", config, "xgboost.json")
    xgboost.XGBClassifier(n_estimators=3, max_depth=2).fit(x, y).save_model(str(path))
    spec = load_model_config(tmp_path / "shap", complete=fil.complete_config)
    with pytest.raises(ModelConfigError) as err:
        fil.load_instance(spec, tmp_path / "shap", 1, torch.device("cpu"), 0)
    assert str(err.value).endswith(
        "output: a FIL model has the one output 'output__0', got ['treeshap_output', "
        "'output__0'] (sluice does not compute 'treeshap_output')"
    )
