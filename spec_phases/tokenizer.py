"""The model's tokenizer, from the GGUF metadata or the HF folder (transformers builds it). The
server encodes and renders chat with it; the worker builds its grammar masks from the same one
(`spec_phases/grammar.py`), so both sides agree on every token's text."""
from __future__ import annotations

import os
import shutil

from specserve.spec_phases.paths import drop_superseded, model_cache_entry, resolve_model_path


def load_tokenizer(model: str | os.PathLike | None = None):
    """A transformers fast tokenizer for `model` (None: the embedded SmolLM2).

    Building one from GGUF metadata takes ~13 s, so the result is saved once under the specserve
    cache (keyed by the file's path, size and mtime; one folder per file name) and later loads
    read that folder.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = resolve_model_path(None if model is None else str(model))
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    saved = model_cache_entry("tokenizers", path)
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(str(tmp))
    try:
        os.replace(tmp, saved)
    except OSError:                       # another process won the race; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    drop_superseded(saved, path)
    return tokenizer

