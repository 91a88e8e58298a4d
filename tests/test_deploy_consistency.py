"""What no schema knows: the names that must agree across the deployment files (Secret keys,
claims, labels, ports, the Redis streams and consumer group that sluice uses, the model
repository the triggers cover, the image pins)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import yaml
from sluice.shared import keys
from sluice.shared.model_config import load_model_config
from sluice.shared.queue_policy import QueuePolicy

from tests.deploy_files import (
    DEPLOY,
    DOCKER,
    EXAMPLE_REPOSITORY,
    KUBERNETES,
    MANIFESTS,
    ROOT,
    WORKLOAD_KINDS,
    Doc,
    all_of_kind,
    containers_of,
    env_of,
    load_compose,
    manifest_id,
    one_of_kind,
    ports_of,
)

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
    assert [doc["metadata"]["name"] for doc in all_of_kind("Namespace")] == [namespace]
    for item in MANIFESTS:
        if item[1]["kind"] != "Namespace":
            assert item[1]["metadata"]["namespace"] == namespace, manifest_id(item)


def test_sluice_images_are_the_ones_kustomize_sets() -> None:
    images = {image["name"]: image for image in _kustomization()["images"]}
    for kind in WORKLOAD_KINDS:
        for workload in all_of_kind(kind):
            for container in containers_of(workload):
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
        for w in all_of_kind(kind)
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    return workload


def test_workload_selectors_match_their_pod_labels() -> None:
    for kind in WORKLOAD_KINDS:
        for workload in all_of_kind(kind):
            selector = workload["spec"]["selector"]["matchLabels"]
            assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_services_select_one_workload_and_its_named_ports() -> None:
    for service in all_of_kind("Service"):
        workload = _workload_matching(service["spec"]["selector"])
        ports = {n for c in containers_of(workload) for n in ports_of(c)}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


def test_disruption_budgets_select_one_workload() -> None:
    for budget in all_of_kind("PodDisruptionBudget"):
        _workload_matching(budget["spec"]["selector"]["matchLabels"])


def _secret_keys() -> dict[str, set[str]]:
    return {
        s["metadata"]["name"]: set(s.get("stringData", {})) | set(s.get("data", {}))
        for s in all_of_kind("Secret")
    }


def test_secret_references_resolve() -> None:
    secrets = _secret_keys()
    refs = []
    for kind in WORKLOAD_KINDS:
        for workload in all_of_kind(kind):
            for container in containers_of(workload):
                refs += [
                    var["valueFrom"]["secretKeyRef"]
                    for var in container.get("env", [])
                    if "secretKeyRef" in var.get("valueFrom", {})
                ]
    refs += [
        ref
        for auth in all_of_kind("TriggerAuthentication")
        for ref in auth["spec"]["secretTargetRef"]
    ]
    assert refs
    for ref in refs:
        assert ref["key"] in secrets[ref["name"]], ref


def test_redis_secret_entries_agree() -> None:
    """SLUICE_REDIS_URL (gateways, workers) and KEDA's address and password name one Redis."""
    (secret,) = all_of_kind("Secret")
    data = secret["stringData"]
    url = urlsplit(data["redis-url"])
    host, port = data["redis-address"].rsplit(":", 1)
    assert url.scheme in ("redis", "rediss")
    assert url.password == data["redis-password"]
    assert url.port == int(port)
    assert host == url.hostname or host.startswith(f"{url.hostname}.")
    # KEDA runs in its own namespace: an in-cluster Service must be named in full
    if host.split(".")[0] in {s["metadata"]["name"] for s in all_of_kind("Service")}:
        assert host.split(".")[1] == secret["metadata"]["namespace"]
    assert url.path in ("", "/0")  # the triggers' databaseIndex


def test_redis_keeps_queued_requests() -> None:
    (redis,) = containers_of(one_of_kind("StatefulSet", "sluice-redis"))
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "REDIS_PASSWORD" in env_of(redis)
    assert int(redis["image"].split(":")[1].split(".")[0]) >= 7  # consumer group lag for KEDA


# -- gateway -------------------------------------------------------------------------------------


