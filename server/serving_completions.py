"""POST /v1/completions (openai-api.md §2–5): prompts × n choices, echo, logprobs, SSE or one
JSON."""
from __future__ import annotations

import asyncio

import time

from fastapi import Request
from starlette.responses import Response

from specserve.scheduler.messages import EngineRequest, TokenLogprob
from specserve.server.errors import bad_request
from specserve.server.generation import ChoiceState, spec_metrics
from specserve.server.protocol import CompletionRequest
from specserve.scheduler.validation import check_context, check_prompt_ids
from specserve.server.structured import checked, constrained, request_constraint
from specserve.server.serving_base import (ServingContext, respond, check_common_fields,
                                           encode_text,
                                           engine_request_id,
                                           error_event, logprob_value, new_choice, request_id_for,
                                           sampling_params,
                                           served_model, sse_data, stream_error,
                                           usage_dict)


def parse_prompts(ctx: ServingContext,
                  body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """`prompt` in any of its four shapes → [(text or None, token ids)], one per prompt."""
    prompt = body.prompt
    empty = bad_request("prompt must be provided and non-empty.", "prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise empty
    if isinstance(prompt, str):
        items: list = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if len(items) > ctx.settings.max_choices:
        raise bad_request(f"at most {ctx.settings.max_choices} prompts per request, got "
                          f"{len(items)}.",
                          "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = encode_text(ctx, item, "prompt", body.add_special_tokens,
                              limit_length=body.truncate_prompt_tokens is None) if item else []
            text = item
        else:
            ids, text = [int(t) for t in item], None
            check_prompt_ids(ids, ctx.model_info.vocab_size)      # the engine's check
        if not ids:
            raise empty
        if body.truncate_prompt_tokens is not None:
            cut = len(ids) > body.truncate_prompt_tokens
            ids, text = ids[-body.truncate_prompt_tokens:], None if cut else text
        prompts.append((text, ids))
    return prompts


def check_logprobs_field(name: str, value: int | None, max_logprobs: int) -> None:
    if value is None:
        return
    if value < 0:
        raise bad_request(f"`{name}` must be a positive value or -1. (-1 is not supported by this "
                          f"server.)",
                          name)
    if value > max_logprobs:
        raise bad_request(f"{name} must be at most {max_logprobs}, got {value}.", name)


class CompletionLogprobs:
    """Builds the completions `logprobs` object incrementally (openai-api.md §4.1)."""

    def __init__(self, token_text, k: int, offset: int = 0):
        self.token_text, self.k, self.offset = token_text, k, offset

    def build(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, entry in zip(token_ids, entries):
            text = self.token_text(tok)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:                     # the first prompt token has no logprob
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(logprob_value(entry.logprob))
            top = {text: logprob_value(entry.logprob)}
            for alt_id, alt_lp in list(zip(entry.top_token_ids, entry.top_logprobs))[:self.k]:
                top.setdefault(self.token_text(alt_id), logprob_value(alt_lp))
            out["top_logprobs"].append(top)
        return out


def vllm_prompt_logprobs(ctx: ServingContext, prompt_ids: list[int], entries) -> list[dict | None]:
    """vLLM's `prompt_logprobs` choice field: per position {token id: {logprob, rank,
    decoded_token}}."""
    result: list[dict | None] = []
    for tok, entry in zip(prompt_ids, entries or []):
        if entry is None:
            result.append(None)
            continue
        position = {str(tok): {"logprob": logprob_value(entry.logprob), "rank": entry.rank,
                               "decoded_token": ctx.token_text(tok)}}
        for rank, (alt, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            position.setdefault(str(alt), {"logprob": logprob_value(lp), "rank": rank,
                                           "decoded_token": ctx.token_text(alt)})
        result.append(position)
    return result


async def create_completion(raw: Request, body: CompletionRequest, ctx: ServingContext) -> Response:
    model = served_model(ctx, body.model)
    check_common_fields(body, "completions")
    if body.suffix is not None:
        raise bad_request("suffix is not supported by this server (no fill-in-the-middle).",
                          "suffix")
    if body.best_of not in (None, 1, body.n):
        raise bad_request(f"best_of must be null, 1 or equal to n={body.n}, got {body.best_of}.",
                          "best_of")
    check_logprobs_field("logprobs", body.logprobs, ctx.settings.max_logprobs)
    check_logprobs_field("prompt_logprobs", body.prompt_logprobs, ctx.settings.max_logprobs)
    max_tokens = body.max_tokens     # null: the generation config's max_tokens, else 16
    if max_tokens is None:
        max_tokens = ctx.settings.sampling_defaults.get("max_tokens", 16)
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    constraint = await checked(request_constraint(      # structured output
        body, ctx.settings.json_unnamed_properties))
    prompts = await asyncio.to_thread(parse_prompts, ctx, body)     # tokenizing: off the loop
    if len(prompts) * body.n > ctx.settings.max_choices:
        raise bad_request(f"prompts × n must be at most {ctx.settings.max_choices}, "
                          f"got {len(prompts) * body.n}.", "n")
    info = ctx.model_info
    for _, ids in prompts:                        # all prompts, before any is submitted
        check_context(len(ids), max_tokens, info.max_model_len)
    want_prompt_lp = [v for v in (body.prompt_logprobs,
                                  body.logprobs if body.echo else None) if v is not None]
    request_id = request_id_for(raw, body)
    requests, states = [], []
    for prompt_index, (_, ids) in enumerate(prompts):
        for i in range(body.n):
            prompt_lp = max(want_prompt_lp) if want_prompt_lp else None
            params = constrained(sampling_params(body, max_tokens=max_tokens,
                                                 logprobs=body.logprobs, prompt_logprobs=prompt_lp,
                                                 vocab_size=info.vocab_size, seed_offset=i),
                                 constraint)
            index = prompt_index * body.n + i
            requests.append(EngineRequest(engine_request_id(request_id, index), ids, params))
            states.append(new_choice(ctx, body, index, prompt_index))
    return await respond(raw, ctx, CompletionJob(ctx, body, model, request_id, prompts, states),
                         requests, body.n, body.stream)


class CompletionJob:
    def __init__(self, ctx, body: CompletionRequest, model: str, request_id: str, prompts, states):
        self.ctx, self.body, self.model = ctx, body, model
        self.prompts, self.states = prompts, states
        self.id = f"cmpl-{request_id}"
        self.created = int(time.time())

    def echo_text(self, state: ChoiceState) -> str:
        text, ids = self.prompts[state.prompt_index]
        if text is None:
            text = self.ctx.tokenizer.decode(ids, skip_special_tokens=self.body.skip_special_tokens)
        return text

    def usage(self) -> dict:
        num_prompt = sum(len(ids) for _, ids in self.prompts)
        num_completion = sum(len(s.token_ids) for s in self.states)
        cached = None
        if self.ctx.settings.enable_prompt_tokens_details:
            cached = sum(s.num_cached_tokens for s in self.states if s.index % self.body.n == 0)
        return usage_dict(num_prompt, num_completion, cached, self.states)

    def prompt_part(self, state: ChoiceState, logprobs: CompletionLogprobs | None):
        """Echoed text and its logprobs, if asked for."""
        if not self.body.echo:
            return "", None
        text = self.echo_text(state)
        ids = self.prompts[state.prompt_index][1]
        if logprobs is None:
            return text, None
        return text, logprobs.build(ids, state.prompt_logprobs or [None] * len(ids))

    async def collect(self, requests: list[EngineRequest]) -> dict:
        async with self.ctx.client.open(requests, self.body.n) as stream:
            async for index, output in stream:
                delta = self.states[index].process(output)
                if delta.stopped_by_string:
                    stream.finish(index)
                if all(s.finished for s in self.states):
                    break
        choices = []
        for state in self.states:
            lp = CompletionLogprobs(self.ctx.token_text, self.body.logprobs) \
                if self.body.logprobs is not None else None
            prefix, logprobs = self.prompt_part(state, lp)
            if lp is not None:
                lp.offset = len(prefix)
                gen = lp.build(state.token_ids, state.logprobs)
                logprobs = gen if logprobs is None else {k: logprobs[k] + gen[k] for k in gen}
            choices.append(self.choice(state, prefix + state.text, logprobs))
        response = {"id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.model,
                    "choices": choices, "usage": self.usage(),
                    "system_fingerprint": self.ctx.settings.system_fingerprint}
        self.add_metrics(response)
        return response

    def choice(self, state: ChoiceState, text: str, logprobs, final: bool = True) -> dict:
        choice = {"index": state.index, "text": text, "logprobs": logprobs,
                  "finish_reason": state.finish_reason if final else None,
                  "stop_reason": state.stop_reason if final else None}
        if self.body.return_token_ids and final and not self.body.stream:
            choice["token_ids"] = state.token_ids
            choice["prompt_token_ids"] = self.prompts[state.prompt_index][1]
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self.ctx, self.prompts[state.prompt_index][1], state.prompt_logprobs)
        return choice

    def add_metrics(self, payload: dict) -> None:
        if self.ctx.settings.per_request_spec_decode_metrics:
            metrics = spec_metrics(self.states)
            if metrics is not None:
                payload["metrics"] = metrics

    async def events(self, stream):
        body, settings = self.body, self.ctx.settings
        lps = [CompletionLogprobs(self.ctx.token_text,
                                  body.logprobs) if body.logprobs is not None else None
               for _ in self.states]
        echoed = [False] * len(self.states)
        include_usage = settings.enable_force_include_usage or bool(
            body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        try:
            async for index, output in stream:
                state = self.states[index]
                delta = state.process(output)
                if delta.stopped_by_string:
                    stream.finish(index)
                text, logprobs = "", None
                if not echoed[index]:
                    echoed[index] = True
                    text, logprobs = self.prompt_part(state, lps[index])
                text += delta.text
                if lps[index] is not None:
                    gen = lps[index].build(delta.token_ids, delta.logprobs)
                    logprobs = gen if logprobs is None else {k: logprobs[k] + gen[k] for k in gen}
                has_logprobs = bool(logprobs and logprobs["tokens"])
                if not text and delta.finish_reason is None and not has_logprobs:
                    # nothing to say yet (held back or half a character)
                    continue
                chunk = {"id": self.id, "object": "text_completion", "created": self.created,
                         "model": self.model,
                         "choices": [self.chunk_choice(state, delta, text, logprobs)]}
                if continuous:
                    chunk["usage"] = self.usage()
                if delta.finish_reason is not None and all(s.finished for s in self.states) \
                        and not include_usage:
                    self.add_metrics(chunk)
                yield sse_data(chunk)
                if all(s.finished for s in self.states):
                    break
            if include_usage:
                final = {"id": self.id, "object": "text_completion", "created": self.created,
                         "model": self.model, "choices": [], "usage": self.usage()}
                self.add_metrics(final)
                yield sse_data(final)
        except Exception as exc:                  # after the 200 header: in-band error, then [DONE]
            yield error_event(stream_error(exc))
        finally:
            await stream.close()
        yield "[DONE]"

    def chunk_choice(self, state: ChoiceState, delta, text: str, logprobs) -> dict:
        choice = {"index": state.index, "text": text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if self.body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

