"""What the engine refuses, written once: the engine checks every request with `validate`, and the
server calls the same checks before it submits (a 400 naming the `param` either way)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from specserve.scheduler.messages import EngineRequest, ModelInfo
from specserve.scheduler.structured_output import check as check_grammar
from specserve.scheduler.structured_output import vllm_json_schema
from specserve.spec_phases.sampling_params import Constraint, ParamError


def with_unnamed_properties(constraint: Constraint) -> Constraint:
    """A json_schema constraint whose objects that say nothing of `additionalProperties` admit
    other properties (JSON Schema's own reading) instead of none (vLLM's default grammar's);
    `--structured-outputs-config '{"backend": "guidance"}'`. Other constraints unchanged."""
    if constraint.kind != "json_schema":
        return constraint
    schema = vllm_json_schema(json.loads(constraint.spec), unnamed=True)
    return dataclasses.replace(constraint, spec=json.dumps(schema))


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """Every id is a token of the vocabulary."""
    bad = next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise ParamError("prompt", f"token id {bad} is out of vocabulary (size {vocab_size}).")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Prompt + completion fit the context (and the prompt leaves room for one token), with the
    message OpenAI clients match on."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len or num_prompt_tokens >= max_model_len:
        raise ParamError(
            "input_tokens" if num_prompt_tokens >= max_model_len else "max_tokens",
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.")


def validate(req: EngineRequest, info: ModelInfo) -> None:
    """Raise ParamError for a request the engine cannot serve."""
    prompt = req.prompt_token_ids
    if not prompt:
        raise ParamError("prompt", "prompt must be provided and non-empty.")
    check_prompt_ids(prompt, info.vocab_size)
    check_context(len(prompt), req.sampling_params.max_tokens, info.max_model_len)
    req.sampling_params.check_vocab(info.vocab_size)


def check_constraint(constraint: Constraint) -> None:
    """ParamError naming the field when a structured-output constraint is malformed or cannot be
    compiled (an unsupported schema keyword, a bad regex). Milliseconds for a typical schema, more
    for a huge one: call it off the event loop."""
    check_grammar(constraint)
