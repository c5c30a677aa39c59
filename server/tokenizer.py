"""Tokenizer and chat template, from the GGUF metadata or the HF folder (transformers builds
both). The loader lives beside the model paths (`spec_phases/tokenizer.py`): the worker's grammar
masks need the same tokenizer."""
from __future__ import annotations

from pathlib import Path

from specserve.spec_phases.tokenizer import load_tokenizer


def export_tokenizer(model: str | None, out_dir: str | Path) -> Path:
    """`specserve export-tokenizer DIR`: an HF tokenizer folder for load tools (vllm bench,
    guidellm)."""
    out = Path(out_dir)
    load_tokenizer(model).save_pretrained(str(out))
    return out
