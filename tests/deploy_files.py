"""The deployment files in deploy/ as the tests read them: loaders and offline validators.

Kubernetes built-in kinds: the JSON schemas that the kubernetes-validate package ships, in strict
mode (an unknown field is an error, as with `kubectl apply --validate=strict`). KEDA's kinds: the
openAPIV3Schema of KEDA's CRDs, copied to tests/schemas/, with unknown fields rejected the same
way. Compose files: the compose-spec JSON schema (tests/schemas/).
"""

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKER = DEPLOY / "docker"
SCHEMAS = Path(__file__).parent / "schemas"
EXAMPLE_REPOSITORY = ROOT / "examples" / "model_repository"
#: an older Kubernetes still widely run, and the newest one kubernetes-validate knows
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
KEDA_CRDS = {
    "ScaledObject": "keda.sh_scaledobjects.yaml",
    "TriggerAuthentication": "keda.sh_triggerauthentications.yaml",
}
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")

Doc = dict[str, Any]


def load_manifests() -> list[tuple[str, Doc]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


MANIFESTS = load_manifests()
BUILTIN = [(f, d) for f, d in MANIFESTS if not d["apiVersion"].startswith("keda.sh/")]
KEDA = [(f, d) for f, d in MANIFESTS if d["apiVersion"].startswith("keda.sh/")]


def manifest_id(item: tuple[str, Doc]) -> str:
    file, doc = item
    return f"{file}:{doc['kind']}/{doc['metadata']['name']}"


def all_of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def one_of_kind(kind: str, name: str) -> Doc:
    (doc,) = [doc for doc in all_of_kind(kind) if doc["metadata"]["name"] == name]
    return doc


def containers_of(workload: Doc) -> list[Doc]:
    return workload["spec"]["template"]["spec"]["containers"]


def env_of(container: Doc) -> dict[str, Doc]:
    return {var["name"]: var for var in container.get("env", [])}


def ports_of(container: Doc) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def strict_schema(schema: Doc) -> Doc:
    """`additionalProperties: false` wherever a CRD schema lists its fields.

    The API server prunes unknown fields of a custom resource, and `kubectl apply` (field
    validation Strict by default) refuses them; plain JSON Schema would accept them silently.
    """
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@functools.cache
def keda_validator(kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((SCHEMAS / KEDA_CRDS[kind]).read_text())
    assert crd["spec"]["group"] == "keda.sh"
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate_keda(doc: Doc) -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1", doc["apiVersion"]
    keda_validator(doc["kind"]).validate(doc)


def validate_builtin(doc: Doc, version: str = K8S_VERSIONS[-1]) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@functools.cache
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


COMPOSE_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


def interpolate(node: Any) -> Any:
    """Compose's `${VAR:-default}` interpolation with every variable unset (the defaults)."""
    if isinstance(node, dict):
        return {key: interpolate(value) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value) for value in node]
    if isinstance(node, str):
        return COMPOSE_VARIABLE.sub(lambda m: "$" if m[0] == "$$" else (m["default"] or ""), node)
    return node


def load_compose(name: str) -> Doc:
    return interpolate(yaml.safe_load((DEPLOY / name).read_text()))


def validate_compose(doc: Doc) -> None:
    compose_validator().validate(doc)
