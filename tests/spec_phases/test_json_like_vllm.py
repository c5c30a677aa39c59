"""JSON schemas read as vLLM's default grammar reads them (scheduler/structured_output.py:
vllm_json_schema): objects naming `properties` without `additionalProperties` admit no other
property, and numbers are bounded, so a small model cannot write keys or digits until max_tokens.
Checked with llguidance on the embedded model's tokenizer: which texts the grammar admits."""
from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from specserve.scheduler.structured_output import grammar_text, vllm_json_schema
from specserve.spec_phases.sampling_params import Constraint
from specserve.spec_phases.tokenizer import load_tokenizer

CITY = {"title": "City", "type": "object", "required": ["name", "population_millions"],
        "properties": {"name": {"type": "string", "title": "Name"},
                       "population_millions": {"type": "number"},
                       "rank": {"type": "integer"},
                       "nested": {"$ref": "#/$defs/Inner"}},
        "$defs": {"Inner": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def admits():
    tokenizer = load_tokenizer(None)
    llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def check(constraint: Constraint, text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, grammar_text(constraint), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and \
            matcher.is_accepting()
    return check


def schema(s: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(s), param="response_format")


@pytest.mark.parametrize("text, ok", [
    ('{"name": "Paris", "population_millions": 2.1}', True),
    ('{"name": "Paris", "population_millions": 2.1, "rank": 1, "nested": {"x": 3}}', True),
    ('{"name": "Paris", "population_millions": 2.1, "capital": true}', False),   # unnamed key
    ('{"name": "Paris", "population_millions": 2.1, "nested": {"x": 3, "y": 1}}', False),
    ('{"name": "Paris", "population_millions": 31111111111111111111}', False),   # too many digits
    ('{"name": "Paris", "population_millions": 0.33333333333333333333}', False),  # too precise
    ('{"name": "Paris", "population_millions": 999999999999999}', True),
    ('{"name": "Paris", "population_millions": 0.0000000001}', True),
    ('{"name": "Paris", "population_millions": 1, "rank": 9007199254740992}', True),   # 2**53
    ('{"name": "Paris", "population_millions": 1, "rank": 9007199254740993}', False),
])
def test_unnamed_properties_are_forbidden_and_numbers_bounded(admits, text, ok):
    assert admits(schema(CITY), text) is ok


def test_a_schemas_own_choices_are_kept(admits):
    permissive = {**CITY, "additionalProperties": True}
    assert admits(schema(permissive), '{"name": "P", "population_millions": 1, "capital": true}')
    big = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10 ** 18}}}
    assert admits(schema(big), '{"n": 100000000000000000}')
    assert not admits(schema(big), '{"n": -100000000000000000}')        # our lower bound
    assert admits(Constraint("json_object", ""), '{"any": 1, "thing": [true]}')


def test_all_of_branches_stay_open():
    s = {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                   {"properties": {"b": {"type": "string"}}}]}
    out = vllm_json_schema(s)
    assert all("additionalProperties" not in branch for branch in out["allOf"])
    assert vllm_json_schema({"type": "object", "properties": {"enum": {"enum": [1]}}})[
        "properties"]["enum"] == {"enum": [1]}


def test_the_guidance_reading_admits_unnamed_properties_with_numbers_still_bounded(admits):
    opened = schema(vllm_json_schema(CITY, unnamed=True))
    assert admits(opened, '{"name": "P", "population_millions": 1, "capital": true}')
    assert admits(opened, '{"name": "P", "population_millions": 1, "nested": {"x": 1, "y": 2}}')
    assert not admits(opened, '{"name": "P", "population_millions": 31111111111111111111}')
