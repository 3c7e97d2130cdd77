"""deploy/kubernetes/ and deploy/kserve/, checked without a cluster.

The core resources are validated against the Kubernetes API's own schemas by
`kubernetes-validate --strict` (the command `make k8s-check` runs, for the Kubernetes version the
Makefile pins; offline: the package ships its schemas, and the run here is in a network namespace
of its own where the sandbox allows one). The KServe InferenceService is a custom resource, which
kubernetes-validate has no schema for (it only warns): it is parsed here and its required fields are
asserted instead. The rest checks what the issues ask of the manifests and that they agree with
each other, with the service's settings and metrics, and with the Dockerfile.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.delivery.support import ROOT, make_dry_run, require_tool

pytestmark = pytest.mark.delivery

KUBERNETES = ROOT / "deploy" / "kubernetes"
KSERVE = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
VARIANTS = ("cpu", "gpu")
POD_LABELS = {"app.kubernetes.io/name": "vitserve", "app.kubernetes.io/component": "server"}


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBERNETES.rglob("*") if p.suffix in {".yaml", ".yml"})


def resources(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def only(path: Path, kind: str) -> dict:
    (resource,) = resources(path)
    assert resource["kind"] == kind, path
    return resource


def deployment(variant: str) -> dict:
    return only(KUBERNETES / variant / "deployment.yaml", "Deployment")


def container(variant: str) -> dict:
    (main,) = deployment(variant)["spec"]["template"]["spec"]["containers"]
    return main


def configmap() -> dict[str, str]:
    return only(KUBERNETES / "common" / "configmap.yaml", "ConfigMap")["data"]


def quantity(value: str) -> float:
    """A Kubernetes quantity (cpu "500m", "2"; memory "512Mi", "1Gi") as a number."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match and match.group(2) in units, value
    return float(match.group(1)) * units[match.group(2)]


# --- validation --------------------------------------------------------------------------------


def k8s_check_command() -> list[str]:
    """The kubernetes-validate command `make k8s-check` runs, with this environment's binary."""
    lines = [
        line for line in make_dry_run("k8s-check").splitlines() if "kubernetes-validate" in line
    ]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    words[0] = require_tool("kubernetes-validate", "kubernetes-validate")
    return words


