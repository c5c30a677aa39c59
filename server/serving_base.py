"""What completions and chat share: model names, field checks, sampling params, the context rule,
engine requests for prompts × n, disconnect watching, and SSE framing."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response

from specserve.scheduler.messages import EngineRequest, ModelInfo
from specserve.spec_phases.sampling_params import ParamError, SamplingParams
from specserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher, make_token_text
from specserve.server.engine_client import EngineClient
from specserve.server.errors import APIError, bad_request, map_engine_exception
from specserve.server.generation import ChoiceState, speculative_usage
from specserve.server.middleware import REQUEST_ID_KEY
from specserve.server.protocol import SamplingFields
from specserve.server.settings import ServerSettings
from specserve.server.template_budget import TemplateSandbox

logger = logging.getLogger("specserve.server")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


@dataclass
class ServingContext:
    """Everything a handler needs; one per app (tests build it around a fake engine)."""
    client: EngineClient
    tokenizer: Any
    settings: ServerSettings
    token_text: Any = field(init=False)
    max_prompt_chars: int = field(init=False)
    template_sandbox: TemplateSandbox = field(init=False)   # request templates, under a budget

    def __post_init__(self) -> None:
        self.token_text = make_token_text(self.tokenizer)
        self.max_prompt_chars = self.model_info.max_model_len * max_token_chars(self.tokenizer)
        self.template_sandbox = TemplateSandbox(self.tokenizer, max_chars=self.max_prompt_chars)
        if self.settings.trust_request_chat_template:      # its start-up not paid while serving
            threading.Thread(target=self.template_sandbox.start, daemon=True).start()

    @property
    def model_info(self) -> ModelInfo:
        return self.client.model_info


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for: its longest vocabulary entry (byte-level and
    SentencePiece entries spell each byte or character at least once, so decoding never yields
    more characters than the entry has)."""
    vocab = tokenizer.get_vocab()
    return max(1, max(len(piece) for piece in vocab))


def encode_text(ctx: ServingContext, text: str, param: str, add_special_tokens: bool,
                limit_length: bool = True) -> list[int]:
    """Tokenize request text (call it off the event loop: a long text takes seconds). Text longer
    than the context could hold even at the vocabulary's longest token is a 400 before any
    tokenizing (`limit_length` False where the prompt is truncated afterwards); text that is not
    valid Unicode (a lone UTF-16 surrogate from a JSON escape such as \\ud800) is a 400 naming
    `param`, not a tokenizer crash."""
    if limit_length and len(text) > ctx.max_prompt_chars:
        limit = ctx.model_info.max_model_len
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, the "
                          f"{param} has {len(text)} characters, more than {limit} tokens of this "
                          f"vocabulary can hold ({ctx.max_prompt_chars}). Please reduce the length "
                          f"of the {param}.", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode text: a lone surrogate "
                          f"{text[exc.start]!r} at character {exc.start}.", param) from None
    return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def served_model(ctx: ServingContext, requested: str | None) -> str:
    """The name to echo in `model`; 404 for a name we do not serve (openai-api.md §6)."""
    if requested is None or requested == "":
        return ctx.settings.model_name
    if requested not in ctx.settings.served_model_names:
        raise APIError(404, f"The model `{requested}` does not exist.", "model")
    return requested


def check_common_fields(body: SamplingFields, endpoint: str) -> None:
    """400 for fields we know but cannot honour; a warning for fields we do not know."""
    unknown = body.unknown_fields()
    if unknown:
        logger.warning("%s: ignoring unknown request fields %s", endpoint, unknown)
    unsupported = body.unsupported_field()
    if unsupported is not None:
        raise bad_request(f"{unsupported} is not supported by this server", unsupported)
    if body.stream_options is not None and not body.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not available when stream=true.", "prompt_logprobs")
    if body.n < 1:
        raise bad_request(f"n must be at least 1, got {body.n}.", "n")


def stop_strings(body: SamplingFields) -> list[str]:
    if body.stop is None:
        return []
    return [body.stop] if isinstance(body.stop, str) else list(body.stop)


def sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None, vocab_size: int,
                    seed_offset: int = 0) -> SamplingParams:
    """Request fields → SamplingParams (null → OpenAI default); range errors become 400s."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.",
                              "logit_bias") from None
    seed = body.seed
    if seed is not None and seed_offset:
        seed += seed_offset
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=bias, seed=seed, stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, num_speculative_tokens=body.num_speculative_tokens)
        params.check_vocab(vocab_size)
    except ParamError as exc:
        if exc.param == "seed" and seed_offset:       # seed + i overflowed for a later child
            raise bad_request(f"seed must fit in 64 bits, got {body.seed}.", "seed") from None
        raise bad_request(exc.message, exc.param) from None
    return params


def request_id_for(raw: Request, body: SamplingFields) -> str:
    """The client-visible request id: body `request_id`, else X-Request-Id, else a random hex
    uuid."""
    rid = body.request_id or raw.scope.get(REQUEST_ID_KEY) or uuid.uuid4().hex
    raw.scope[REQUEST_ID_KEY] = rid
    return rid


def engine_request_id(request_id: str, choice_index: int) -> str:
    """Client ids may repeat; the engine's id adds the choice and a unique suffix."""
    return f"{request_id}-{choice_index}-{uuid.uuid4().hex[:8]}"


def new_choice(ctx: ServingContext, body: SamplingFields, index: int,
               prompt_index: int) -> ChoiceState:
    return ChoiceState(
        index=index, prompt_index=prompt_index,
        detokenizer=IncrementalDetokenizer(ctx.tokenizer, body.skip_special_tokens),
        stops=StopStringMatcher(stop_strings(body), body.include_stop_str_in_output),
        include_stop_str_in_output=body.include_stop_str_in_output)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
               states: list[ChoiceState] = ()) -> dict:
    """OpenAI usage; plus `speculative` (specserve's extension) when any of the choices
    speculated."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
             "completion_tokens": completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    speculative = speculative_usage(list(states))
    if speculative is not None:
        usage["speculative"] = speculative
    return usage


def logprob_value(value: float) -> float:
    """-inf (and NaN) cannot go in JSON; vLLM sends -9999.0."""
    return value if value == value and value > -9999.0 else -9999.0


async def run_unless_disconnected(raw: Request, coro):
    """Await `coro`, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(coro)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
    if task in done:
        return task.result()
    raise ClientDisconnected()


def sse_data(payload: dict | str) -> str:
    """One SSE `data:` payload (sse-starlette adds the `data: ` prefix and the blank line)."""
    return payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                separators=(",", ":"))


def sse_response(events, ctx: ServingContext, on_close) -> EventSourceResponse:
    """`data: <json>\\n\\n` events ending with `data: [DONE]`; `on_close` runs however the stream
    ends."""
    return EventSourceResponse(events, sep="\n", ping=ctx.settings.sse_keepalive_s,
                               background=BackgroundTask(on_close))


def error_event(err: APIError) -> str:
    return sse_data(err.envelope())


def stream_error(exc: BaseException) -> APIError:
    """An error after the 200 header: always 500 in-band (openai-api.md §5)."""
    if isinstance(exc, APIError) and exc.status >= 500:
        return exc
    logger.error("request failed after streaming started: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"The engine failed on this request: {exc}")


async def open_stream(raw: Request, ctx: ServingContext, requests: list[EngineRequest], n: int = 1):
    """Submit every choice and wait for the first output, so that overload, a dead engine or a
    refused request still get their own status before the 200 header. The stream starts with it."""
    stream = ctx.client.open(requests, n)
    try:
        await stream.__aenter__()
    except BaseException as exc:
        raise map_engine_exception(exc, ctx.settings.retry_after_s) from None
    try:
        first = await run_unless_disconnected(raw, _next_or_none(stream))
    except BaseException as exc:
        await stream.close()
        if isinstance(exc, ClientDisconnected):
            raise
        raise map_engine_exception(exc, ctx.settings.retry_after_s) from None
    if first is not None:
        stream.unget(first)
    return stream


async def respond(raw: Request, ctx: ServingContext, job, requests: list[EngineRequest], n: int,
                  stream: bool):
    """Stream the job's SSE events, or collect its whole JSON body (499 if the client left
    first: before the first token when streaming)."""
    if stream:
        try:
            engine_stream = await open_stream(raw, ctx, requests, n)
        except ClientDisconnected:             # gone before the first token (aborted already)
            return Response(status_code=499)
        return sse_response(job.events(engine_stream), ctx, engine_stream.close)
    try:
        return JSONResponse(await run_unless_disconnected(raw, job.collect(requests)))
    except ClientDisconnected:
        return Response(status_code=499)


async def _next_or_none(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
