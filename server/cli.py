"""`specserve serve [MODEL] [flags]` (mirrors `vllm serve`) and `specserve export-tokenizer DIR`.

Engine flags are generated from `EngineConfig`'s fields (one source: `--max-num-seqs` ↔
`max_num_seqs`); server flags map onto `ServerSettings`. vLLM's launch flags that have no
specserve field are declared in `add_vllm_flags` and each is either honoured or refused with a
one-line reason by `check_vllm_flags` (docs/vllm-flags.md is the table; a test parses it).

Refusals — a bad flag value, a model path that names nothing, a Hub id not in the local cache, an
unsupported architecture — print one line `specserve: error: ...` and exit with status 2.
"""
from __future__ import annotations

import argparse
import codecs
import copy
import dataclasses
import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import NoReturn

from specserve.kv_cache.compress.registry import COMPRESSORS as KV_COMPRESSORS
from specserve.scheduler.config import KV_CACHE_DTYPES, EngineConfig, SpeculativeConfig
from specserve.spec_phases.paths import (TINY_RANDOM, ModelPathError, describe_model,
                                         looks_like_repo_id, resolve_model_path,
                                         resolve_tokenizer_path)
from specserve.spec_phases.sampling_params import MAX_LOGPROBS
from specserve.server.generation_config import GenerationConfigError, default_sampling
from specserve.server.output_parsing import REASONING_PARSERS
from specserve.server.tool_parsers import tool_parser_names
from specserve.server.settings import (VERSION, ServerSettings, api_key_from_env,
                                       apply_kv_draft_flags)

logger = logging.getLogger("specserve.server")
ENGINE_FLAG_SKIP = {"model", "speculative", "kv_cache_dtype"}   # kv_cache_dtype: a vLLM flag
TYPES = {"int": int, "float": float, "str": str}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
DTYPE_ALIASES = {"float": "float32", "half": "float16"}          # vLLM's --dtype spellings
LOAD_FORMATS = ("auto", "safetensors", "gguf")
FLAG_DOC = "docs/vllm-flags.md"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (vLLM flags: {FLAG_DOC})\n")


def refuse(message: str) -> NoReturn:
    """A launch refused: one line on stderr, exit status 2 (argparse's status for bad usage)."""
    line = " ".join(str(message).split())
    print(f"specserve: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field: `--field-name`, typed from the annotation."""
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_FLAG_SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        annotation = str(f.type).replace(" ", "")
        if annotation == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None)
            continue
        base = annotation.split("|")[0]
        group.add_argument(flag, dest=f.name, type=TYPES.get(base, str), default=None,
                           help=f"default: {f.default!r}")


