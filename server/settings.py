"""Server-side settings (the HTTP edge); engine settings live in `scheduler.config.EngineConfig`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from specserve.kv_cache.compress import registry as kv_compressors
from specserve.scheduler.config import SpeculativeConfig
from specserve.spec_phases.sampling_params import MAX_LOGPROBS

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
    # a template sent in a request is rendered only with this set (vLLM's flag of that name):
    # rendering runs arbitrary Jinja loops on the server
    trust_request_chat_template: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    # a request still running this many seconds after admission fails with 504 and is aborted
    request_timeout_s: float | None = None
    max_choices: int = 256                         # prompts × n per request (vLLM caps prompts too)
    retry_after_s: int = 1
    # `: ping` comments on idle streams; 0 turns them off
    sse_keepalive_s: float = 15.0
    # --enable-log-requests: one log line per request (id, route, body up to max_log_len chars)
    log_requests: bool = False
    max_log_len: int | None = None
    # no engine metrics at /metrics, no periodic stats log
    disable_log_stats: bool = False
    log_stats_interval_s: float = 10.0             # the periodic stats log line (vLLM: 10 s)
    # --generation-config: SamplingParams field -> default for request fields left null
    sampling_defaults: dict = field(default_factory=dict)
    # CORS (vLLM's --allowed-origins/-methods/-headers, --allow-credentials)
    cors_origins: tuple[str, ...] = ("*",)
    cors_methods: tuple[str, ...] = ("*",)
    cors_headers: tuple[str, ...] = ("*",)
    cors_credentials: bool = False
    enable_docs: bool = True                       # /docs, /redoc, /openapi.json
    # --tool-call-parser (server/tool_parsers.py); None: the checkpoint's response_template if
    # its tokenizer has one, else hermes
    tool_call_parser: str | None = None
    # tool_choice "auto" allowed: with --enable-auto-tool-choice, or when neither tool flag is
    # given (specserve's default); --tool-call-parser alone allows only required / named (vLLM)
    auto_tool_choice: bool = True
    reasoning_parser: str | None = None            # --reasoning-parser (server/output_parsing.py)
    # JSON schemas' objects without additionalProperties admit unnamed properties (vLLM's
    # guidance backend); default: none (vLLM's default grammar;
    # scheduler/structured_output.py)
    json_unnamed_properties: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout_s}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.per_request_spec_decode_metrics not in (None, "summary"):
            raise ValueError("per_request_spec_decode_metrics must be 'summary' or unset")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be at least 0, got {self.max_log_len}")
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


def apply_kv_draft_flags(speculative: SpeculativeConfig | None, speculative_json: str | None,
                         compressor: str | None,
                         compressor_config: str | None) -> SpeculativeConfig | None:
    """`--kv-draft-compressor` / `--kv-draft-compressor-config` onto the parsed
    `--speculative-config` (VeriCache's drafting cache). Raises ValueError naming the flag at fault.

    The flags set `kv_compressor` / `kv_compressor_config` (the config object as a whole). A flag
    and the same key inside `--speculative-config` may both be given only with equal values:
    conflicting values are refused, never silently overridden. The resulting compressor name and
    setting keys are checked for every lossy_kv config, flags or not, so a typo fails here and not
    after model load.
    """
    settings = None
    if compressor_config is not None:
        try:
            settings = json.loads(compressor_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-draft-compressor-config is not valid JSON: {exc}") from None
        if not isinstance(settings, dict):
            raise ValueError("--kv-draft-compressor-config must be a JSON object, e.g. "
                             "'{\"sparsity\": 0.7}'")
    flags = [f for f,
             v in (("--kv-draft-compressor", compressor),
                   ("--kv-draft-compressor-config", settings))
             if v is not None]
    if flags and (speculative is None or speculative.method != "lossy_kv"):
        got = "no --speculative-config" if speculative is None else f"method {speculative.method!r}"
        verb = "requires" if len(flags) == 1 else "require"
        raise ValueError(f"{' and '.join(flags)} {verb} --speculative-config with "
                         f"\"method\": \"lossy_kv\" (got {got})")
    if speculative is None or speculative.method != "lossy_kv":
        return speculative
    given = _json_keys(speculative_json)
    defaults = SpeculativeConfig(method="lossy_kv")
    for flag, key, value in (("--kv-draft-compressor", "kv_compressor", compressor),
                             ("--kv-draft-compressor-config", "kv_compressor_config", settings)):
        current = getattr(speculative, key)
        explicit = key in given or current != getattr(defaults, key)
        if value is not None and explicit and current != value:
            raise ValueError(f"{flag} {json.dumps(value)} conflicts with \"{key}\": "
                             f"{json.dumps(current)} in --speculative-config; give one")
    if compressor is not None:
        speculative = replace(speculative, kv_compressor=compressor)
    if settings is not None:
        speculative = replace(speculative, kv_compressor_config=settings)
    name_src = ("--kv-draft-compressor" if compressor is not None
                else "--speculative-config \"kv_compressor\"")
    cfg_src = ("--kv-draft-compressor-config" if settings is not None
               else "--speculative-config \"kv_compressor_config\"")
    if speculative.kv_compressor not in kv_compressors.COMPRESSORS:
        raise ValueError(f"{name_src}: unknown compressor {speculative.kv_compressor!r}; "
                         f"one of {list(kv_compressors.COMPRESSORS)}")
    try:
        kv_compressors.check_settings(speculative.kv_compressor, speculative.kv_compressor_config)
    except ValueError as exc:
        raise ValueError(f"{cfg_src}: {exc}") from None
    return speculative


def _json_keys(text: str | None) -> set[str]:
    """Keys given explicitly in --speculative-config. Text that is not a JSON object yields none;
    then only values that differ from the defaults count as given."""
    try:
        data = json.loads(text) if text else {}
    except (TypeError, json.JSONDecodeError):
        return set()
    return set(data) if isinstance(data, dict) else set()
