"""POST /v1/chat/completions (openai-api.md §7): chat template, n choices, chat-shaped logprobs,
SSE."""
from __future__ import annotations

import asyncio
import functools
import time

from fastapi import Request
from starlette.responses import Response

from specserve.scheduler.messages import EngineRequest, TokenLogprob
from specserve.server.errors import bad_request
from specserve.server.generation import ChoiceState, spec_metrics
from specserve.server.protocol import ChatCompletionRequest, ChatMessage
from specserve.server.template_budget import TemplateBudgetError, TemplateRenderError
from specserve.scheduler.validation import check_context
from specserve.server.structured import checked, constrained, request_constraint
from specserve.server.output_parsing import (REASONING_PARSERS, OutputParser, StreamDiffer,
                                             tool_parser_for)
from specserve.server.tool_calls import (ToolError, ToolRequest, call_grammar, history_message,
                                         new_call_id, parse_tools, tool_call_objects,
                                         with_tool_prompt)
from specserve.server.serving_base import (ServingContext, respond, check_common_fields,
                                           encode_text,
                                           engine_request_id, error_event, logprob_value,
                                           new_choice, request_id_for,
                                           sampling_params, served_model,
                                           sse_data, stream_error, usage_dict)

NO_TEMPLATE = ("This model has no chat template; use /v1/completions or start the server with "
               "--chat-template.")


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the template sees them: text parts joined into one string (other parts → 400)."""
    if not messages:
        raise bad_request("messages must be a non-empty list.", "messages")
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part type {part.type!r} is not supported by this "
                                      f"server; "
                                      "only text parts are.", f"messages.{i}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            for j, call in enumerate(message.tool_calls):
                fn = call.get("function")
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                    raise bad_request("a tool call needs function.name.",
                                      f"messages.{i}.tool_calls.{j}")
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


@functools.lru_cache(maxsize=16)
def template_takes_tools(template: str) -> bool:
    """Whether the chat template reads a `tools` variable (renders a tool section itself)."""
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(
            template))
    except jinja2.TemplateError:
        return False


def render_chat(ctx: ServingContext, messages: list[ChatMessage], *, chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool,
                chat_template_kwargs: dict | None, tools: ToolRequest | None = None) -> str:
    """The prompt text from the chat template (request > --chat-template > the model's own).
    Tools go to a template that takes them, else into the system message (tool_calls.py)."""
    import jinja2

    if (chat_template is not None or "chat_template" in (chat_template_kwargs or {})) and \
            not ctx.settings.trust_request_chat_template:
        raise bad_request("Chat template is passed with request, but "
                          "--trust-request-chat-template is not set. Refused request with "
                          "untrusted chat template.", "chat_template")
    template = chat_template or ctx.settings.chat_template or ctx.tokenizer.chat_template
    if not template:
        raise bad_request(NO_TEMPLATE, "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true.",
                          "continue_final_message")
    takes_tools = template_takes_tools(template)
    convo = [history_message(m, takes_tools) for m in conversation(messages)]
    options = dict(add_generation_prompt=add_generation_prompt,
                   continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    if tools is not None and takes_tools:
        options["tools"] = [t.spec() for t in tools.tools]
    elif tools is not None:
        convo = with_tool_prompt(convo, tools)
    if chat_template is not None or "chat_template" in options:     # the request's own code
        try:
            return ctx.template_sandbox.render(convo, options.pop("chat_template", template),
                                               **options)
        except TemplateBudgetError as exc:
            raise bad_request(f"Refused: {exc}.", "chat_template") from None
        except TemplateRenderError as exc:
            raise bad_request(f"The chat template failed on these messages: {exc}",
                              "messages") from None
    try:
        return ctx.tokenizer.apply_chat_template(
            convo, chat_template=template, tokenize=False, **options)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise bad_request(f"The chat template failed on these messages: {exc}",
                          "messages") from None


def chat_logprob_entries(token_text, token_ids: list[int], entries: list[TokenLogprob],
                         k: int) -> list:
    """`logprobs.content` items (openai-api.md §4.2): token, logprob, bytes, top_logprobs."""
    content = []
    for tok, entry in zip(token_ids, entries):
        text = token_text(tok)
        top = [{"token": token_text(alt), "logprob": logprob_value(lp),
                "bytes": list(token_text(alt).encode())}
               for alt, lp in list(zip(entry.top_token_ids, entry.top_logprobs))[:k]]
        content.append({"token": text, "logprob": logprob_value(entry.logprob),
                        "bytes": list(text.encode()), "top_logprobs": top})
    return content


async def create_chat_completion(raw: Request, body: ChatCompletionRequest,
                                 ctx: ServingContext) -> Response:
    model = served_model(ctx, body.model)
    check_common_fields(body, "chat")
    try:
        tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolError as exc:
        raise bad_request(exc.message, exc.param) from None
    if tools is not None and tools.choice == "auto" and not ctx.settings.auto_tool_choice:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          '--tool-call-parser to be set', "tool_choice")
    constraint = request_constraint(body, ctx.settings.json_unnamed_properties)
    call_constraint = call_grammar(tools) if tools is not None else None
    if constraint is not None and call_constraint is not None:
        raise bad_request(f"{constraint.param} cannot be combined with tool_choice "
                          f"{body.tool_choice!r}: the calls are constrained already.",
                          constraint.param)
    constraint = await checked(constraint or call_constraint)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        if not 0 <= body.top_logprobs <= ctx.settings.max_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {ctx.settings.max_logprobs}], "
                              f"got {body.top_logprobs}.", "top_logprobs")
    if body.n > ctx.settings.max_choices:
        raise bad_request(f"n must be at most {ctx.settings.max_choices}, got {body.n}.", "n")
    # rendering and tokenizing: off the event loop
    text = await asyncio.to_thread(render_chat, ctx, body.messages,
                                   chat_template=body.chat_template,
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   chat_template_kwargs=body.chat_template_kwargs,
                                   tools=tools)
    prompt_ids = await asyncio.to_thread(encode_text, ctx, text, "messages",
                                         body.add_special_tokens,
                                         limit_length=body.truncate_prompt_tokens is None)
    if body.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-body.truncate_prompt_tokens:]
    output = output_parser(ctx, tools, text)
    if output.tools is not None and not output.tools.skip_special_tokens:
        body.skip_special_tokens = False       # the format's markers are special tokens
    info = ctx.model_info
    explicit = body.max_completion_tokens
    if explicit is None:
        explicit = body.max_tokens
    if explicit is not None and explicit < 1:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise bad_request(f"{param} must be at least 1, got {explicit}.", param)
    room = info.max_model_len - len(prompt_ids)      # left out: the room, capped by the
    max_tokens = explicit if explicit is not None else min(    # generation config's max_tokens
        room, ctx.settings.sampling_defaults.get("max_tokens", room))
    check_context(len(prompt_ids), max_tokens, info.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.prompt_logprobs is not None and body.prompt_logprobs > ctx.settings.max_logprobs:
        raise bad_request(f"prompt_logprobs must be at most {ctx.settings.max_logprobs}, "
                          f"got {body.prompt_logprobs}.", "prompt_logprobs")
    request_id = request_id_for(raw, body)
    requests, states = [], []
    for i in range(body.n):
        params = constrained(sampling_params(body, max_tokens=max_tokens, logprobs=logprobs,
                                             prompt_logprobs=body.prompt_logprobs,
                                             vocab_size=info.vocab_size, seed_offset=i),
                             constraint)
        requests.append(EngineRequest(engine_request_id(request_id, i), prompt_ids, params))
        states.append(new_choice(ctx, body, i, 0))
    return await respond(raw, ctx, ChatJob(ctx, body, model, request_id, prompt_ids, states,
                                           tools, output), requests, body.n, body.stream)


def output_parser(ctx: ServingContext, tools: ToolRequest | None, prompt: str) -> OutputParser:
    """The request's tool parser (none without tools) and the server's reasoning parser."""
    settings = ctx.settings
    reasoning = REASONING_PARSERS[settings.reasoning_parser](prompt) \
        if settings.reasoning_parser else None
    return OutputParser(tool_parser_for(settings.tool_call_parser, tools, ctx.tokenizer, prompt),
                        reasoning)


class ChatJob:
    def __init__(self, ctx, body: ChatCompletionRequest, model: str, request_id: str, prompt_ids,
                 states, tools: ToolRequest | None = None, output: OutputParser | None = None):
        self.ctx, self.body, self.model = ctx, body, model
        self.prompt_ids, self.states = prompt_ids, states
        self.tools = tools                 # None: no tool may be called, the text is content
        self.output = output or OutputParser(None, None)
        # plain text in, plain text out: no parsing
        self.parsing = self.output.tools is not None or self.output.reasoning is not None
        self.id = f"chatcmpl-{request_id}"
        self.created = int(time.time())
        self.k = body.top_logprobs or 0

    def usage(self) -> dict:
        details = self.ctx.settings.enable_prompt_tokens_details
        cached = self.states[0].num_cached_tokens if details else None
        return usage_dict(len(self.prompt_ids), sum(len(s.token_ids) for s in self.states), cached,
                          self.states)

    def logprobs(self, token_ids, entries) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": chat_logprob_entries(self.ctx.token_text, token_ids, entries, self.k)}

    def add_metrics(self, payload: dict) -> None:
        if self.ctx.settings.per_request_spec_decode_metrics:
            metrics = spec_metrics(self.states)
            if metrics is not None:
                payload["metrics"] = metrics

    async def collect(self, requests: list[EngineRequest]) -> dict:
        async with self.ctx.client.open(requests, self.body.n) as stream:
            async for index, output in stream:
                if self.states[index].process(output).stopped_by_string:
                    stream.finish(index)
                if all(s.finished for s in self.states):
                    break
        choices = []
        for state in self.states:
            message = {"role": "assistant", "content": state.text}
            finish_reason = state.finish_reason
            if self.parsing:
                content, reasoning, calls = self.output.message(state.text)
                message["content"] = content
                if self.output.reasoning is not None or reasoning is not None:
                    message["reasoning"] = message["reasoning_content"] = reasoning
                if self.tools is not None:
                    message["tool_calls"] = tool_call_objects(calls,
                                                              [new_call_id() for _ in calls])
                finish_reason = tool_finish_reason(finish_reason, calls)
            choice = {"index": state.index, "message": message,
                      "logprobs": self.logprobs(state.token_ids, state.logprobs),
                      "finish_reason": finish_reason, "stop_reason": state.stop_reason}
            if self.body.return_token_ids:
                choice["token_ids"] = state.token_ids
                choice["prompt_token_ids"] = self.prompt_ids
            choices.append(choice)
        response = {"id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.model,
                    "choices": choices, "usage": self.usage(),
                    "system_fingerprint": self.ctx.settings.system_fingerprint}
        self.add_metrics(response)
        return response

    def chunk(self, choice: dict) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [choice]}

    async def events(self, stream):
        body, settings = self.body, self.ctx.settings
        include_usage = settings.enable_force_include_usage or bool(
            body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        differs = [StreamDiffer(self.output) if self.parsing else None for _ in self.states]
        try:
            for state in self.states:             # role first, one chunk per choice
                yield sse_data(self.chunk({"index": state.index,
                                           "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}))
            async for index, output in stream:
                state: ChoiceState = self.states[index]
                delta = state.process(output)
                if delta.stopped_by_string:
                    stream.finish(index)
                logprobs = self.logprobs(delta.token_ids, delta.logprobs)
                has_logprobs = bool(logprobs and logprobs["content"])
                text, finish_reason, differ = delta.text, delta.finish_reason, differs[index]
                fields = {"content": text} if text else {}
                if differ is not None:            # reasoning, content and call argument deltas
                    fields = differ.feed(text, final=finish_reason is not None)
                    if finish_reason is not None:
                        finish_reason = tool_finish_reason(finish_reason, differ.sent_args)
                if not fields and finish_reason is None and not has_logprobs:
                    continue
                choice = {"index": state.index, "delta": fields,
                          "logprobs": logprobs, "finish_reason": finish_reason}
                if finish_reason is not None:
                    choice["stop_reason"] = delta.stop_reason
                if body.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                chunk = self.chunk(choice)
                if continuous:
                    chunk["usage"] = self.usage()
                done = all(s.finished for s in self.states)
                if done and not include_usage:
                    self.add_metrics(chunk)
                yield sse_data(chunk)
                if done:
                    break
            if include_usage:
                final = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": [], "usage": self.usage()}
                self.add_metrics(final)
                yield sse_data(final)
        except Exception as exc:
            yield error_event(stream_error(exc))
        finally:
            await stream.close()
        yield "[DONE]"


def tool_finish_reason(finish_reason: str | None, calls: list) -> str | None:
    """"tool_calls" when the model ended its turn after calling tools (OpenAI, vLLM)."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