def json_value(text: str):
    return json.loads(text)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM launch flags without an EngineConfig/ServerSettings field of their own
    (docs/vllm-flags.md: what each does here)."""
    g = parser.add_argument_group(f"vLLM launch flags ({FLAG_DOC})")
    g.add_argument("--config", default=None,
                   help="a YAML file of flags (keys as flag names); command-line flags win")
    g.add_argument("--revision", default=None, help="Hub id: the cached branch, tag or commit")
    g.add_argument("--download-dir", default=None,
                   help="Hub id: the Hugging Face cache folder to read (default: HF_HUB_CACHE / "
                        "HF_HOME); nothing is ever downloaded")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder or cached Hub id (default: the model's)")
    g.add_argument("--tokenizer-revision", default=None)
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; specserve never runs code from a model folder")
    g.add_argument("--generation-config", default="auto",
                   help="auto: the model's generation_config.json gives default sampling "
                        "parameters; vllm: none; or a folder holding generation_config.json")
    g.add_argument("--override-generation-config", type=json_value, default=None,
                   help="JSON merged over the generation config, e.g. '{\"temperature\": 0.5}'")
    g.add_argument("--load-format", default="auto", help=f"one of {list(LOAD_FORMATS)}")
    g.add_argument("--quantization", "-q", default=None,
                   help="none, or gguf for a .gguf model (Q4_1/Q8_0 kept quantized for the C "
                        "kernel on CPU, other types dequantized to --dtype at load)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="the full KV cache's elements: auto (the model's dtype; on CPU "
                        "bfloat16 under --dtype auto, float32 under --dtype float32), bfloat16, "
                        "fp8 / fp8_e4m3 (e4m3, scale 1) or float32")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="always on: prefills are chunked by "
                                      "--max-num-batched-tokens")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0)
    g.add_argument("--swap-space", type=float, default=None)
    g.add_argument("--enable-lora", action="store_true")
    g.add_argument("--lora-modules", nargs="+", default=None)
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice auto with --tool-call-parser's format (without either "
                        "flag: auto with the checkpoint's response_template, else hermes)")
    g.add_argument("--tool-call-parser", default=None,
                   help=f"the model's tool-call format: {', '.join(tool_parser_names())}")
    g.add_argument("--reasoning-parser", default=None,
                   help=f"<think> blocks into reasoning_content: "
                        f"{', '.join(sorted(REASONING_PARSERS))}")
    g.add_argument("--structured-outputs-config", type=json_value, default=None,
                   help='JSON: {"backend": "auto" | "xgrammar" | "guidance", '
                        '"disable_additional_properties": bool}; guidance reads JSON schemas '
                        "as vLLM's guidance backend does (unnamed properties allowed)")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="run the engine on a thread of the server process (--engine-in-thread)")
    # HTTP
    g.add_argument("--root-path", default=None, help="the path prefix behind a proxy")
    g.add_argument("--allowed-origins", type=json_value, default=["*"])
    g.add_argument("--allowed-methods", type=json_value, default=["*"])
    g.add_argument("--allowed-headers", type=json_value, default=["*"])
    g.add_argument("--allow-credentials", action="store_true")
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-ca-certs", default=None)
    g.add_argument("--ssl-cert-reqs", type=int, default=0)
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's id, route and body")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of a request body kept in its log line")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specserve", description="OpenAI-compatible LLM server.")
    parser.add_argument("--version", action="version", version=f"specserve {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model", nargs="?", default=None,
                       help="a .gguf file, an HF folder, a Hub id in the local Hugging Face "
                            "cache, or tiny-random (default: the embedded SmolLM2)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="names clients use; the first is reported, the rest are aliases")
    serve.add_argument("--api-key", default=None, help="or SPECSERVE_API_KEY / VLLM_API_KEY")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja template, inline or a file path")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a chat_template sent in a request (off: such requests get a "
                            "400; rendering runs the template's loops on the server)")
    serve.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS)
    serve.add_argument("--speculative-config", default=None,
                       help="JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                            "\"adaptive\": true, \"frontier_size\": 2}' (scheduler/config.py: "
                            "SpeculativeConfig)")
    serve.add_argument("--kv-draft-compressor", choices=KV_COMPRESSORS, default=None,
                       help="lossy_kv (VeriCache): the drafting cache's compressor (default: "
                            "mustafar)")
    serve.add_argument("--kv-draft-compressor-config", default=None,
                       help="lossy_kv: compressor settings as JSON, e.g. '{\"sparsity\": 0.7}' "
                            "(docs/vericache.md)")
    serve.add_argument("--enable-force-include-usage", action="store_true")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true")
    serve.add_argument("--per-request-spec-decode-metrics", choices=["summary"], default=None)
    serve.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024)
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may run (queue included) before it fails with "
                            "504 and is aborted (default: no deadline)")
    serve.add_argument("--max-choices", type=int, default=256, help="prompts × n per request")
    serve.add_argument("--sse-keep-alive-interval", type=float, default=15.0)
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="vLLM's older spelling; requests are not logged unless "
                            "--enable-log-requests")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no engine metrics at /metrics and no periodic stats log line")
    serve.add_argument("--uvicorn-log-level", default="info")
    serve.add_argument("--engine-in-thread", action="store_true",
                       help="run the engine core on a thread of the server process (default: in "
                            "its own process, as vLLM v1 does, so HTTP work never shares its GIL)")
    add_engine_flags(serve)
    add_vllm_flags(serve)
    export = commands.add_parser("export-tokenizer",
                                 help="write an HF tokenizer folder for load tools")
    export.add_argument("out_dir")
    export.add_argument("--model", default=None)
    return parser


# -- --config YAML --------------------------------------------------------------------------------
def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`serve ... --config FILE`: the YAML's keys become flags placed before the command line's,
    so flags given on the command line win (vLLM's rule). `model:` fills the positional MODEL
    when the command line gives none."""
    if len(argv) < 1 or argv[0] != "serve":
        return argv
    path, rest = None, [argv[0]]
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if path is None:
        return argv
    try:
        import yaml
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        refuse(f"--config {path}: cannot read it ({exc.strerror or exc})")
    except yaml.YAMLError as exc:
        refuse(f"--config {path}: not valid YAML ({exc})")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        refuse(f"--config {path}: the YAML must be a mapping of flag names to values")
    serve = _subparser(parser, "serve")
    actions = {opt: a for a in serve._actions for opt in a.option_strings}
    flags: list[str] = []
    model = data.pop("model", None)
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None:
            refuse(f"--config {path}: unknown key {key!r} (no flag {flag})")
        flags += _config_flag(flag, action, value)
    with_model = rest[:1] + flags + rest[1:]
    if model is not None and not _has_positional(rest[1:], actions):
        with_model = rest[:1] + [str(model)] + flags + rest[1:]
    return with_model


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def _config_flag(flag: str, action: argparse.Action, value) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag] if value else ["--no-" + flag[2:]]
    if action.nargs == 0:                         # store_true
        return [flag] if value else []
    if action.nargs in ("+", "*") and isinstance(value, list):
        return [flag, *map(str, value)]
    if isinstance(value, (list, dict)):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def _has_positional(args: list[str], actions: dict[str, argparse.Action]) -> bool:
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            return True
        action = actions.get(arg.split("=", 1)[0])
        if "=" in arg or action is None or action.nargs == 0:
            i += 1
        elif action.nargs in ("+", "*"):
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                i += 1
        else:
            i += 2
    return False


