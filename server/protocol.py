"""Request bodies of the OpenAI-compatible API (pydantic), as openai-api.md §2, §7 and §8 define
them.

Unknown fields are accepted and logged (vLLM); fields vLLM defines but we do not implement are
declared here so that `unsupported_fields` can refuse them with a 400 naming the field
(openai-api.md §2.3). Range checks that the engine owns (temperature, top_p, ...) live in
`SamplingParams`; the serving layer maps its `ParamError` to a 400.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

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
    # Known to vLLM, refused here until implemented (openai-api.md §2.3).
    use_beam_search: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
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
        if self.response_format is not None and self.response_format != {"type": "text"}:
            return "response_format"
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
                     "prompt_embeds", "logits_processors", "kv_transfer_params"):
            if getattr(self, name) is not None:
                return name
        if self.priority != 0:
            return "priority"
        return None


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
