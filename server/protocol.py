"""Request bodies of the OpenAI-compatible API (pydantic), as openai-api.md §2, §7 and §8 define
them.

Unknown fields are accepted and logged (vLLM); fields vLLM defines but we do not implement are
declared here so that `unsupported_fields` can refuse them with a 400 naming the field
(openai-api.md §2.3). Range checks that the engine owns (temperature, top_p, ...) live in
`SamplingParams`; the serving layer maps its `ParamError` to a 400.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from specserve.spec_phases.sampling_params import Constraint, ParamError

TokenIds = list[int]
Prompt = Union[str, list[str], TokenIds, list[TokenIds]]


class OpenAIBase(BaseModel):
    # Unknown fields are kept (and logged by the handler); NaN/inf are refused at parse time.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBase):
    """Fields shared by completions and chat (OpenAI + the vLLM extensions of openai-api.md
    §2.2)."""
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # echoed in the x-request-id header: printable ASCII, bounded
    request_id: str | None = Field(default=None, min_length=1, max_length=256,
                                   pattern=r"^[\x21-\x7e]+$")
    user: str | None = None
    num_speculative_tokens: int | None = None
    # structured output (docs/structured-output.md): `constraint()` reads these
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Known to vLLM, refused here until implemented (openai-api.md §2.3).
    use_beam_search: bool = False
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    prompt_embeds: Any = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    priority: int = 0

    def unsupported_field(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        if self.use_beam_search:
            return "use_beam_search"
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            return "guided_decoding_backend"
        for name in ("guided_whitespace_pattern",
                     "prompt_embeds", "logits_processors", "kv_transfer_params"):
            if getattr(self, name) is not None:
                return name
        for key, value in (self.structured_outputs or {}).items():
            if key not in STRUCTURED_OUTPUTS_KEYS and value not in (None, False):
                return f"structured_outputs.{key}"
        if self.priority != 0:
            return "priority"
        return None


    def constraint(self) -> Constraint | None:
        """The structured-output constraint the request asks for (None: free text), from
        `response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice` or its newer
        `structured_outputs` object; at most one of them. ParamError names the field."""
        found = []
        fmt = self.response_format
        if fmt is not None:
            found.append(response_format_constraint(fmt))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "lark")):
            value = getattr(self, name)
            if value is not None:
                found.append(field_constraint(kind, value, name))
        for key, value in (self.structured_outputs or {}).items():
            kind = STRUCTURED_OUTPUTS_KEYS.get(key)
            if kind == "json_object" and value:
                found.append(Constraint("json_object", param="structured_outputs.json_object"))
            elif kind is not None and value is not None and kind != "json_object":
                found.append(field_constraint(kind, value, f"structured_outputs.{key}"))
        found = [c for c in found if c is not None]
        if len(found) > 1:
            raise ParamError(found[1].param, f"only one structured-output constraint per request; "
                                             f"got {found[0].param} and {found[1].param}.")
        return found[0] if found else None


# vLLM's StructuredOutputsParams keys served here, and the constraint kind each gives
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                           "json_object": "json_object", "grammar": "lark"}


def response_format_constraint(fmt: dict[str, Any]) -> Constraint | None:
    """OpenAI's `response_format`: text, json_object, or json_schema {name, schema, strict}. The
    schema is enforced whether or not `strict` is set (as vLLM does)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise ParamError("response_format", f"response_format.type must be one of 'text', "
                                            f"'json_object', 'json_schema'; got {kind!r}.")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ParamError("response_format.json_schema",
                         "response_format.json_schema must be an object with a `schema`.")
    if not isinstance(spec.get("name", "schema"), str):
        raise ParamError("response_format.json_schema.name", "the schema's name must be a string.")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ParamError("response_format.json_schema.strict", "strict must be a boolean.")
    schema = spec.get("schema")
    if schema is None:                     # no schema: any JSON object (vLLM does the same)
        return Constraint("json_object", param="response_format.json_schema")
    return field_constraint("json_schema", schema, "response_format.json_schema.schema")


def field_constraint(kind: str, value: Any, param: str) -> Constraint:
    """One constraint field's value -> a Constraint (shape checks only; the grammar library
    checks the rest)."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ParamError(param, f"{param} is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ParamError(param, f"{param} must be a JSON schema object.")
        return Constraint("json_schema", json.dumps(value), param=param)    # key order kept
    if kind in ("regex", "lark"):              # lark: a Lark or GBNF/EBNF grammar (vLLM's)
        if not isinstance(value, str) or not value.strip():
            raise ParamError(param, f"{param} must be a non-empty string.")
        return Constraint(kind, value, param=param)
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise ParamError(param, f"{param} must be a non-empty list of strings.")
    return Constraint("choice", choices=tuple(value), param=param)


class CompletionRequest(SamplingFields):
    prompt: Prompt | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant turn that called tools
    tool_call_id: str | None = None                    # a `tool` message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI error envelope (openai-api.md §6); documented for /docs and schemathesis."""
    error: ErrorInfo


class SpeculativeUsage(BaseModel):
    """`usage.speculative`, a specserve extension (present only when speculation is on for the
    response's requests), summed over the response's choices. OpenAI clients keep it in
    `usage.model_extra`; the standard usage fields are unchanged."""
    num_drafts: int                  # verify steps that carried at least one draft token
    draft_tokens: int                # draft tokens proposed (pruned ones included)
    accepted_tokens: int             # draft tokens accepted (bonus/recovered tokens not counted)
    acceptance_rate: float           # accepted_tokens / draft_tokens (0 without drafts)
    # draft_tokens / num_drafts: mean k of a verify step (0 without drafts)
    mean_draft_length: float


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    speculative: SpeculativeUsage | None = None    # extension: only with speculation on


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str                   # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None              # None when the turn is tool calls only
    tool_calls: list[ToolCall] | None = None      # only when the request had tools


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "abort", "error", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