# -- vLLM flags: honoured or refused --------------------------------------------------------------
def check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, every vLLM flag value specserve cannot honour (docs/vllm-flags.md)."""
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--pipeline-parallel-size", args.pipeline_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value != 1:
            refuse(f"{flag} {value}: specserve runs one engine on one device; only 1 is "
                   "supported (start one server per device behind a load balancer)")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        refuse(f"--kv-cache-dtype {args.kv_cache_dtype}: one of {list(KV_CACHE_DTYPES)} (auto: "
               "the model's dtype; on CPU bfloat16 under --dtype auto)")
    if args.load_format not in LOAD_FORMATS:
        refuse(f"--load-format {args.load_format}: one of {list(LOAD_FORMATS)} (safetensors "
               "folders and GGUF files are what the loader reads)")
    if args.quantization not in (None, "none", "None", "gguf"):
        refuse(f"--quantization {args.quantization}: quantized kernels are not implemented; "
               "serve an unquantized safetensors folder or a .gguf file (--quantization gguf)")
    if args.enable_chunked_prefill is False:
        refuse("--no-enable-chunked-prefill: prefills are always chunked by "
               "--max-num-batched-tokens (the scheduler has no unchunked mode)")
    if args.cpu_offload_gb:
        refuse(f"--cpu-offload-gb {args.cpu_offload_gb:g}: weights stay on the device; "
               "offloading them to host memory is not implemented")
    if args.swap_space is not None:
        refuse(f"--swap-space {args.swap_space:g}: preempted requests are recomputed, never "
               "swapped to host memory (vLLM v1 does the same); drop the flag")
    if args.enable_lora or args.lora_modules:
        refuse("--enable-lora / --lora-modules: LoRA adapters are not supported")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        refuse("--enable-auto-tool-choice requires --tool-call-parser (one of "
               f"{', '.join(tool_parser_names())})")
    if args.tool_call_parser is not None and args.tool_call_parser not in tool_parser_names():
        refuse(f"--tool-call-parser {args.tool_call_parser}: not a known parser; one of "
               f"{', '.join(tool_parser_names())}")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        refuse(f"--reasoning-parser {args.reasoning_parser}: not a known parser; one of "
               f"{', '.join(sorted(REASONING_PARSERS))}")
    structured = args.structured_outputs_config
    if structured is not None:
        if not isinstance(structured, dict) or set(structured) - STRUCTURED_OUTPUTS_KEYS:
            refuse("--structured-outputs-config: a JSON object with the keys "
                   f"{sorted(STRUCTURED_OUTPUTS_KEYS)} (the grammar library is llguidance)")
        if structured.get("backend", "auto") not in ("auto", "xgrammar", "guidance"):
            refuse(f"--structured-outputs-config: backend {structured['backend']!r}: one of "
                   "auto, xgrammar, guidance (llguidance reading schemas as that backend does)")
    if args.enable_log_requests and args.disable_log_requests:
        refuse("--enable-log-requests and --disable-log-requests contradict each other; give one")
    if args.max_log_len is not None and args.max_log_len < 0:
        refuse(f"--max-log-len must be at least 0, got {args.max_log_len}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        refuse("--ssl-keyfile and --ssl-certfile go together (TLS needs both)")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not Path(path).is_file():
            refuse(f"{flag} {path}: no such file")
    for flag, value in (("--allowed-origins", args.allowed_origins),
                        ("--allowed-methods", args.allowed_methods),
                        ("--allowed-headers", args.allowed_headers)):
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            refuse(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]', got {value!r}")
    utilization = args.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        refuse(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    try:
        read_chat_template(args.chat_template)
    except ChatTemplateError as exc:
        refuse(str(exc))
    if args.generation_config not in ("auto", "vllm") and \
            not Path(args.generation_config).is_dir():
        refuse(f"--generation-config {args.generation_config}: auto, vllm, or a folder holding "
               "generation_config.json")


def check_load_format(args: argparse.Namespace, path: Path) -> None:
    """--load-format / --quantization gguf against what MODEL resolved to."""
    gguf = path.suffix == ".gguf"
    if args.load_format == "gguf" and not gguf:
        refuse(f"--load-format gguf: {args.model!r} is not a .gguf file")
    if args.load_format == "safetensors" and gguf:
        refuse(f"--load-format safetensors: {args.model!r} is a GGUF file")
    if args.quantization == "gguf" and not gguf:
        refuse(f"--quantization gguf: {args.model!r} is not a .gguf file")


def engine_config(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """EngineConfig from the flags; `model` (the resolved local path) replaces MODEL when given."""
    flags = vars(args)                   # add_engine_flags made a flag of every other field
    values = {f.name: flags[f.name] for f in dataclasses.fields(EngineConfig)
              if f.name not in ENGINE_FLAG_SKIP and flags[f.name] is not None}
    if "dtype" in values:
        values["dtype"] = DTYPE_ALIASES.get(values["dtype"], values["dtype"])
    values["kv_cache_dtype"] = args.kv_cache_dtype
    kvcache_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if kvcache_space and "kv_cache_memory_gb" not in values:
        try:
            values["kv_cache_memory_gb"] = float(kvcache_space)
        except ValueError:
            raise SystemExit(f"specserve: VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got "
                             f"{kvcache_space!r}") from None
    try:
        speculative = SpeculativeConfig.from_json(args.speculative_config)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"specserve: bad --speculative-config: {exc}") from None
    try:
        speculative = apply_kv_draft_flags(speculative, args.speculative_config,
                                           args.kv_draft_compressor,
                                           args.kv_draft_compressor_config)
    except ValueError as exc:
        raise SystemExit(f"specserve: {exc}") from None
    try:
        return EngineConfig(model=model or args.model, speculative=speculative, **values)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"specserve: {exc}") from None


class ChatTemplateError(ValueError):
    pass


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's text; else, when the value has a Jinja
    character (`{`, `}` or a newline), the template itself with its backslash escapes decoded;
    else a path that failed to open (ChatTemplateError)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        return path.read_text()
    except (OSError, ValueError) as exc:
        if not any(c in value for c in "{}\n"):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ChatTemplateError(
                f"--chat-template {value}: looks like a file path, but it failed to be opened "
                f"({reason})") from None
    return codecs.decode(value, "unicode_escape")


STRUCTURED_OUTPUTS_KEYS = {"backend", "disable_additional_properties"}


def json_unnamed_properties(config: dict | None) -> bool:
    """vLLM's guidance backend admits properties a schema does not name unless
    disable_additional_properties; its default (xgrammar) does not."""
    config = config or {}
    return config.get("backend") == "guidance" and not config.get("disable_additional_properties")


def server_settings(args: argparse.Namespace, model_info, sampling_defaults=None
                    ) -> ServerSettings:
    names = tuple(args.served_model_name or (args.model or model_info.name,))
    try:
        return ServerSettings(
            served_model_names=names, model_path=model_info.path,
            api_key=args.api_key or api_key_from_env(), max_logprobs=args.max_logprobs,
            enable_force_include_usage=args.enable_force_include_usage,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
            chat_template=read_chat_template(args.chat_template),
            trust_request_chat_template=args.trust_request_chat_template,
            max_body_bytes=args.max_request_body_bytes, max_choices=args.max_choices,
            request_timeout_s=args.request_timeout,
            sse_keepalive_s=args.sse_keep_alive_interval,
            log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
            disable_log_stats=args.disable_log_stats,
            sampling_defaults=dict(sampling_defaults or {}),
            cors_origins=tuple(args.allowed_origins), cors_methods=tuple(args.allowed_methods),
            cors_headers=tuple(args.allowed_headers), cors_credentials=args.allow_credentials,
            enable_docs=not args.disable_fastapi_docs,
            tool_call_parser=args.tool_call_parser,
            auto_tool_choice=args.enable_auto_tool_choice or args.tool_call_parser is None,
            reasoning_parser=args.reasoning_parser,
            json_unnamed_properties=json_unnamed_properties(args.structured_outputs_config))
    except ValueError as exc:
        raise SystemExit(f"specserve: {exc}") from None


def uvicorn_log_config() -> dict:
    """uvicorn's own logging config with timestamps in front of every line."""
    from uvicorn.config import LOGGING_CONFIG
    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
        formatter["datefmt"] = LOG_DATEFMT
    return config


