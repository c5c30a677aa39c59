"""The FastAPI app: routes, guards and error handlers around one engine client.

`build_app(engine, tokenizer, settings)` takes any object with the engine methods (the real
`AsyncEngine` or a test fake). Extra routers (`AppRouter`s, e.g. `/metrics`) are passed in by
whoever builds the app; they can read `app.state.serving` (the `ServingContext`) for the engine
and settings.
"""
from __future__ import annotations

import asyncio

import time
import uuid
from collections.abc import Sequence
from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from specserve.server.engine_client import EngineClient
from specserve.server.errors import bad_request, engine_dead, install_error_handlers
from specserve.server.middleware import (APIKeyMiddleware, BodyGuardMiddleware,
                                         RequestIdMiddleware, RequestLogMiddleware)
from specserve.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionRequest,
                                       CompletionResponse, DetokenizeRequest, ErrorResponse,
                                       TokenizeRequest)
from specserve.scheduler.validation import check_prompt_ids
from specserve.server.serving_base import ServingContext, encode_text, served_model
from specserve.server.serving_chat import create_chat_completion, render_chat
from specserve.server.serving_completions import create_completion
from specserve.server.settings import VERSION, ServerSettings

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}
STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
DOCS_ASSETS = "/docs-assets"          # Swagger UI and ReDoc, served from the fastapi-offline wheel
# request fields that --generation-config may default (max_tokens: serving_chat/completions)
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class AppRouter(APIRouter):
    """A router mounted beside the OpenAI ones. `attach` is called once the app is built, after
    the app's own middleware (e.g. to add an outermost HTTP middleware)."""

    def attach(self, app: FastAPI) -> None:
        pass


def build_app(engine, tokenizer, settings: ServerSettings,
              routers: Sequence[AppRouter] = ()) -> FastAPI:
    app = FastAPI(title="specserve", version=VERSION,
                  description="OpenAI-compatible server (vLLM semantics) with speculative "
                              "decoding.", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if settings.enable_docs else None)
    if settings.enable_docs:
        install_docs(app)
    ctx = ServingContext(EngineClient(engine, settings.request_timeout_s), tokenizer, settings)
    app.state.serving = ctx
    install_error_handlers(app)
    app.include_router(openai_router(ctx))
    app.include_router(ops_router(ctx))
    for router in routers:
        app.include_router(router)
    # Starlette runs the last added middleware first: CORS → request id → request log → API key
    # → body guard → routes.
    app.add_middleware(BodyGuardMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.log_requests:
        app.add_middleware(RequestLogMiddleware, max_log_len=settings.max_log_len)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                       allow_methods=list(settings.cors_methods),
                       allow_headers=list(settings.cors_headers),
                       allow_credentials=settings.cors_credentials)
    # e.g. /metrics: HTTP middleware (outermost), request trackers
    for router in routers:
        router.attach(app)
    return app


def install_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc (ReDoc) with their scripts and styles served from this
    server, not a CDN: they render on a node without internet access."""
    static = files("fastapi_offline") / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(static)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(openapi_url=root + app.openapi_url,
                                   title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_redoc_html(openapi_url=root + app.openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
                              with_google_fonts=False)


def with_sampling_defaults(body, defaults: dict):
    """Request fields left null take the generation config's defaults (vLLM's rule)."""
    update = {name: defaults[name] for name in DEFAULTED_FIELDS
              if name in defaults and getattr(body, name) is None}
    return body.model_copy(update=update) if update else body


def _live(ctx: ServingContext) -> None:
    if ctx.client.is_dead:
        raise engine_dead()


def openai_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=CompletionResponse,
                 responses={**ERRORS, 200: {"content": STREAM}})
    async def completions(raw: Request, body: CompletionRequest):
        _live(ctx)
        body = with_sampling_defaults(body, ctx.settings.sampling_defaults)
        return await create_completion(raw, body, ctx)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 responses={**ERRORS, 200: {"content": STREAM}})
    async def chat_completions(raw: Request, body: ChatCompletionRequest):
        _live(ctx)
        body = with_sampling_defaults(body, ctx.settings.sampling_defaults)
        return await create_chat_completion(raw, body, ctx)

    @router.get("/v1/models", responses=ERRORS)
    async def models():
        created = int(time.time())
        card = {"id": ctx.settings.model_name, "object": "model", "created": created,
                "owned_by": "specserve", "root": ctx.settings.model_path or ctx.model_info.path,
                "parent": None, "max_model_len": ctx.model_info.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": created, "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return {"object": "list", "data": [card]}

    @router.post("/tokenize", responses=ERRORS)
    async def tokenize(body: TokenizeRequest):
        served_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages.", "prompt")
        if body.messages is not None:
            text = await asyncio.to_thread(
                render_chat, ctx, body.messages, chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await asyncio.to_thread(
            encode_text, ctx, text, "messages" if body.messages is not None else "prompt",
            add_special)
        strs = ctx.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": ctx.model_info.max_model_len,
                "tokens": tokens,
                "token_strs": strs}

    @router.post("/detokenize", responses=ERRORS)
    async def detokenize(body: DetokenizeRequest):
        served_model(ctx, body.model)
        check_prompt_ids(body.tokens, ctx.model_info.vocab_size)
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return router


def ops_router(ctx: ServingContext) -> APIRouter:
    """Open routes for probes and tools (no API key)."""
    router = APIRouter()

    @router.get("/health", response_class=Response,
                responses={200: {"description": "Healthy (empty body)."},
                           503: {"model": ErrorResponse}})
    async def health():
        if ctx.client.is_dead:
            err = engine_dead()
            return JSONResponse(err.envelope(), status_code=503, headers=err.headers)
        return Response(status_code=200)

    @router.get("/ping", response_class=Response,
                responses={200: {"description": "Healthy (empty body)."},
                           503: {"model": ErrorResponse}})
    async def ping():
        return await health()

    @router.get("/version")
    async def version():
        return {"version": VERSION}

    @router.get("/load")
    async def load():
        return {"server_load": len(ctx.client.in_flight)}

    return router

