"""Every deployment file in deploy/ is valid for the tool that reads it, checked offline, and
each validator rejects a broken file (the validators: tests/deploy_files.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy_files import (
    BUILTIN,
    COMPOSE_FILES,
    K8S_VERSIONS,
    KEDA,
    KEDA_CRDS,
    MANIFESTS,
    Doc,
    load_compose,
    manifest_id,
    one_of_kind,
    validate_builtin,
    validate_compose,
    validate_keda,
)

# -- every file against its schema ---------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", BUILTIN, ids=manifest_id)
def test_kubernetes_manifest_matches_the_kubernetes_schema(
    item: tuple[str, Doc], version: str
) -> None:
    validate_builtin(item[1], version)


@pytest.mark.parametrize("item", KEDA, ids=manifest_id)
def test_keda_manifest_matches_the_keda_crd_schema(item: tuple[str, Doc]) -> None:
    validate_keda(item[1])


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_matches_the_compose_spec(name: str) -> None:
    validate_compose(load_compose(name))


def test_manifests_cover_what_sluice_deploys() -> None:
    kinds = {doc["kind"] for _, doc in MANIFESTS}
    assert kinds >= {
        "Namespace",
        "Secret",
        "Service",
        "StatefulSet",
        "Deployment",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "TriggerAuthentication",
    }
    assert {doc["kind"] for _, doc in KEDA} == set(KEDA_CRDS)


# -- the validators do reject broken files -------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def apply(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


BROKEN_BUILTIN = {
    "unknown field": ("Deployment", "sluice-worker", _set("spec.replica", 2)),
    "port as text": (
        "Deployment",
        "sluice-gateway",
        _set("spec.template.spec.containers.0.ports.0.containerPort", "8000"),
    ),
    "probe without handler field": (
        "Deployment",
        "sluice-worker",
        _set("spec.template.spec.containers.0.readinessProbe.httpGet", {"path": "/v2/health"}),
    ),
    "pvc access mode list": (
        "PersistentVolumeClaim",
        "sluice-model-repository",
        _set("spec.accessModes", "ReadOnlyMany"),
    ),
    "hpa v1 field in v2": (
        "HorizontalPodAutoscaler",
        "sluice-gateway",
        _set("spec.targetCPUUtilizationPercentage", 70),
    ),
}
BROKEN_KEDA = {
    "hpa field name": ("ScaledObject", "sluice-worker", _set("spec.minReplicas", 1)),
    "trigger metadata not text": (
        "ScaledObject",
        "sluice-worker",
        _set("spec.triggers.0.metadata.lagCount", 64),
    ),
    "trigger without type": (
        "ScaledObject",
        "sluice-worker",
        _set("spec.triggers.0", {"metadata": {"stream": "s"}}),
    ),
    "secret ref without key": (
        "TriggerAuthentication",
        "sluice-redis",
        _set("spec.secretTargetRef.0", {"parameter": "password", "name": "sluice-redis"}),
    ),
}
BROKEN_COMPOSE = {
    "unknown depends_on condition": _set("services.gateway.depends_on.redis.condition", "ready"),
    "unknown healthcheck field": _set("services.redis.healthcheck.intervall", "5s"),
    "unknown service field": _set("services.worker.replicas", 2),
}


@pytest.mark.parametrize("case", BROKEN_BUILTIN)
def test_kubernetes_schema_rejects_a_broken_manifest(case: str) -> None:
    kind, name, breaks = BROKEN_BUILTIN[case]
    doc = copy.deepcopy(one_of_kind(kind, name))
    validate_builtin(doc)
    breaks(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_builtin(doc)


@pytest.mark.parametrize("case", BROKEN_KEDA)
def test_keda_schema_rejects_a_broken_manifest(case: str) -> None:
    kind, name, breaks = BROKEN_KEDA[case]
    doc = copy.deepcopy(one_of_kind(kind, name))
    validate_keda(doc)
    breaks(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_keda(doc)


def test_kubernetes_validate_knows_no_keda_kind() -> None:
    """Why the KEDA kinds need their CRD schemas: the built-in validator has none for them."""
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_builtin(one_of_kind("ScaledObject", "sluice-worker"))


@pytest.mark.parametrize("case", BROKEN_COMPOSE)
def test_compose_schema_rejects_a_broken_file(case: str) -> None:
    doc = load_compose("docker-compose.yml")
    BROKEN_COMPOSE[case](doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_compose(doc)
