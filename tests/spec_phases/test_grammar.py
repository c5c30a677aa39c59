"""Structured output on the tiny model: the grammar mask on plain decoding and under speculation
(scheduler/structured_output.py compiles, spec_phases/grammar.py masks). Greedy text with a schema
is identical with speculation on and off for every drafter; sampling keeps the masked target
distribution; drafts the grammar forbids are cut and counted as drafted and rejected."""
import json
from collections import Counter

import jsonschema
import pytest

from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.scheduler.structured_output import check
from specserve.spec_phases.grammar import unpack_bitmask
from specserve.spec_phases.sampling_params import Constraint, ParamError, SamplingParams
from specserve.spec_phases.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "c"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "c": {"enum": ["red", "green"]}}}
DRAFTERS = {
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                               prompt_lookup_max=3),
    "token_recycling": SpeculativeConfig(method="token_recycling", num_speculative_tokens=4),
    "layer_skip": SpeculativeConfig(method="layer_skip", num_speculative_tokens=3,
                                    skip_layers=(1,)),
    "lossy_kv": SpeculativeConfig(method="lossy_kv", num_speculative_tokens=4,
                                  kv_compressor="quant",
                                  kv_compressor_config={"window": 8, "page_size": 8}),
    "ngram+frontiers": SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                                         prompt_lookup_min=1, prompt_lookup_max=3,
                                         frontier_size=2),
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


def run(core, requests):
    for rid, ids, params in requests:
        core.add_request(EngineRequest(rid, ids, params))
    out, reasons, totals = {}, {}, Counter()
    while core.has_work():
        step = core.step()
        for o in step.outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        if step.stats is not None:
            totals["drafted"] += step.stats.num_draft_tokens
            totals["accepted"] += step.stats.num_accepted_tokens
            totals["masked"] += step.stats.num_masked_tokens
            totals["compiles"] += len(step.stats.grammar_compile_s)
            totals["hits"] += step.stats.grammar_cache_hits
    core.check_integrity()
    return out, reasons, totals


def schema_requests(tok, temperature=0.0):
    examples = tok.encode('{"ok": true, "n": 12, "c": "red"} {"ok": false, "n": 7, "c": "green"} '
                          '{"ok": true, "n": 12, "c": "red"}')
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    prompts = [examples, examples[:6], [11, 12, 13, 14, 15] * 4, [400, 401, 402]]
    return [(f"s{i}", ids, SamplingParams(max_tokens=48, temperature=temperature, seed=i,
                                          constraint=constraint))
            for i, ids in enumerate(prompts)]


def test_greedy_with_a_schema_is_valid_json(make_engine, tok):
    out, reasons, totals = run(make_engine(), schema_requests(tok))
    for rid, ids in out.items():
        assert reasons[rid] == "stop"                        # the grammar ended with EOS
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)
    assert totals["compiles"] == 1 and totals["hits"] == 3   # one schema, compiled once


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_with_a_schema_is_identical_with_speculation(make_engine, tok, name):
    requests = schema_requests(tok)
    plain, _, _ = run(make_engine(), requests)
    spec, _, totals = run(make_engine(speculative=DRAFTERS[name]), requests)
    assert spec == plain
    assert totals["drafted"] > 0
    if name.startswith("ngram"):
        assert totals["accepted"] > 0


EIGHT = ' ", " '.join(["item"] * 8)
GRAMMARS = {  # vLLM's structured_outputs.grammar / guided_grammar: GBNF (EBNF) or Lark
    "gbnf": f'root ::= {EIGHT}\nitem ::= "red" | "green" | [0-9] [0-9]?',
    "lark": f'start: {EIGHT}\nitem: "red" | "green" | /[0-9][0-9]?/',
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_with_a_grammar_is_identical_with_speculation(make_engine, tok, name):
    prompt = tok.encode("red, 12, green, red, 12, green, red, 12")
    requests = [(f"{kind}{i}", ids, SamplingParams(max_tokens=40, temperature=0,
                                                  constraint=Constraint("lark", text)))
                for kind, text in GRAMMARS.items() for i, ids in enumerate((prompt, [5, 6, 7]))]
    plain, _, _ = run(make_engine(), requests)
    spec, _, totals = run(make_engine(speculative=DRAFTERS[name]), requests)
    assert spec == plain and totals["drafted"] > 0
    for rid, ids in plain.items():
        items = tok.decode(ids).removesuffix("<|im_end|>").split(", ")
        assert len(items) == 8, rid
        assert all(item in ("red", "green") or item.isdigit() for item in items), rid


def test_seeded_sampling_with_a_schema_is_identical_with_speculation(make_engine, tok):
    requests = schema_requests(tok, temperature=0.8)
    plain, _, _ = run(make_engine(), requests)
    spec, _, totals = run(make_engine(speculative=DRAFTERS["ngram"]), requests)
    assert spec == plain and totals["drafted"] > 0


def test_masked_sampling_keeps_the_target_distribution_under_speculation(make_engine, tok):
    """Two-sample chi-squared over the joint of the tokens sampled under a regex, speculation off
    vs drafts of the target's own unconstrained greedy continuation (layer_skip skipping no
    layer): the grammar cuts many of those drafts, the rest are accepted or rejected by the
    masked rows."""
    constraint = Constraint("regex", "[ab]{3}")
    params = SamplingParams(max_tokens=4, temperature=1.5, constraint=constraint)

    def joint(spec):
        requests = [(f"j{i}", [11, 12, 13, 14, 15] * 3, params) for i in range(600)]
        out, _, totals = run(make_engine(speculative=spec, max_num_seqs=128), requests)
        return Counter(tok.decode(ids) for ids in out.values()), totals

    plain, _ = joint(None)
    spec, totals = joint(SpeculativeConfig(method="layer_skip", num_speculative_tokens=2,
                                           skip_layers=()))
    assert totals["masked"] > 0 and totals["drafted"] > totals["accepted"]
    for text in plain:
        assert len(text.removesuffix("<|im_end|>")) == 3 and set(text[:3]) <= {"a", "b"}
    keys = sorted(set(plain) | set(spec))
    assert 2 <= len(keys) <= 8
    from scipy.stats import chi2_contingency
    assert chi2_contingency([[plain[k] for k in keys], [spec[k] for k in keys]]).pvalue > 0.001


def test_choice_and_regex_constraints(make_engine, tok):
    requests = [("c", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0, constraint=Constraint(
                    "choice", choices=("yes", "no", "maybe \"so\"")))),
                ("r", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0,
                                                constraint=Constraint("regex", r"\d{3}-\d{2}")))]
    out, reasons, _ = run(make_engine(), requests)
    assert tok.decode(out["c"][:-1]) in ("yes", "no", "maybe \"so\"")
    assert reasons["r"] == "stop"
    text = tok.decode(out["r"][:-1])
    assert len(text) == 6 and text[3] == "-" and (text[:3] + text[4:]).isdigit()


