"""`--generation-config auto|vllm|FOLDER`: default sampling parameters from a model's
`generation_config.json`, read as vLLM reads it.

vLLM takes the file's non-default values (transformers' `GenerationConfig.to_diff_dict()`), merges
`--override-generation-config` over them, and keeps `repetition_penalty`, `temperature`, `top_k`,
`top_p`, `min_p` and `max_new_tokens` (as `max_tokens`). A request field that is given (not null)
wins over the default; `max_tokens` left out of a chat request becomes min(room left in the
context, the default) — docs/vllm-flags.md.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from specserve.spec_phases.sampling_params import ParamError, SamplingParams

logger = logging.getLogger("specserve.server")
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
FILE = "generation_config.json"


class GenerationConfigError(ValueError):
    """A generation config that cannot be used; one line naming the file and why."""


def read_generation_config(folder: Path) -> dict:
    """The non-default values of `folder/generation_config.json` ({} when there is none)."""
    if not (folder / FILE).is_file():
        return {}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GenerationConfig
    try:
        config = GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{folder / FILE}: cannot be read ({exc})") from None
    return config.to_diff_dict()


def default_sampling(choice: str, model_path: Path, override: dict | None = None) -> dict:
    """Default sampling parameters (SamplingParams field names) for `--generation-config
    choice`: `auto` reads the model folder's file, `vllm` none, anything else names a folder."""
    if choice == "vllm":
        config: dict = {}
    elif choice == "auto":
        config = read_generation_config(model_path) if model_path.is_dir() else {}
    else:
        folder = Path(choice)
        if not (folder / FILE).is_file():
            raise GenerationConfigError(f"--generation-config {choice}: no {FILE} in that folder")
        config = read_generation_config(folder)
    if override is not None and not isinstance(override, dict):
        raise GenerationConfigError("--override-generation-config must be a JSON object")
    config = {**config, **(override or {})}
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (ParamError, TypeError) as exc:
        raise GenerationConfigError(f"generation config of {model_path}: {exc}") from None
    if defaults:
        logger.info("default sampling parameters from the generation config: %s (request fields "
                    "override them; --generation-config vllm turns them off)", defaults)
    return defaults
