"""Structured output and tools at the HTTP edge, against the fake engine: which constraint reaches
the engine, the 400s naming the param, the prompt the tools add, and tool calls parsed from output
text into OpenAI's shapes, streamed and not (docs/structured-output.md)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import MODEL

from specserve.server.output_parsing import OutputParser, StreamDiffer
from specserve.server.tool_calls import parse_tools
from specserve.server.tool_parsers import HermesParser

ADD = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
ECHO = {"type": "function", "function": {"name": "echo"}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
        "temperature": 0}


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=30)


def error_param(response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


def last_constraint(server):
    return server.engine.submitted[-1].sampling_params.constraint


@pytest.mark.parametrize("body, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {
            "z": {"type": "string"}, "a": {"type": "integer"}}}}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"guided_json": '{"type": "string"}'}, "json_schema", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": True}}, "json_object",
     "structured_outputs.json_object"),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, "lark", "guided_grammar"),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "lark",
     "structured_outputs.grammar"),
])
def test_the_constraint_reaches_the_engine(server, body, kind, param):
    for path, base in (("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": 2})):
        assert post(server, path, {**base, **body}).status_code == 200
        c = last_constraint(server)
        assert (c.kind, c.param) == (kind, param)
    if kind == "json_schema" and param.startswith("response_format"):
        assert list(json.loads(c.spec)["properties"]) == ["z", "a"]     # property order kept
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                            "response_format": {"type": "text"}}).status_code == 200
    assert last_constraint(server) is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integr"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD, ADD]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_refusals_name_the_param(server, body, param):
    assert error_param(post(server, "/v1/chat/completions", {**CHAT, **body})) == param
    assert not server.engine.submitted


def test_required_and_named_tool_choice_constrain_to_calls(server):
    assert post(server, "/v1/chat/completions",
                {**CHAT, "tools": [ADD, ECHO], "tool_choice": "required"}).status_code == 200
    c = last_constraint(server)
    assert (c.kind, c.param) == ("tool_calls", "tools")
    assert json.loads(c.spec) == {"parallel": True, "tools": [
        {"name": "add", "parameters": ADD["function"]["parameters"]},
        {"name": "echo", "parameters": {"type": "object", "properties": {}}}]}
    named = {"type": "function", "function": {"name": "echo"}}
    assert post(server, "/v1/chat/completions",
                {**CHAT, "tools": [ADD, ECHO], "tool_choice": named}).status_code == 200
    assert json.loads(last_constraint(server).spec) == {"parallel": False, "tools": [
        {"name": "echo", "parameters": {"type": "object", "properties": {}}}]}
    post(server, "/v1/chat/completions", {**CHAT, "tools": [ADD]})     # auto: free text
    assert last_constraint(server) is None


def prompt_text(server, tokenizer):
    return tokenizer.decode(server.engine.submitted[-1].prompt_token_ids)


def test_tools_go_into_the_system_message_when_the_template_has_no_tool_section(server,
                                                                                  tokenizer):
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is 1 + 2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_9", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_9", "content": "3"}]
    assert post(server, "/v1/chat/completions",
                {**CHAT, "messages": history, "tools": [ADD]}).status_code == 200
    text = prompt_text(server, tokenizer)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI")
    assert json.dumps(ADD) in text
    assert CALL in text                                     # the earlier call, Hermes-style
    assert "<|im_start|>tool\n<tool_response>\n3\n</tool_response>" in text
    post(server, "/v1/chat/completions", {**CHAT, "tools": [ADD], "tool_choice": "none"})
    assert "<tools>" not in prompt_text(server, tokenizer)


def test_a_template_with_a_tool_section_renders_the_tools_itself(make_server, tokenizer):
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.a }}{% endif %}\n"
                "{% endfor %}")
    server = make_server(chat_template=template)
    history = [{"role": "user", "content": "add"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 7, "b": 2}'}}]}]
    assert post(server, "/v1/chat/completions",
                {**CHAT, "messages": history, "tools": [ADD, ECHO]}).status_code == 200
    text = prompt_text(server, tokenizer)
    # (HF renders templates with trim_blocks: no newline after a block tag)
    assert text.startswith("TOOLS:add;echo;user: addassistant: 7")   # arguments parsed
    assert "function calling AI" not in text


def scripted(make_server, tokenizer, text):
    server = make_server()
    server.engine.script_ids = tokenizer.encode(text, add_special_tokens=False)
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def streamed(client, **kw):
    calls, content, finish = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for c in delta.tool_calls or []:           # argument deltas: id and name come first
            if c.index not in calls:
                assert c.type == "function" and c.id.startswith("call_") and c.function.name
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content or None, finish


@pytest.mark.parametrize("text, content, names", [
    (CALL, None, ["add"]),
    ("Let me add.\n" + CALL + "\n" + CALL.replace('"a": 1', '"a": 5'), "Let me add.",
     ["add", "add"]),
    ("No tools needed <tool_ here.", "No tools needed <tool_ here.", []),
    ("<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>",
     "<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>", []),
])
def test_auto_tool_calls_are_parsed_the_same_streamed_or_not(make_server, tokenizer, text,
                                                              content, names):
    server, client = scripted(make_server, tokenizer, text)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "1+2?"}], tools=[ADD],
              max_tokens=200, temperature=0)
    out = client.chat.completions.create(**kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls or []]
    assert [name for name, _ in calls] == names and out.message.content == content
    assert out.finish_reason == ("tool_calls" if names else "stop")
    if names:
        assert json.loads(calls[0][1]) == {"a": 1, "b": 2}
        assert all(c.id.startswith("call_") and c.type == "function"
                   for c in out.message.tool_calls)
    assert streamed(client, **kw) == (calls, content, out.finish_reason)
    if len(names) == 2:                                     # parallel_tool_calls false: one
        one = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
        assert len(one.message.tool_calls) == 1


def test_parser_holds_back_partial_tags_at_every_split():
    req = parse_tools([ADD], "auto", None)
    text = "Sure.\n" + CALL + "\n"
    for cut in range(len(text) + 1):
        differ = StreamDiffer(OutputParser(HermesParser(req), None))
        a = differ.feed(text[:cut], final=False)
        b = differ.feed(text[cut:], final=True)
        assert a.get("content", "") + b.get("content", "") == "Sure."
        calls = a.get("tool_calls", []) + b.get("tool_calls", [])
        assert calls[0]["function"]["name"] == "add"
        assert "".join(c["function"].get("arguments", "") for c in calls) == '{"a": 1, "b": 2}'
        assert "<" not in a.get("content", "")


def test_grammar_compile_time_and_cache_hits_are_exported(make_engine):
    """Three requests under one schema through a real engine: one compile observed, two hits."""
    import types

    from prometheus_client.parser import text_string_to_metric_families

    from specserve.scheduler.messages import EngineRequest
    from specserve.server.metrics import ServerMetrics
    from specserve.server.settings import ServerSettings
    from specserve.spec_phases.sampling_params import Constraint, SamplingParams

    core = make_engine()
    metrics = ServerMetrics(types.SimpleNamespace(model_info=core.model_info,
                                                  engine_info=core.engine_info, on_step=None),
                            ServerSettings(served_model_names=("tiny",)))
    params = SamplingParams(max_tokens=4, temperature=0,
                            constraint=Constraint("regex", "[0-9]+"))
    for i in range(3):
        core.add_request(EngineRequest(f"m{i}", [5, 6, 7 + i], params))
    while core.has_work():
        step = core.step()
        if step.stats is not None:
            metrics.steps.record(step.stats)
    found = {s.name: s.value for f in text_string_to_metric_families(metrics.expose().decode())
             for s in f.samples}
    assert found["specserve:grammar_compile_seconds_count"] == 1
    assert found["specserve:grammar_compile_seconds_sum"] > 0
    assert found["specserve:grammar_cache_hits_total"] == 2


def test_the_guidance_reading_lets_objects_admit_unnamed_properties(make_server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {**CHAT, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    server = make_server(json_unnamed_properties=True)
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert json.loads(last_constraint(server).spec)["additionalProperties"] is True
    default = make_server()
    assert post(default, "/v1/chat/completions", body).status_code == 200
    assert json.loads(last_constraint(default).spec) == schema      # closed when compiled