@pytest.mark.parametrize("constraint", [
    Constraint("json_schema", "{not json"),
    Constraint("json_schema", "[1, 2]"),
    Constraint("json_schema", json.dumps({"type": "strin"})),
    Constraint("regex", "(unclosed", param="guided_regex"),
    Constraint("lark", "start: undefined_rule"),
])
def test_bad_constraints_are_refused_naming_the_field(constraint):
    with pytest.raises(ParamError) as err:
        check(constraint)
    assert err.value.param == constraint.param


def test_constraint_is_plain_hashable_data():
    import pickle
    c = Constraint("choice", choices=["a", "b"])
    assert pickle.loads(pickle.dumps(c)) == c and hash(c) == hash(Constraint("choice",
                                                                             choices=("a", "b")))
    with pytest.raises(ParamError):
        Constraint("choice", choices=())
    with pytest.raises(ParamError):
        Constraint("xml")


def test_unpack_bitmask():
    import torch
    words = torch.tensor([[0b101, -1 << 31]], dtype=torch.int32)
    allowed = unpack_bitmask(words, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_boolean_schemas():
    check(Constraint("json_schema", "true"))                  # any JSON value
    with pytest.raises(ParamError, match="admits no value"):
        check(Constraint("json_schema", "false"))


def hold_compiles(core, gate):
    """The engine's grammar compiles wait for `gate`; returns the list each held compile appends
    whether the gate opened in time."""
    manager, released = core.grammars, []
    compile_now = manager._compile

    def held(constraint):
        released.append(gate.wait(10))
        return compile_now(constraint)

    manager._compile = held
    return released


def test_a_slow_compile_does_not_stall_other_requests(make_engine):
    """The engine admits a constrained request only once its grammar is compiled: a compile held
    until another request has finished must not hold that request's steps."""
    import threading

    core, gate = make_engine(), threading.Event()
    released = hold_compiles(core, gate)
    regex = Constraint("regex", "[0-9]+")
    core.add_request(EngineRequest("slow", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0,
                                                                     constraint=regex)))
    core.add_request(EngineRequest("free", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0,
                                                                     ignore_eos=True)))
    finished = []
    while core.has_work():
        for o in core.step().outputs:
            if o.finished:
                finished.append(o.request_id)
        if "free" in finished:
            gate.set()
    assert finished == ["free", "slow"] and released == [True]
    core.check_integrity()


def test_aborting_a_request_whose_grammar_is_compiling(make_engine):
    import threading

    core, gate = make_engine(), threading.Event()
    hold_compiles(core, gate)
    core.add_request(EngineRequest("a", [5, 6], SamplingParams(
        max_tokens=4, constraint=Constraint("regex", "x"))))
    assert core.has_unfinished()
    out = core.abort_request("a")
    assert out.finished and out.finish_reason == "abort" and not core.has_unfinished()
    gate.set()
    core.check_integrity()


def test_an_uncompilable_constraint_reaching_the_engine_fails_the_request(make_engine):
    """The server refuses these with a 400; an engine-only caller gets the request finished with
    the compile's error at once, not a hang, and the other requests run."""
    core = make_engine()
    bad = SamplingParams(max_tokens=8, temperature=0, constraint=Constraint("regex", "(unclosed"))
    ok = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    core.add_request(EngineRequest("bad", [5, 6, 7], bad))
    core.add_request(EngineRequest("ok", [5, 6, 7], ok))
    outputs = core.run_until_idle()
    failed = [o for o in outputs if o.request_id == "bad"]
    assert len(failed) == 1 and failed[0].finished and failed[0].finish_reason == "error"
    assert failed[0].new_token_ids == [] and "cannot be compiled" in failed[0].error
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "ok") == 3
    core.check_integrity()


def test_tool_calls_constraint_makes_one_valid_call(make_engine, tok):
    params = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                             "b": {"type": "boolean"}}}
    spec = json.dumps({"tools": [{"name": "f", "parameters": params}], "parallel": False})
    constraint = Constraint("tool_calls", spec, param="tools")
    check(constraint)
    out, reasons, _ = run(make_engine(), [("t", [5, 6, 7], SamplingParams(
        max_tokens=40, temperature=0, constraint=constraint))])
    text = tok.decode(out["t"][:-1])
    assert reasons["t"] == "stop" and text.startswith("<tool_call>\n")
    assert text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "f"
    jsonschema.validate(call["arguments"], params)
