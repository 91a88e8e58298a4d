"""The deployment files in deploy/ are valid for the tools that read them, checked offline.

Kubernetes built-in kinds: the JSON schemas that the kubernetes-validate package ships, in strict
mode (an unknown field is an error, as with `kubectl apply --validate=strict`). KEDA's kinds: the
openAPIV3Schema of KEDA's CRDs, copied to tests/schemas/, with unknown fields rejected the same
way. Compose files: the compose-spec JSON schema (tests/schemas/). Then what no schema knows: the
names that must agree across files (Secret keys, claims, labels, ports, the Redis streams and
consumer group that sluice uses, the model repository the triggers cover).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared import keys
from shared.model_config import load_model_config
from shared.queue_policy import QueuePolicy

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


def _load_manifests() -> list[tuple[str, Doc]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


MANIFESTS = _load_manifests()
BUILTIN = [(f, d) for f, d in MANIFESTS if not d["apiVersion"].startswith("keda.sh/")]
KEDA = [(f, d) for f, d in MANIFESTS if d["apiVersion"].startswith("keda.sh/")]


def _name(item: tuple[str, Doc]) -> str:
    file, doc = item
    return f"{file}:{doc['kind']}/{doc['metadata']['name']}"


def _all(kind: str) -> list[Doc]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def _one(kind: str, name: str) -> Doc:
    (doc,) = [doc for doc in _all(kind) if doc["metadata"]["name"] == name]
    return doc


def _containers(workload: Doc) -> list[Doc]:
    return workload["spec"]["template"]["spec"]["containers"]


def _env(container: Doc) -> dict[str, Doc]:
    return {var["name"]: var for var in container.get("env", [])}


def _ports(container: Doc) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def _strict(schema: Doc) -> Doc:
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
def _keda_validator(kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((SCHEMAS / KEDA_CRDS[kind]).read_text())
    assert crd["spec"]["group"] == "keda.sh"
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate_keda(doc: Doc) -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1", doc["apiVersion"]
    _keda_validator(doc["kind"]).validate(doc)


def validate_builtin(doc: Doc, version: str = K8S_VERSIONS[-1]) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@functools.cache
def _compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


def _interpolate(node: Any) -> Any:
    """Compose's `${VAR:-default}` interpolation with every variable unset (the defaults)."""
    if isinstance(node, dict):
        return {key: _interpolate(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate(value) for value in node]
    if isinstance(node, str):
        return _VARIABLE.sub(lambda m: "$" if m[0] == "$$" else (m["default"] or ""), node)
    return node


def load_compose(name: str) -> Doc:
    return _interpolate(yaml.safe_load((DEPLOY / name).read_text()))


def validate_compose(doc: Doc) -> None:
    _compose_validator().validate(doc)


# -- every file against its schema ---------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", BUILTIN, ids=_name)
def test_kubernetes_manifest_matches_the_kubernetes_schema(
    item: tuple[str, Doc], version: str
) -> None:
    validate_builtin(item[1], version)


@pytest.mark.parametrize("item", KEDA, ids=_name)
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
    doc = copy.deepcopy(_one(kind, name))
    validate_builtin(doc)
    breaks(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_builtin(doc)


@pytest.mark.parametrize("case", BROKEN_KEDA)
def test_keda_schema_rejects_a_broken_manifest(case: str) -> None:
    kind, name, breaks = BROKEN_KEDA[case]
    doc = copy.deepcopy(_one(kind, name))
    validate_keda(doc)
    breaks(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_keda(doc)


def test_kubernetes_validate_knows_no_keda_kind() -> None:
    """Why the KEDA kinds need their CRD schemas: the built-in validator has none for them."""
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_builtin(_one("ScaledObject", "sluice-worker"))


@pytest.mark.parametrize("case", BROKEN_COMPOSE)
def test_compose_schema_rejects_a_broken_file(case: str) -> None:
    doc = load_compose("docker-compose.yml")
    BROKEN_COMPOSE[case](doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_compose(doc)


# -- kustomize -----------------------------------------------------------------------------------


def _kustomization() -> Doc:
    return yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())


def test_kustomization_lists_every_manifest_once() -> None:
    resources = _kustomization()["resources"]
    assert len(resources) == len(set(resources))
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(resources) == on_disk
    assert not list(KUBERNETES.glob("*.yml")), "kustomize lists .yaml files here"


def test_everything_lives_in_the_kustomization_namespace() -> None:
    namespace = _kustomization()["namespace"]
    assert [doc["metadata"]["name"] for doc in _all("Namespace")] == [namespace]
    for item in MANIFESTS:
        if item[1]["kind"] != "Namespace":
            assert item[1]["metadata"]["namespace"] == namespace, _name(item)


def test_sluice_images_are_the_ones_kustomize_sets() -> None:
    images = {image["name"]: image for image in _kustomization()["images"]}
    for kind in WORKLOAD_KINDS:
        for workload in _all(kind):
            for container in _containers(workload):
                name, _, tag = container["image"].rpartition(":")
                assert name and re.match(r"\d", tag), container["image"]
                if name.startswith("sluice-"):
                    assert images[name]["newTag"] == tag
    dockerfiles = {p.name.removeprefix("Dockerfile.") for p in DOCKER.glob("Dockerfile.*")}
    assert set(images) == {f"sluice-{role}" for role in dockerfiles}


# -- names that must agree across manifests ------------------------------------------------------


def _workload_matching(selector: dict[str, str]) -> Doc:
    (workload,) = [
        w
        for kind in WORKLOAD_KINDS
        for w in _all(kind)
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    return workload


def test_workload_selectors_match_their_pod_labels() -> None:
    for kind in WORKLOAD_KINDS:
        for workload in _all(kind):
            selector = workload["spec"]["selector"]["matchLabels"]
            assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_services_select_one_workload_and_its_named_ports() -> None:
    for service in _all("Service"):
        workload = _workload_matching(service["spec"]["selector"])
        ports = {n for c in _containers(workload) for n in _ports(c)}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


def test_disruption_budgets_select_one_workload() -> None:
    for budget in _all("PodDisruptionBudget"):
        _workload_matching(budget["spec"]["selector"]["matchLabels"])


def _secret_keys() -> dict[str, set[str]]:
    return {
        s["metadata"]["name"]: set(s.get("stringData", {})) | set(s.get("data", {}))
        for s in _all("Secret")
    }


def test_secret_references_resolve() -> None:
    secrets = _secret_keys()
    refs = []
    for kind in WORKLOAD_KINDS:
        for workload in _all(kind):
            for container in _containers(workload):
                refs += [
                    var["valueFrom"]["secretKeyRef"]
                    for var in container.get("env", [])
                    if "secretKeyRef" in var.get("valueFrom", {})
                ]
    refs += [
        ref for auth in _all("TriggerAuthentication") for ref in auth["spec"]["secretTargetRef"]
    ]
    assert refs
    for ref in refs:
        assert ref["key"] in secrets[ref["name"]], ref


def test_redis_secret_entries_agree() -> None:
    """SLUICE_REDIS_URL (gateways, workers) and KEDA's address and password name one Redis."""
    (secret,) = _all("Secret")
    data = secret["stringData"]
    url = urlsplit(data["redis-url"])
    host, port = data["redis-address"].rsplit(":", 1)
    assert url.scheme in ("redis", "rediss")
    assert url.password == data["redis-password"]
    assert url.port == int(port)
    assert host == url.hostname or host.startswith(f"{url.hostname}.")
    # KEDA runs in its own namespace: an in-cluster Service must be named in full
    if host.split(".")[0] in {s["metadata"]["name"] for s in _all("Service")}:
        assert host.split(".")[1] == secret["metadata"]["namespace"]
    assert url.path in ("", "/0")  # the triggers' databaseIndex


def test_redis_keeps_queued_requests() -> None:
    (redis,) = _containers(_one("StatefulSet", "sluice-redis"))
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "REDIS_PASSWORD" in _env(redis)
    assert int(redis["image"].split(":")[1].split(".")[0]) >= 7  # consumer group lag for KEDA


# -- gateway -------------------------------------------------------------------------------------


def test_gateway_probes_drain_and_scrape() -> None:
    gateway = _one("Deployment", "sluice-gateway")
    pod = gateway["spec"]["template"]
    (container,) = _containers(gateway)
    ports = _ports(container)
    env = _env(container)
    assert ports == {
        "http": int(env["SLUICE_HTTP_PORT"]["value"]),
        "metrics": int(env["SLUICE_METRICS_PORT"]["value"]),
    }
    assert env["SLUICE_HOST"]["value"] == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # the endpoint is removed during preStop, then SIGTERM leaves up to 30 s for in-flight requests
    (_, pre_stop_seconds) = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(pre_stop_seconds) + 30
    assert "cpu" in container["resources"]["requests"]  # the HPA's utilization is of requests
    # the scrape annotations, and what the kubernetes_sd job in deploy/prometheus keys on
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "sluice-gateway"
    assert "regex: sluice-gateway" in (DEPLOY / "prometheus" / "prometheus.yml").read_text()


def test_gateway_hpa_scales_the_gateway_on_cpu() -> None:
    (hpa,) = _all("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "sluice-gateway")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in _one("Deployment", "sluice-gateway")["spec"]


# -- workers and KEDA ----------------------------------------------------------------------------


def test_worker_gets_a_gpu_the_models_and_time_to_finish_its_batch() -> None:
    worker = _one("Deployment", "sluice-worker")
    pod = worker["spec"]["template"]["spec"]
    (container,) = _containers(worker)
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= 60
    env = _env(container)
    health = _ports(container)["health"]
    assert int(env["SLUICE_HEALTH_PORT"]["value"]) == health
    for probe, path in (("readinessProbe", "ready"), ("livenessProbe", "live")):
        assert container[probe]["httpGet"] == {"path": f"/v2/health/{path}", "port": "health"}
    (mount,) = container["volumeMounts"]
    assert mount["readOnly"] and mount["mountPath"] == env["SLUICE_MODEL_REPOSITORY"]["value"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert "replicas" not in worker["spec"], "KEDA owns the worker count"


def _example_streams() -> Iterator[tuple[str, str, int]]:
    """(model, stream, max_batch_size) for every queue of the example repository."""
    for model_dir in sorted(EXAMPLE_REPOSITORY.iterdir()):
        if (model_dir / "config.pbtxt").is_file():
            spec = load_model_config(model_dir)
            for level in QueuePolicy.from_config(spec.config_json).levels:
                yield spec.name, keys.request_stream(spec.name, level), spec.max_batch_size


def test_keda_watches_every_example_model_queue_with_the_worker_group() -> None:
    (scaled,) = _all("ScaledObject")
    triggers = scaled["spec"]["triggers"]
    expected = {stream: batch for _, stream, batch in _example_streams()}
    assert {m for m, _, _ in _example_streams()} == {"mlp", "digits", "add_sub"}
    assert {t["metadata"]["stream"] for t in triggers} == set(expected)
    assert len(triggers) == len(expected)
    auths = {a["metadata"]["name"] for a in _all("TriggerAuthentication")}
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["consumerGroup"] == keys.WORKER_GROUP
        # lag (undelivered entries, needs Redis 7) is the backlog; one batch per worker
        assert int(meta["lagCount"]) == expected[meta["stream"]]
        assert int(meta["activationLagCount"]) >= 0
        assert meta["databaseIndex"] == "0"
        assert meta["enableTLS"] in ("true", "false")
        assert "pendingEntriesCount" not in meta and "streamLength" not in meta
        assert trigger["authenticationRef"]["name"] in auths
        assert not {"address", "password"} & set(meta), "from the TriggerAuthentication"


def test_keda_scales_the_worker_deployment_and_never_to_zero() -> None:
    (scaled,) = _all("ScaledObject")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment", "sluice-worker")
    # a gateway is ready only while models have a live worker: zero workers, no traffic
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (auth,) = _all("TriggerAuthentication")
    parameters = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
    assert parameters == {"address", "password"}


def test_stream_key_names_match_the_workers() -> None:
    """Guards the literal names in keda.yaml against a change of shared/keys.py."""
    assert keys.request_stream("mlp") == "sluice:{m:mlp}:requests"
    assert keys.WORKER_GROUP == "workers"


# -- docker compose ------------------------------------------------------------------------------


def test_compose_services_wait_for_healthy_dependencies() -> None:
    services = load_compose("docker-compose.yml")["services"]
    assert set(services) == {"redis", "worker", "bulk-worker", "gateway", "prometheus", "grafana"}
    for name, service in services.items():
        assert "healthcheck" in service, name
        for dependency, how in service.get("depends_on", {}).items():
            assert dependency in services
            assert how["condition"] in ("service_healthy", "service_started"), (name, how)
    assert services["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["redis"]["command"][1:3] == ["--appendonly", "yes"]


def test_compose_workers_and_gateway() -> None:
    services = load_compose("docker-compose.yml")["services"]
    worker, gateway = services["worker"], services["gateway"]
    assert int(worker["deploy"]["replicas"]) == 2
    assert worker["stop_grace_period"] == "60s"
    (models,) = worker["volumes"]
    assert (
        models["read_only"] and models["target"] == worker["environment"]["SLUICE_MODEL_REPOSITORY"]
    )
    assert (DEPLOY / models["source"]).resolve() == EXAMPLE_REPOSITORY.resolve()
    assert "8003" in worker["healthcheck"]["test"][-1]
    assert worker["environment"]["SLUICE_HEALTH_PORT"] == "8003"
    assert gateway["ports"] == ["8000:8000", "8002:8002"]
    assert "/v2/health/ready" in gateway["healthcheck"]["test"][-1]
    # Prometheus scrapes sluice-gateway:8002 (deploy/prometheus/prometheus.yml)
    assert "sluice-gateway" in gateway["networks"]["default"]["aliases"]
    for service in (worker, gateway):
        for env in ("SLUICE_REDIS_URL", "SLUICE_LOG_LEVEL"):
            assert env in service["environment"]


def test_compose_files_it_mounts_and_builds_exist() -> None:
    services = load_compose("docker-compose.yml")["services"]
    for name, service in services.items():
        if "build" in service:
            context = DEPLOY / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
    provisioning = DEPLOY / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "sluice.yml").read_text())[
        "providers"
    ]
    mounts = [v.split(":")[1] for v in services["grafana"]["volumes"] if v.startswith("./")]
    assert f"{provider['options']['path']}/sluice-dashboard.json" in mounts


# -- images --------------------------------------------------------------------------------------


def _pyproject() -> Doc:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("role", ["gateway", "worker"])
def test_dockerfile_pins_its_bases_and_torch_and_runs_unprivileged(role: str) -> None:
    text = (DOCKER / f"Dockerfile.{role}").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.M))
    bases = [
        args.get(b[2:-1], b) if b.startswith("${") else b
        for b in re.findall(r"^FROM (\S+)", text, re.M)
    ]
    assert len(bases) == 2
    for base in bases:
        _, _, tag = base.partition(":")
        assert re.match(r"\d+\.\d+\.\d+", tag), base  # a full version, never :latest
    (torch_pin,) = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert torch_pin in text
    final = text.rsplit("\nFROM ", 1)[1]
    (user,) = re.findall(r"^USER (\S+)$", final, re.M)
    assert user.split(":")[0] not in ("root", "0")
    assert "HEALTHCHECK" in final and "/v2/health/ready" in final
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    packages = {
        p.rstrip("*") for p in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert copied == packages


def test_gateway_image_takes_the_cpu_torch_build() -> None:
    text = (DOCKER / "Dockerfile.gateway").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu torch==" in text


def test_dockerignore_keeps_what_the_images_copy() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = set()
    for dockerfile in DOCKER.glob("Dockerfile.*"):
        for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile.read_text(), re.M):
            copied |= set(sources.split())
    assert copied >= {"pyproject.toml", "README.md"}
    for path in copied:
        assert (ROOT / path).exists(), path
        assert path not in ignored and path.split("/")[0] not in ignored, path
