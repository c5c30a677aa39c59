"""Structured output, the engine's side: each constraint compiled once, beside the scheduler.

    Constraint (plain text, in SamplingParams) --compile, cached by value--> grammar text
    (llguidance's own grammar, validated) --in the plan, once per request--> the worker's matcher

As vLLM's EngineCore owns its structured-output manager, the engine owns `GrammarManager`: it
compiles on its own thread, holds a constrained request until its grammar is compiled (a slow
compile never stalls the steps of other requests), finishes the request with an error when the
grammar does not compile, and puts the compiled grammar into the plan the first time the request
is scheduled (`StepPlan.grammars`). The worker builds the request's matcher from that text
(milliseconds: llguidance computes masks lazily) and masks its rows (`spec_phases/grammar.py`):
drafts are made inside the worker's step, so the masks of draft rows can only be made there.

The library is llguidance (docs/structured-output.md says why). The server calls `check`, the same
compile, before it submits, so a malformed constraint is a 400 naming its field.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from specserve.scheduler.request import Request
from specserve.spec_phases.plan import RequestGrammar, StepPlan
from specserve.spec_phases.sampling_params import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Constraint,
                                                   ParamError)

MAX_CACHED = 256                        # compiled constraints kept (least recently used dropped)

# JSON output with the separators json.dumps writes and no other whitespace: a small model left a
# free choice of whitespace can emit newlines forever, and one canonical spelling keeps greedy text
# stable.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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


def compile_grammar(constraint: Constraint) -> str:
    """The constraint's llguidance grammar, validated; ParamError naming the field when the
    constraint is malformed or uses what the library cannot compile (an unknown keyword, a bad
    regex, a grammar over its size limits)."""
    import llguidance

    text = grammar_text(constraint)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ParamError(constraint.param, f"the {constraint.kind} cannot be compiled: {error}")
    return text


def check(constraint: Constraint) -> None:
    """`compile_grammar` for its errors only (the server, before it submits)."""
    compile_grammar(constraint)


class GrammarManager:
    """Compiled constraints (cached by value, compiled on one thread), the constrained requests
    waiting for theirs, and the compiled grammars of admitted requests not yet sent to the
    worker. Counts compile seconds and cache hits for the step's stats."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-grammar")
        self._compiled: OrderedDict[Constraint, Future] = OrderedDict()
        self._lock = threading.Lock()            # compile_times is appended on the pool thread
        self._waiting: list[tuple[Future, Request]] = []      # compiling, in arrival order
        self._unsent: dict[str, str] = {}        # admitted request id -> its grammar text
        self.compile_times: list[float] = []     # seconds per compile since the last drain
        self.cache_hits = 0                      # requests that found their constraint's compile

    # -- compile -----------------------------------------------------------------------------
    def _compile(self, constraint: Constraint) -> str:
        start = time.perf_counter()
        try:
            return compile_grammar(constraint)
        finally:
            with self._lock:
                self.compile_times.append(time.perf_counter() - start)

    def _future(self, constraint: Constraint) -> Future:
        future = self._compiled.get(constraint)
        if future is None:
            future = self._pool.submit(self._compile, constraint)
            self._compiled[constraint] = future
            while len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        else:
            self.cache_hits += 1
        self._compiled.move_to_end(constraint)
        return future

    def drain_stats(self) -> tuple[list[float], int]:
        with self._lock:
            out = (self.compile_times, self.cache_hits)
            self.compile_times, self.cache_hits = [], 0
        return out

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: Request, constraint: Constraint) -> bool:
        """Start (or find) the request's compile: True when it is compiled and the request may be
        scheduled now, False when it waits here (`take_compiled` hands it over later)."""
        future = self._future(constraint)
        if future.done() and future.exception() is None:
            self._unsent[request.request_id] = future.result()
            return True
        self._waiting.append((future, request))
        return False

    def is_waiting(self, request_id: str) -> bool:
        return any(r.request_id == request_id for _, r in self._waiting)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request still waiting for its compile (None when it is not waiting)."""
        for i, (_, request) in enumerate(self._waiting):
            if request.request_id == request_id:
                del self._waiting[i]
                return request
        return None

    def take_compiled(self, block: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile finished, in arrival order: those to schedule, and those whose
        grammar did not compile with the reason. block: wait a little for one (nothing else to
        run)."""
        if not self._waiting:
            return [], []
        if block:
            wait([f for f, _ in self._waiting], timeout=0.05, return_when=FIRST_COMPLETED)
        ready, failed, still = [], [], []
        for future, request in self._waiting:
            if not future.done():
                still.append((future, request))
            elif (exc := future.exception()) is not None:
                failed.append((request, exc.message if isinstance(exc, ParamError) else str(exc)))
            else:
                self._unsent[request.request_id] = future.result()
                ready.append(request)
        self._waiting = still
        return ready, failed

    def attach(self, plan: StepPlan) -> StepPlan:
        """The plan with the grammars of requests it schedules for the first time; the worker
        keeps each request's matcher until the request is finished (`StepPlan.finished_ids`)."""
        for request_id in plan.finished_ids:       # finished before it was first scheduled
            self._unsent.pop(request_id, None)
        if not self._unsent:
            return plan
        new = tuple(RequestGrammar(r.request_id, self._unsent.pop(r.request_id))
                    for r in plan.requests if r.request_id in self._unsent)
        return dataclasses.replace(plan, grammars=new) if new else plan

    def check_integrity(self, live_ids: set[str]) -> None:
        """Grammars wait to be sent only for live requests."""
        stale = set(self._unsent) - live_ids
        if stale:
            raise AssertionError(f"grammars kept for requests no longer live: {stale}")
