"""`specserve serve [MODEL] [flags]` (mirrors `vllm serve`) and `specserve export-tokenizer DIR`.

Engine flags are generated from `EngineConfig`'s fields (one source: `--max-num-seqs` ↔
`max_num_seqs`); server flags map onto `ServerSettings`.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from specserve.kv_cache.compress.registry import COMPRESSORS as KV_COMPRESSORS
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.spec_phases.sampling_params import MAX_LOGPROBS
from specserve.server.settings import (VERSION, ServerSettings, api_key_from_env,
                                       apply_kv_draft_flags)

logger = logging.getLogger("specserve.server")
ENGINE_FLAG_SKIP = {"model", "speculative"}
TYPES = {"int": int, "float": float, "str": str}


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible LLM server.")
    parser.add_argument("--version", action="version", version=f"specserve {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model", nargs="?", default=None,
                       help="a .gguf file, an HF folder, or tiny-random (default: the embedded "
                            "SmolLM2)")
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
    serve.add_argument("--disable-log-requests", action="store_true")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no engine metrics at /metrics and no periodic stats log line")
    serve.add_argument("--uvicorn-log-level", default="info")
    serve.add_argument("--engine-in-thread", action="store_true",
                       help="run the engine core on a thread of the server process (default: in "
                            "its own process, as vLLM v1 does, so HTTP work never shares its GIL)")
    add_engine_flags(serve)
    export = commands.add_parser("export-tokenizer",
                                 help="write an HF tokenizer folder for load tools")
    export.add_argument("out_dir")
    export.add_argument("--model", default=None)
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name not in ENGINE_FLAG_SKIP and getattr(args, f.name, None) is not None}
    try:
        speculative = SpeculativeConfig.from_json(args.speculative_config)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"specserve: bad --speculative-config: {exc}") from None
    try:
        speculative = apply_kv_draft_flags(speculative, args.speculative_config,
                                           getattr(args, "kv_draft_compressor", None),
                                           getattr(args, "kv_draft_compressor_config", None))
    except ValueError as exc:
        raise SystemExit(f"specserve: {exc}") from None
    try:
        return EngineConfig(model=args.model, speculative=speculative, **values)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"specserve: {exc}") from None


def read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    return value


def server_settings(args: argparse.Namespace, model_info) -> ServerSettings:
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
            disable_log_requests=args.disable_log_requests,
            disable_log_stats=getattr(args, "disable_log_stats", False))
    except ValueError as exc:
        raise SystemExit(f"specserve: {exc}") from None


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from specserve.server.app import build_app
    from specserve.server.tokenizer import load_tokenizer

    config = engine_config(args)
    try:
        from specserve.scheduler.async_engine import AsyncEngine
    except ImportError as exc:
        raise SystemExit(f"specserve: the engine is not available in this build ({exc})") from None
    logger.info("loading %s", args.model or "the embedded SmolLM2 model")
    tokenizer = load_tokenizer(args.model)
    try:
        engine = AsyncEngine(config, process=not args.engine_in_thread, warm_up=True)
    except ValueError as exc:
        raise SystemExit(f"specserve: {exc}") from None
    try:
        settings = server_settings(args, engine.model_info)
        app = build_app(engine, tokenizer, settings, routers=extra_routers(engine, settings))
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.uvicorn_log_level,
                                               timeout_keep_alive=5))

        def stop(exc: BaseException) -> None:       # the engine died: stop serving, then exit 1
            server.should_exit = True
        engine.on_death = stop
        server.run()
    finally:
        engine.shutdown()
    if engine.is_dead:                             # a supervisor (compose, k8s) restarts us
        raise SystemExit("specserve: the engine loop died; exiting so that a supervisor restarts "
                         "the server")


def extra_routers(engine, settings) -> list:
    """Routers mounted beside the OpenAI ones: `/metrics` (`server/metrics.py`)."""
    from specserve.server import metrics
    return [metrics.make_router(engine, settings)]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "export-tokenizer":
        from specserve.server.tokenizer import export_tokenizer
        out = export_tokenizer(args.model, args.out_dir)
        print(out)
    else:                                   # argparse already refuses unknown commands
        sys.exit(2)