def test_gateway_probes_drain_and_scrape() -> None:
    gateway = one_of_kind("Deployment", "sluice-gateway")
    pod = gateway["spec"]["template"]
    (container,) = containers_of(gateway)
    ports = ports_of(container)
    env = env_of(container)
    assert ports == {
        "http": int(env["SLUICE_HTTP_PORT"]["value"]),
        "grpc": int(env["SLUICE_GRPC_PORT"]["value"]),
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
    (hpa,) = all_of_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "sluice-gateway")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # idle polling would burn CPU at low load, which the autoscaler would read as load
    (container,) = one_of_kind("Deployment", "sluice-gateway")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SLUICE_IDLE_POLL_US"] == "0"
    assert "replicas" not in one_of_kind("Deployment", "sluice-gateway")["spec"]


# -- workers and KEDA ----------------------------------------------------------------------------


def test_worker_gets_a_gpu_the_models_and_time_to_finish_its_batch() -> None:
    worker = one_of_kind("Deployment", "sluice-worker")
    pod = worker["spec"]["template"]["spec"]
    (container,) = containers_of(worker)
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= 60
    env = env_of(container)
    health = ports_of(container)["health"]
    assert int(env["SLUICE_HEALTH_PORT"]["value"]) == health
    for probe, path in (("readinessProbe", "ready"), ("livenessProbe", "live")):
        assert container[probe]["httpGet"] == {"path": f"/v2/health/{path}", "port": "health"}
    (mount,) = container["volumeMounts"]
    assert mount["readOnly"] and mount["mountPath"] == env["SLUICE_MODEL_REPOSITORY"]["value"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = one_of_kind("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert "replicas" not in worker["spec"], "KEDA owns the worker count"


def _example_streams() -> Iterator[tuple[str, str, int]]:
    """(model, stream, max_batch_size) for every queue of the example repository."""
    for model_dir in sorted(EXAMPLE_REPOSITORY.iterdir()):
        if (model_dir / "config.pbtxt").is_file():
            spec = load_model_config(model_dir)
            if spec.kind == "ensemble":
                continue  # no queue of its own: its steps run on their models' queues
            for level in QueuePolicy.from_config(spec.config_json).levels:
                yield spec.name, keys.request_stream(spec.name, level), spec.max_batch_size


def test_keda_watches_every_example_model_queue_with_the_worker_group() -> None:
    (scaled,) = all_of_kind("ScaledObject")
    triggers = scaled["spec"]["triggers"]
    expected = {stream: batch for _, stream, batch in _example_streams()}
    assert {m for m, _, _ in _example_streams()} == {
        "mlp",
        "mlp_onnx",
        "mlp_openvino",
        "mlp_pt2",
        "mlp_tf",
        "digits",
        "add_sub",
        "digits_pre",
        "digits_post",
        "breast_cancer_xgb",
        "charlm",
    }
    assert {t["metadata"]["stream"] for t in triggers} == set(expected)
    assert len(triggers) == len(expected)
    auths = {a["metadata"]["name"] for a in all_of_kind("TriggerAuthentication")}
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
    (scaled,) = all_of_kind("ScaledObject")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment", "sluice-worker")
    # a gateway is ready only while models have a live worker: zero workers, no traffic
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (auth,) = all_of_kind("TriggerAuthentication")
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
    assert gateway["ports"] == ["8000:8000", "8001:8001", "8002:8002"]
    assert gateway["environment"]["SLUICE_GRPC_PORT"] == "8001"
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
def test_dockerfile_pins_its_bases_and_runs_unprivileged(role: str) -> None:
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
    final = text.rsplit("\nFROM ", 1)[1]
    (user,) = re.findall(r"^USER (\S+)$", final, re.M)
    assert user.split(":")[0] not in ("root", "0")
    assert "HEALTHCHECK" in final and "/v2/health/ready" in final
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    folders = set(_pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert copied == folders  # every folder the distribution's packages come from


def _instructions(role: str) -> str:
    text = (DOCKER / f"Dockerfile.{role}").read_text()
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def test_worker_image_installs_the_worker_extra_with_its_torch_pin() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    (torch_pin,) = [d for d in extras["worker"] if d.startswith("torch")]
    text = _instructions("worker")
    assert torch_pin in text
    assert "pip install '.[worker," in text
    # every backend's extra, so that no example model is UNAVAILABLE in the image
    for backend_extra in ("onnx", "fil", "openvino"):
        assert backend_extra in extras
        assert f",{backend_extra}" in text.split("pip install '.[worker", 1)[1].split("]", 1)[0]


def test_gateway_image_installs_the_base_distribution_without_torch() -> None:
    text = _instructions("gateway")
    assert "torch" not in text
    assert "pip install . " in text


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