def uvicorn_config(args: argparse.Namespace, app):
    import uvicorn
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          timeout_keep_alive=5, access_log=not args.disable_uvicorn_access_log,
                          root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs, log_config=uvicorn_log_config())


def resolve_model(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """MODEL and --tokenizer as local paths (Hub ids from the local cache); refusals exit 2."""
    try:
        path = resolve_model_path(args.model, args.revision, args.download_dir)
        tokenizer = None
        if args.tokenizer is not None:
            tokenizer = resolve_tokenizer_path(args.tokenizer, args.tokenizer_revision,
                                               args.download_dir)
        elif args.tokenizer_revision is not None:        # the model's own tokenizer, at that
            if args.model is None or not looks_like_repo_id(args.model) or \
                    Path(args.model).expanduser().exists():              # revision (vLLM)
                refuse(f"--tokenizer-revision {args.tokenizer_revision}: a revision names a "
                       "commit, branch or tag of a Hub id; MODEL is a local path (give "
                       "--tokenizer a Hub id, or drop the flag)")
            tokenizer = resolve_tokenizer_path(args.model, args.tokenizer_revision,
                                               args.download_dir)
    except ModelPathError as exc:
        refuse(str(exc))
    return path, tokenizer


def serve_launch(args: argparse.Namespace):
    """Everything before the engine starts: flag checks, the model's path, the sampling defaults
    and the engine config. Returns (config, model_path, tokenizer_path, sampling_defaults)."""
    check_vllm_flags(args)
    path, tokenizer_path = resolve_model(args)
    check_load_format(args, path)
    try:
        defaults = default_sampling(args.generation_config, path,
                                    args.override_generation_config)
    except GenerationConfigError as exc:
        refuse(str(exc))
    if args.trust_remote_code:
        logger.info("--trust-remote-code: accepted; specserve never runs code from a model "
                    "folder (its architectures are built in)")
    if args.max_log_len is not None and not args.enable_log_requests:
        logger.info("--max-log-len %d: requests are logged only with --enable-log-requests (off "
                    "by default, as in current vLLM)", args.max_log_len)
    if args.disable_frontend_multiprocessing:
        args.engine_in_thread = True
    local = None if args.model in (None, TINY_RANDOM) else str(path)
    return engine_config(args, model=local), path, tokenizer_path, defaults


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from specserve.server.app import build_app
    from specserve.server.tokenizer import load_tokenizer

    config, path, tokenizer_path, defaults = serve_launch(args)
    try:
        from specserve.scheduler.async_engine import AsyncEngine
    except ImportError as exc:
        raise SystemExit(f"specserve: the engine is not available in this build ({exc})") from None
    logger.info("loading %s", args.model or "the embedded SmolLM2 model")
    # the tokenizer loads on a thread while the engine process starts (the two overlap on a
    # second core: a few seconds of start-up). An engine on a thread of this process starts after
    # it: transformers' lazy names are not thread-safe, and the engine's warm-up resolves them too
    # (its grammar tokenizer), so the two at once could fail with an AttributeError.
    with ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenizer") as pool:
        tokenizer_job = pool.submit(load_tokenizer, tokenizer_path or config.model)
        if args.engine_in_thread:
            futures_wait([tokenizer_job])
        try:
            engine = AsyncEngine(config, process=not args.engine_in_thread, warm_up=True)
        except (ValueError, FileNotFoundError) as exc:       # unsupported model, missing weights
            refuse(str(exc))
        try:
            tokenizer = tokenizer_job.result()
        except (ValueError, OSError) as exc:
            engine.shutdown()
            refuse(f"cannot load the tokenizer of {str(tokenizer_path or path)!r}: {exc}")
        if args.tool_call_parser == "transformers" and \
                tokenizer.response_template is None:
            engine.shutdown()
            refuse("--tool-call-parser transformers: this checkpoint's tokenizer has no "
                   "response_template; name the model's call format instead")
    try:
        settings = server_settings(args, engine.model_info, defaults)
        log_banner(args, config, path, engine, defaults)
        app = build_app(engine, tokenizer, settings, routers=extra_routers(engine, settings))
        server = uvicorn.Server(uvicorn_config(args, app))

        def stop(exc: BaseException) -> None:       # the engine died: stop serving, then exit 1
            server.should_exit = True
        engine.on_death = stop
        server.run()
    finally:
        engine.shutdown()
    if engine.is_dead:                             # a supervisor (compose, k8s) restarts us
        raise SystemExit("specserve: the engine loop died; exiting so that a supervisor restarts "
                         "the server")


def log_banner(args, config: EngineConfig, path: Path, engine, defaults: dict) -> None:
    """One start-up line an operator can read: what is served, where, and how."""
    info, engine_info = engine.model_info, engine.engine_info
    spec = config.speculative
    speculative = "off" if spec is None else json.dumps(
        {k: v for k, v in dataclasses.asdict(spec).items() if v not in (None, {}, False)},
        separators=(",", ":"))
    tokens = engine_info.num_blocks * engine_info.block_size
    architecture = ("llama (tiny, random weights)" if args.model == TINY_RANDOM
                    else describe_model(path))
    device = engine_info.device
    if config.device == "auto" and device == "cpu":   # e.g. the CUDA image on a host with no GPU
        device = f"cpu (--device auto: {no_cuda_reason()})"
    logger.info("specserve %s: model %s (%s), architecture %s, dtype %s, device %s, max_model_len "
                "%d, KV cache %d tokens (%d blocks of %d, %s), speculative %s, sampling defaults "
                "%s",
                VERSION, args.model or info.name, path, architecture, engine_info.dtype,
                device, info.max_model_len, tokens, engine_info.num_blocks,
                engine_info.block_size, engine_info.kv_cache_dtype or engine_info.dtype,
                speculative, defaults or "none")


def no_cuda_reason() -> str:
    """Why `--device auto` chose the CPU, for the start banner."""
    import torch
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no CUDA "
            "device: no GPU given to the container (docker run --gpus all) or no NVIDIA driver")


def extra_routers(engine, settings) -> list:
    """Routers mounted beside the OpenAI ones: `/metrics` (`server/metrics.py`)."""
    from specserve.server import metrics
    return [metrics.make_router(engine, settings)]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    parser = build_parser()
    argv = expand_config_file(list(sys.argv[1:] if argv is None else argv), parser)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "export-tokenizer":
        from specserve.server.tokenizer import export_tokenizer
        out = export_tokenizer(args.model, args.out_dir)
        print(out)
    else:                                   # argparse already refuses unknown commands
        sys.exit(2)
