"""Server-side settings (the HTTP edge); engine settings live in `scheduler.config.EngineConfig`."""
from __future__ import annotations

import os
from dataclasses import dataclass

from specserve.scheduler.sampling_params import MAX_LOGPROBS

VERSION = "0.1.0"


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]            # the first is reported; the rest are aliases
    model_path: str = ""                           # `root` in /v1/models
    api_key: str | None = None
    max_logprobs: int = MAX_LOGPROBS
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    per_request_spec_decode_metrics: str | None = None   # None | "summary"
    chat_template: str | None = None               # overrides the tokenizer's template
    max_body_bytes: int = 16 * 1024 * 1024
    max_choices: int = 256                         # prompts × n per request (vLLM caps prompts too)
    retry_after_s: int = 1
    sse_keepalive_s: float = 15.0                  # `: ping` comments on idle streams; 0 turns them off
    disable_log_requests: bool = False
    disable_log_stats: bool = False                # no engine metrics at /metrics, no periodic stats log
    log_stats_interval_s: float = 10.0             # the periodic stats log line (vLLM: 10 s)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.per_request_spec_decode_metrics not in (None, "summary"):
            raise ValueError("per_request_spec_decode_metrics must be 'summary' or unset")
        if self.max_body_bytes < 1 or self.max_choices < 1:
            raise ValueError("max_body_bytes and max_choices must be positive")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def system_fingerprint(self) -> str:
        return f"specserve-{VERSION}"


def api_key_from_env() -> str | None:
    """`SPECSERVE_API_KEY`, or vLLM's `VLLM_API_KEY` for drop-in use (openai-api.md §9)."""
    return os.environ.get("SPECSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None