def offline(command: list[str]) -> list[str]:
    """``command`` in a network namespace of its own (no network at all) where that works here."""
    unshare = shutil.which("unshare")
    if os.geteuid() == 0 and unshare:
        probe = subprocess.run([unshare, "-n", "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [unshare, "-n", *command]
    return command


def test_make_test_runs_k8s_check_on_every_manifest_for_a_pinned_version():
    assert "kubernetes-validate --strict" in make_dry_run("test")
    command = k8s_check_command()
    assert "--strict" in command
    version = command[command.index("--kubernetes-version") + 1]
    assert re.fullmatch(r"1\.\d+\.\d+", version), version
    listed = {ROOT / word for word in command if word.endswith((".yaml", ".yml"))}
    assert listed == set(manifest_files())
    assert len(listed) >= 7


def test_every_manifest_passes_kubernetes_validate_strict_offline():
    result = subprocess.run(
        offline(k8s_check_command()), cwd=ROOT, capture_output=True, text=True, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # A kind it has no schema for is only a warning: nothing here may pass that way.
    assert "WARN" not in output and "ERROR" not in output, output
    for path in manifest_files():
        for resource in resources(path):
            name = f"{resource['kind'].lower()}/{resource['metadata']['name']}"
            assert f"{path.relative_to(ROOT)} passed for resource {name}" in output, output


def test_kubernetes_validate_cannot_check_the_inference_service():
    """Why the InferenceService is checked by the tests below instead."""
    command = k8s_check_command()
    files = [i for i, word in enumerate(command) if word.endswith((".yaml", ".yml"))]
    command = [*command[: files[0]], str(KSERVE)]
    result = subprocess.run(offline(command), capture_output=True, text=True, check=False)
    assert "Couldn't find schema for kind InferenceService" in result.stdout + result.stderr


def test_every_file_holds_complete_resources():
    for path in manifest_files():
        docs = resources(path)
        assert docs, path
        for resource in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(resource), path
            assert resource["metadata"].get("name"), path
            assert resource["kind"] != "Kustomization", path


# --- the Deployments ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_probes(variant):
    main = container(variant)
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "health": 8002}
    # the probes' own port, answered by the supervisor (not slowed by a flood: RELIABILITY.md)
    assert int(configmap()["VITSERVE_HEALTH_PORT"]) == ports["health"]
    paths = {
        probe: (main[probe]["httpGet"]["path"], main[probe]["httpGet"]["port"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    # started = ready once: liveness there is true from the supervisor's start, models loading
    assert paths == {
        "startupProbe": ("/health/ready", "health"),
        "livenessProbe": ("/health/live", "health"),
        "readinessProbe": ("/health/ready", "health"),
    }
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60, "time to load and warm up"


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_requests_and_limits(variant):
    resources_ = container(variant)["resources"]
    for name in ("cpu", "memory"):
        request = quantity(resources_["requests"][name])
        limit = quantity(resources_["limits"][name])
        assert 0 < request <= limit, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_security_context(variant):
    pod = deployment(variant)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    context = container(variant)["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in context


def test_pods_run_as_the_images_user():
    users = re.findall(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    for variant in VARIANTS:
        context = deployment(variant)["spec"]["template"]["spec"]["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) in users


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_writes_only_to_tmp_and_reads_models_from_the_claim(variant):
    pod = deployment(variant)["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container(variant)["volumeMounts"]}
    assert set(mounts) == {"/tmp", "/app/models", "/dev/shm"}
    # the front ends' shared-memory arenas (VITSERVE_ARENA_MIB each) need more than the 64 MiB a
    # container's /dev/shm has by default
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    arena = pytest.importorskip("service.settings").setting_fields()["arena_mib"].default
    assert shm["medium"] == "Memory" and quantity(shm["sizeLimit"]) >= 4 * arena * 2**20
    tmp = volumes[mounts["/tmp"]["name"]]
    assert "emptyDir" in tmp and not mounts["/tmp"].get("readOnly", False)
    # Starlette spools uploaded files over 1 MiB there: one body of the limit must fit.
    settings = pytest.importorskip("service.settings")
    limit = settings.setting_fields()["max_body_bytes"].default
    assert quantity(tmp["emptyDir"]["sizeLimit"]) >= limit
    models = mounts["/app/models"]
    assert models["readOnly"] is True
    claim = volumes[models["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    pvc = only(KUBERNETES / "common" / "pvc.yaml", "PersistentVolumeClaim")
    assert claim["claimName"] == pvc["metadata"]["name"]
    assert configmap()["VITSERVE_MODEL_REPOSITORY"] == "/app/models"


@pytest.mark.parametrize("variant", VARIANTS)
def test_termination_grace_covers_pre_stop_and_the_drain(variant):
    pod = deployment(variant)["spec"]["template"]["spec"]
    pre_stop = container(variant)["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(configmap()["VITSERVE_GRACEFUL_SHUTDOWN_S"])
    assert pre_stop > 0
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_takes_its_settings_from_the_configmap_only(variant):
    """No service links: a Service named vitserve would inject VITSERVE_PORT=tcp://..., which the
    service would read as its port."""
    pod = deployment(variant)["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    main = container(variant)
    assert main["envFrom"] == [{"configMapRef": {"name": "vitserve"}}]
    key = next(e for e in main["env"] if e["name"] == "VITSERVE_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True


def documented_settings() -> set[str]:
    text = (ROOT / ".env.example").read_text()
    return set(re.findall(r"\b(VITSERVE_[A-Z0-9_]+)=", text))


def test_every_variable_set_is_a_documented_setting():
    names = set(configmap())
    for variant in VARIANTS:
        names |= {e["name"] for e in container(variant)["env"] if e["name"].startswith("VITSERVE")}
    unknown = names - documented_settings()
    assert not unknown, f"not settings of the service (.env.example): {sorted(unknown)}"


def test_onnxruntime_threads_fit_the_cpu_limit():
    """onnxruntime sizes its pool from the node's cores unless told; the pod gets its limit."""
    limit = quantity(container("cpu")["resources"]["limits"]["cpu"])
    threads = int(configmap()["VITSERVE_INTRA_OP_THREADS"])
    assert 1 <= threads <= limit


def test_gpu_deployment_is_the_cpu_one_with_a_gpu():
    cpu, gpu = deployment("cpu"), deployment("gpu")
    assert gpu["metadata"]["name"] == cpu["metadata"]["name"]
    assert container("cpu")["image"] == "vitserve:cpu"
    assert container("gpu")["image"] == "vitserve:gpu"
    providers = {
        variant: next(
            e["value"] for e in container(variant)["env"] if e["name"] == "VITSERVE_PROVIDER"
        )
        for variant in VARIANTS
    }
    assert providers == {"cpu": "cpu", "gpu": "cuda"}
    assert "nvidia.com/gpu" not in container("cpu")["resources"]["limits"]
    assert container("gpu")["resources"]["limits"]["nvidia.com/gpu"] == "1"

    def without_variant_fields(resource: dict) -> dict:
        resource = yaml.safe_load(yaml.safe_dump(resource))
        pod = resource["spec"]["template"]["spec"]
        pod.pop("tolerations", None)
        for volume in pod["volumes"]:
            volume.get("emptyDir", {}).pop("sizeLimit", None)
        for key in ("image", "env", "resources"):
            pod["containers"][0].pop(key)
        return resource

    assert without_variant_fields(cpu) == without_variant_fields(gpu)


# --- Service, HPA, PDB -------------------------------------------------------------------------


def selects_the_pods(selector: dict) -> bool:
    return bool(selector) and all(POD_LABELS.get(k) == v for k, v in selector.items())


def test_the_deployments_pods_carry_the_labels_everything_selects():
    for variant in VARIANTS:
        spec = deployment(variant)["spec"]
        assert spec["template"]["metadata"]["labels"] == POD_LABELS
        assert spec["selector"]["matchLabels"] == POD_LABELS


def test_service_routes_both_ports_to_the_pods():
    service = only(KUBERNETES / "common" / "service.yaml", "Service")
    assert selects_the_pods(service["spec"]["selector"])
    ports = {port["name"]: (port["port"], port["targetPort"]) for port in service["spec"]["ports"]}
    assert ports == {"http": (8000, "http"), "grpc": (8001, "grpc")}


def test_hpa_scales_on_cpu_and_queue_depth():
    hpa = only(KUBERNETES / "common" / "hpa.yaml", "HorizontalPodAutoscaler")
    spec = hpa["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment("cpu")["metadata"]["name"])
    assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
    metrics = {metric["type"]: metric for metric in spec["metrics"]}
    cpu = metrics["Resource"]["resource"]
    assert cpu["name"] == "cpu" and cpu["target"]["type"] == "Utilization"
    assert 0 < cpu["target"]["averageUtilization"] < 100
    pods = metrics["Pods"]["pods"]
    assert pods["metric"]["name"] == "vitserve_queue_depth"
    assert pods["target"]["type"] == "AverageValue"
    # One full batch waiting per pod.
    assert quantity(pods["target"]["averageValue"]) == int(configmap()["VITSERVE_MAX_BATCH_SIZE"])


def test_the_queue_depth_metric_is_one_the_service_exports():
    """Checked against the service's own Prometheus registry, not against a copied name."""
    metrics = pytest.importorskip("service.observability.metrics")
    registry = metrics.Metrics().registry
    names = {family.name for family in registry.collect()}
    assert "vitserve_queue_depth" in names


def adapter_rules() -> list[dict]:
    """The prometheus-adapter rules docs/scaling-out.md gives (its YAML blocks with `rules:`)."""
    text = (ROOT / "docs" / "scaling-out.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    rules = [
        rule
        for block in blocks
        if "seriesQuery" in block
        for rule in yaml.safe_load(block)["rules"]
    ]
    assert rules, "docs/scaling-out.md gives no prometheus-adapter rule"
    return rules


def test_documented_adapter_rule_serves_the_metric_the_hpa_reads():
    hpa = only(KUBERNETES / "common" / "hpa.yaml", "HorizontalPodAutoscaler")
    wanted = next(
        m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"
    )
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == wanted]
    assert rule["seriesQuery"].startswith("vitserve_queue_depth{")
    overrides = rule["resources"]["overrides"]
    assert {value["resource"] for value in overrides.values()} == {"namespace", "pod"}
    # Summed per pod over every model and graph.
    assert re.search(r"sum\(.*\) by \(<<\.GroupBy>>\)", rule["metricsQuery"])


def test_pdb_keeps_a_pod_serving():
    pdb = only(KUBERNETES / "common" / "pdb.yaml", "PodDisruptionBudget")
    assert selects_the_pods(pdb["spec"]["selector"]["matchLabels"])
    hpa = only(KUBERNETES / "common" / "hpa.yaml", "HorizontalPodAutoscaler")
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]


# --- KServe ------------------------------------------------------------------------------------


def test_inference_service_serves_the_same_repository_on_triton():
    """Parsed and asserted field by field: no schema for this custom resource is at hand."""
    (isvc,) = resources(KSERVE)
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["kind"] == "InferenceService"
    name = isvc["metadata"]["name"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "triton"
    assert model["protocolVersion"] == "v2"
    assert model["runtime"] == "kserve-tritonserver"
    pvc = only(KUBERNETES / "common" / "pvc.yaml", "PersistentVolumeClaim")
    assert model["storageUri"] == f"pvc://{pvc['metadata']['name']}"
    # The claim holds models/ (its root is Triton's repository): the name is one of its models.
    config = ROOT / "models" / name / "config.pbtxt"
    assert config.exists(), f"no model {name} in models/"
    assert f'name: "{name}"' in config.read_text()
    for key in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(model["resources"][key])
