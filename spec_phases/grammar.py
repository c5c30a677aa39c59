"""Structured output: one grammar matcher per constrained request, masks for every row it samples.

    Constraint (plain text, in SamplingParams) --compile, cached by value--> pristine LLMatcher
    per request: a deep copy of it, advanced over the request's accepted tokens only

The library is llguidance (docs/structured-output.md says why): building a matcher for a JSON
schema takes milliseconds and masks are computed lazily per step, so there is no long ahead-of-time
compile to hide.

A speculative step over a constrained request, given its drafts d:
1. **truncate**: d is cut before the first token the grammar forbids after d[:i] (that draft could
   never be accepted: its row's mask excludes it). The cut tokens still count as drafted, and as
   rejected, so FASER's acceptance estimate sees them (`SampledTokens.num_masked`).
2. **masks**: row i's mask is the grammar state after d[:i]: the matcher advances over the kept
   drafts, one mask per row, then rolls back all of them.
3. **accept** (verify.py): each row draws from its masked distribution; drafts are kept up to the
   first mismatch, then that row's token.
4. **advance**: the matcher consumes the accepted drafts and the one new token: exactly the tokens
   plain constrained decoding would have sampled, so its state (and the text) does not depend on
   speculation.
Once the grammar is complete only EOS is allowed, so the request stops there.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specserve.spec_phases.sampling_params import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Constraint,
                                                   ParamError)

if TYPE_CHECKING:         # imported where masks are built: the HTTP process validates
    import torch         # constraints with `check` and never loads torch (start-up, memory)

logger = logging.getLogger(__name__)

# JSON output with the separators json.dumps writes and no other whitespace: a small model left a
# free choice of whitespace can emit newlines forever, and one canonical spelling keeps greedy text
# stable.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED = 256                        # compiled constraints kept (least recently used dropped)
# JSON numbers as vLLM's grammars bound them, near a float64's range and precision: integers within
# +-2**53 (exact in a float64), other numbers within +-1e15 with at most 10 decimals (multipleOf
# 1e-10; no exponent), so a small model cannot write digits until max_tokens
INTEGER_LIMIT = 2 ** 53
NUMBER_LIMIT = 1e15
NUMBER_STEP = 1e-10
# keywords whose values are data or names, not schemas
_DATA_KEYWORDS = {"const", "enum", "default", "examples", "required", "title", "description",
                  "pattern", "format", "type", "x-guidance"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def vllm_json_schema(schema, close: bool = True, unnamed: bool = False):
    """The schema as vLLM's default grammar reads it: an object schema naming `properties` without
    `additionalProperties` (or `patternProperties` / `unevaluatedProperties`) admits no other
    property, and numbers are bounded (INTEGER_LIMIT, NUMBER_LIMIT, NUMBER_STEP) where the schema
    sets no bound of its own. A new object; `allOf` branches are not closed (each names only part
    of the properties). unnamed: such objects admit other properties instead (JSON Schema's own
    reading; `--structured-outputs-config '{"backend": "guidance"}'`)."""
    if isinstance(schema, list):
        return [vllm_json_schema(item, close, unnamed) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: vllm_json_schema(sub, unnamed=unnamed)
                        for name, sub in value.items()}
        else:
            out[key] = vllm_json_schema(value, close=key != "allOf", unnamed=unnamed)
    types = out.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if (close or unnamed) and "properties" in out and not {
            "additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = unnamed
    number, integer = "number" in types, "integer" in types and "number" not in types
    if number or integer:
        limit = INTEGER_LIMIT if integer else NUMBER_LIMIT
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = -limit
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = limit
        if number and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint; ParamError (naming the request field) when the
    constraint is not well formed. Does not check that the grammar compiles (see `check`)."""
    import llguidance

    c, matcher = constraint, llguidance.LLMatcher
    try:
        if c.kind == "json_schema":
            schema = json.loads(c.spec)
            if schema is False:
                raise ParamError(c.param, "the JSON schema `false` admits no value.")
            if schema is True:
                schema = {}                                    # any JSON value
            if not isinstance(schema, dict):
                raise ParamError(c.param, "the JSON schema must be an object (or a boolean).")
            return matcher.grammar_from_json_schema(vllm_json_schema(schema),
                                                    overrides=JSON_OPTIONS)
        if c.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if c.kind == "regex":
            return matcher.grammar_from_regex(c.spec)
        if c.kind == "tool_calls":
            return matcher.grammar_from_lark(tool_calls_lark(json.loads(c.spec)))
        if c.kind == "choice":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False)
                                      for choice in c.choices)
            return matcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.grammar_from("grammar", c.spec)      # Lark, or GBNF converted to it
    except ParamError:
        raise
    except json.JSONDecodeError as exc:
        raise ParamError(c.param, f"the JSON schema is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise ParamError(c.param, f"invalid {c.kind}: {exc}") from None


def tool_calls_lark(spec: dict) -> str:
    """A Lark grammar (llguidance's dialect: `%json` embeds a JSON schema) admitting only calls of
    the given functions with arguments valid against their parameter schemas."""
    variants = [{"type": "object", "additionalProperties": False,
                 "required": ["name", "arguments"],
                 "properties": {"name": {"const": t["name"]},
                                "arguments": vllm_json_schema(t["parameters"])}}
                for t in spec["tools"]]
    schema = dict(variants[0]) if len(variants) == 1 else {"anyOf": variants}
    schema["x-guidance"] = JSON_OPTIONS
    calls = 'call ("\\n" call)*' if spec["parallel"] else "call"
    open_tag, close_tag = json.dumps(TOOL_CALL_OPEN + "\n"), json.dumps("\n" + TOOL_CALL_CLOSE)
    return (f"start: {calls}\n"
            f"call: {open_tag} args {close_tag}\n"
            f"args: %json {json.dumps(schema, ensure_ascii=False)}\n")


def check(constraint: Constraint) -> None:
    """ParamError naming the field when the constraint is malformed or uses what the library
    cannot compile (an unknown keyword, a bad regex, a grammar over its size limits)."""
    import llguidance

    text = grammar_text(constraint)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ParamError(constraint.param, f"the {constraint.kind} cannot be compiled: {error}")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's int32 bitmask [rows, words] (bit b of word w: token 32 w + b) -> bool [rows,
    vocab], True where the token is allowed."""
    import torch

    raw = bitmask.contiguous().numpy().view(np.uint8)    # little-endian hosts: bytes in order
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()


@dataclass
class Constrained:
    """What the verify phase needs for one constrained request this step."""
    masks: torch.Tensor          # bool [kept drafts + 1, vocab]: row i after drafts[:i]
    num_masked: int              # drafts cut because the grammar forbids them


class GrammarBook:
    """Compiled constraints (cached by value) and each live request's matcher. Lives in the worker:
    requests' grammar state is per-request device-side state like a drafting cache, dropped with
    the plan's finished ids (kept across preemption: the output tokens it matched are kept)."""

    def __init__(self, tokenizer_loader: Callable[[], object], vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        """tokenizer_loader: the model's HF tokenizer (called once, on the first constraint)."""
        self._load_tokenizer = tokenizer_loader
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-grammar")
        self._tokenizer: Future | None = None
        # constraint -> (compile future, whether a request has used it yet)
        self._compiled: OrderedDict[Constraint, list] = OrderedDict()
        self._lock = threading.Lock()
        self.matchers: dict[str, object] = {}
        self.compile_times: list[float] = []        # seconds per compile since the last drain
        self.cache_hits = 0                         # requests served a cached compile since then
        self.mask_seconds = 0.0                     # total time spent cutting drafts and masking

    # -- compile (on the pool thread, started when a request is first planned) --------------
    def _llg_tokenizer(self):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self._load_tokenizer(), n_vocab=self.vocab_size,
                                            eos_token=list(self.eos_token_ids))

    def _compile(self, constraint: Constraint):
        import llguidance

        tokenizer = self._tokenizer.result()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
        with self._lock:
            self.compile_times.append(time.perf_counter() - start)
        if matcher.is_error():
            raise ParamError(constraint.param, f"the {constraint.kind} cannot be compiled: "
                                               f"{matcher.get_error()}")
        return matcher

    def prepare(self, constraint: Constraint, use: bool = True) -> Future:
        """Start compiling (or find the compiled) constraint; the future's result is a pristine
        matcher to copy. use: a request takes it (counted as a cache hit when an earlier request
        took it already); False only warms the cache (the engine, before admitting a request)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._llg_tokenizer)
            entry = self._compiled.get(constraint)
            if entry is None:
                entry = [self._pool.submit(self._compile, constraint), False]
                self._compiled[constraint] = entry
                while len(self._compiled) > MAX_CACHED:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(constraint)
            if use:
                self.cache_hits += entry[1]
                entry[1] = True
            return entry[0]

    def drain_stats(self) -> tuple[list[float], int]:
        with self._lock:
            out = (self.compile_times, self.cache_hits)
            self.compile_times, self.cache_hits = [], 0
        return out

    # -- per request -------------------------------------------------------------------------
    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def prefetch(self, request_id: str, constraint: Constraint) -> None:
        """A constrained request was planned (its prompt may still be prefilling): compile its
        grammar on the pool thread meanwhile."""
        if request_id not in self.matchers:
            self.matchers[request_id] = self.prepare(constraint)

    def matcher(self, request_id: str, constraint: Constraint, num_output_tokens: int,
                output_token_ids: tuple[int, ...]):
        """The request's matcher, advanced over its committed output (waits for the compile)."""
        if request_id in self.matchers and self.matchers[request_id] is None:
            return None                              # its grammar failed to compile
        state = self.matchers.get(request_id)
        if state is None:
            state = self.prepare(constraint)
        if isinstance(state, Future):
            try:
                state = state.result().deep_copy()
            except ParamError as exc:        # the server checks first; an engine-only caller
                logger.error("request %s: %s", request_id, exc.message)   # stops at once
                state = None
            if state is not None and num_output_tokens:
                if len(output_token_ids) != num_output_tokens:
                    raise RuntimeError(f"request {request_id}: grammar state lost after "
                                       f"{num_output_tokens} output tokens")
                state.consume_tokens(list(output_token_ids))
            self.matchers[request_id] = state
        return state

    def constrain(self, request_id: str, constraint: Constraint, num_output_tokens: int,
                  output_token_ids: tuple[int, ...], drafts: list[int]
                  ) -> tuple[list[int], Constrained]:
        """Cut the drafts at the first token the grammar forbids; one mask per verify row."""
        import llguidance.torch as llt
        import torch

        matcher = self.matcher(request_id, constraint, num_output_tokens, output_token_ids)
        start = time.perf_counter()
        if matcher is None or matcher.is_error():
            return [], Constrained(self._eos_only(1), len(drafts))
        kept = drafts[:matcher.validate_tokens(list(drafts))] if drafts else []
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(kept) + 1, words, dtype=torch.int32)
        for i in range(len(kept) + 1):
            llt.fill_next_token_bitmask(matcher, bitmask, i)
            if i < len(kept) and not matcher.consume_token(kept[i]):
                raise RuntimeError(f"request {request_id}: the grammar refused a draft it had "
                                   f"validated")
        if kept:
            matcher.rollback(len(kept))
        if matcher.is_error():                  # e.g. a step over the parser's limits: stop
            logger.error("request %s: grammar error: %s", request_id, matcher.get_error())
            self.mask_seconds += time.perf_counter() - start
            return [], Constrained(self._eos_only(1), len(drafts))
        masks = unpack_bitmask(bitmask, self.vocab_size)
        self.mask_seconds += time.perf_counter() - start
        return kept, Constrained(masks, len(drafts) - len(kept))

    def advance(self, request_id: str, tokens: list[int]) -> None:
        """The accepted drafts and the new token of this step."""
        matcher = self.matchers.get(request_id)
        if matcher is None or isinstance(matcher, Future) or matcher.is_error():
            return
        eos = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), len(tokens))
        tokens = tokens[:eos]                   # EOS ends the request (and the grammar)
        if tokens and not matcher.consume_tokens(tokens):
            logger.error("request %s: the grammar refused accepted tokens: %s", request_id,
                         matcher.get_error())

    def _eos_only(self, rows: int) -> torch.Tensor:
        import torch

        mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool)
        mask[:, list(self.eos_token_ids)] = True
        return mask
