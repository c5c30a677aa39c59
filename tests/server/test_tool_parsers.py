"""Tool-call parsers (`--tool-call-parser`) and reasoning parsers (`--reasoning-parser`): every
format's calls read from output text, streamed as OpenAI argument deltas whose joined text equals
the non-streamed call, at every split of the text; then through the official `openai` client
against a server around tiny checkpoints the tests build (the SmolLM2 tokenizer saved with each
family's chat template; a scripted fake engine writes the output), streamed == non-streamed.

The templates below are abridged from each family's published chat template: the part that
renders `tools` and the call syntax its model writes."""
from __future__ import annotations

import json

import openai
import pytest
from conftest import MODEL, FakeEngine, LiveServer

from specserve.server.app import build_app
from specserve.server.output_parsing import REASONING_PARSERS, OutputParser, StreamDiffer
from specserve.server.settings import ServerSettings
from specserve.server.tool_calls import parse_tools
from specserve.server.tool_parsers import TOOL_PARSERS, convert_value
from specserve.spec_phases.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
TOOLS = [WEATHER, ADD]
PARIS = {"city": "Paris \"centre\", {x}", "days": 3}
SUM = {"a": 1, "b": -2.5}

# each format: output text with two calls -> (content, calls)
OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               + json.dumps(PARIS) + '}\n</tool_call>\n<tool_call>\n{"name": "add", '
               '"arguments": {"a": 1, "b": -2.5}}\n</tool_call>', "Let me check."),
    "llama3_json": ('{"name": "get_weather", "parameters": ' + json.dumps(PARIS)
                    + '}; {"name": "add", "parameters": {"a": 1, "b": -2.5}}', None),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(PARIS)
                + '}, {"name": "add", "arguments": {"a": 1, "b": -2.5}}]', "Sure."),
    "qwen3_xml": ("I will call.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                  "Paris \"centre\", {x}\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n"
                  "</parameter>\n<parameter=b>\n-2.5\n</parameter>\n</function>\n</tool_call>",
                  "I will call."),
    "pythonic": ('[get_weather(city="Paris \\"centre\\", {x}", days=3), add(a=1, b=-2.5)]',
                 None),
}
EXPECTED_CALLS = [("get_weather", PARIS), ("add", SUM)]


def stream_all(parser: OutputParser, text: str, cuts: list[int]) -> tuple:
    """Feed the text in pieces cut at `cuts`; -> (content, reasoning, [(name, arguments)]) as an
    OpenAI client accumulates the deltas."""
    differ, content, reasoning, calls = StreamDiffer(parser), "", "", {}
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    for i, piece in enumerate(pieces):
        delta = differ.feed(piece, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            name, args = calls.get(call["index"], ("", ""))
            if "id" in call:
                assert call["id"].startswith("call_") and call["type"] == "function"
            fn = call.get("function", {})
            calls[call["index"]] = (name + fn.get("name", ""), args + fn.get("arguments", ""))
    return content, reasoning, [calls[i] for i in sorted(calls)]


def whole(parser: OutputParser, text: str) -> tuple:
    content, reasoning, calls = parser.message(text)
    return content or "", reasoning or "", calls


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_each_format_streams_at_every_split_as_it_parses_whole(name):
    text, content = OUTPUTS[name]
    parser = OutputParser(TOOL_PARSERS[name](parse_tools(TOOLS, "auto", None)), None)
    out_content, _, calls = parser.message(text)
    assert out_content == content
    assert [(n, json.loads(a)) for n, a in calls] == EXPECTED_CALLS
    expected = whole(parser, text)
    for cut in range(len(text) + 1):
        assert stream_all(parser, text, [cut]) == expected, cut
    assert stream_all(parser, text, list(range(1, len(text)))) == expected   # one char at a time


def test_arguments_stream_before_the_call_is_finished():
    parser = OutputParser(TOOL_PARSERS["hermes"](parse_tools(TOOLS, "auto", None)), None)
    differ = StreamDiffer(parser)
    first = differ.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                        final=False)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather",
                                                  "arguments": '{"city": "Par'}
    more = differ.feed('is", "days": 1', final=False)
    assert more["tool_calls"] == [{"index": 0, "function": {"arguments": 'is'}}]
    last = differ.feed("2}}\n</tool_call>", final=True)     # 1 became 12: sent only when known
    assert last["tool_calls"] == [{"index": 0, "function": {"arguments": '", "days": 12}'}}]


@pytest.mark.parametrize("name, text", [
    ("hermes", 'No call <tool_ here.'),
    ("hermes", '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'),
    ("llama3_json", 'The answer is {"name": "add"}.'),
    ("llama3_json", '{"name": "unknown", "parameters": {}}'),
    ("mistral", "Plain [TOOL_ text."),
    ("qwen3_xml", "<function=unknown>\n</function>"),
    ("pythonic", "[1, 2, 3] is a list."),
    ("pythonic", "Just words."),
])
def test_text_that_is_no_call_of_a_known_function_stays_content(name, text):
    parser = OutputParser(TOOL_PARSERS[name](parse_tools(TOOLS, "auto", None)), None)
    assert parser.message(text) == (text, None, [])
    for cut in range(len(text) + 1):
        assert stream_all(parser, text, [cut]) == (text, "", [])


def test_an_unfinished_call_at_the_length_limit_keeps_what_was_written():
    parser = OutputParser(TOOL_PARSERS["hermes"](parse_tools(TOOLS, "auto", None)), None)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2'
    assert parser.message(text) == (None, None, [("add", '{"a": 1}')])
    for cut in range(len(text) + 1):
        assert stream_all(parser, text, [cut]) == ("", "", [("add", '{"a": 1}')])


def test_a_call_whose_json_goes_wrong_keeps_what_streamed_before():
    parser = OutputParser(TOOL_PARSERS["hermes"](parse_tools(TOOLS, "auto", None)), None)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2,, "c"}}\n</tool_call>'
    content, _, calls = parser.message(text)
    assert (content, calls) == (None, [("add", '{"a": 1, "b": 2}')])
    for cut in range(len(text) + 1):
        assert stream_all(parser, text, [cut]) == ("", "", calls), cut


def test_parallel_tool_calls_false_keeps_the_first_call():
    text, _ = OUTPUTS["llama3_json"]
    parser = OutputParser(TOOL_PARSERS["llama3_json"](parse_tools(TOOLS, "auto", False)), None)
    assert [n for n, _ in parser.message(text)[2]] == ["get_weather"]


@pytest.mark.parametrize("raw, schema, value", [
    ("\n12\n", {"type": "integer"}, 12), ("2.5", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3), ("True", {"type": "boolean"}, True),
    ('\n{"x": [1]}\n', {"type": "object"}, {"x": [1]}), ("\n12\n", {"type": "string"}, "12"),
    ("twelve", {"type": "integer"}, "twelve"), ("null", {"type": ["integer", "null"]}, None),
    ("free", None, "free"),
])
def test_qwen3_xml_values_follow_the_parameter_schema(raw, schema, value):
    assert convert_value(raw, schema) == value


# -- reasoning -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, prompt, text, content, reasoning", [
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Two and two.\n</think>\n\nFour.", "Four.",
     "Two and two."),
    ("deepseek_r1", "", "<think>Hmm.</think>Four.", "Four.", "Hmm."),
    ("deepseek_r1", "", "Still thinking", None, "Still thinking"),      # cut off: all reasoning
    ("qwen3", "<|im_start|>assistant\n", "<think>\nSum.\n</think>\n\nFour.", "Four.", "Sum."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Sum.\n</think>\n\nFour.", "Four.", "Sum."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Four.", "Four.", None),
    ("qwen3", "<|im_start|>assistant\n", "Four, no <think> here.", "Four, no <think> here.",
     None),
])
def test_reasoning_is_split_from_content_streamed_and_not(name, prompt, text, content,
                                                          reasoning):
    parser = OutputParser(None, REASONING_PARSERS[name](prompt))
    assert parser.message(text) == (content, reasoning, [])
    for cut in range(len(text) + 1):
        assert stream_all(parser, text, [cut]) == (content or "", reasoning or "", [])


def test_reasoning_then_a_tool_call():
    text = "<think>Need weather.</think>\n" + OUTPUTS["hermes"][0]
    parser = OutputParser(TOOL_PARSERS["hermes"](parse_tools(TOOLS, "auto", None)),
                          REASONING_PARSERS["qwen3"](""))
    content, reasoning, calls = parser.message(text)
    assert (content, reasoning, len(calls)) == ("Let me check.", "Need weather.", 2)
    for cut in range(0, len(text) + 1, 3):
        assert stream_all(parser, text, [cut]) == whole(parser, text)


# -- through the openai client, against tiny checkpoints -------------------------------------
HERMES_TEMPLATE = (  # Qwen2.5
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = (  # Llama 3.1 / 3.2, tools in the first user message
    "<|begin_of_text|>{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "\n\n{%- if loop.first and tools %}Given the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.{% for t in tools %}\n\n{{ t | tojson(indent=4) }}{% endfor %}\n\n"
    "{% endif %}{{ m.content }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (  # Mistral v3 (7B Instruct v0.3)
    "{{ bos_token }}{%- for m in messages %}{%- if loop.last and tools %}[AVAILABLE_TOOLS] "
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{%- if m.role == 'user' %}[INST] "
    "{{ m.content }}[/INST]{%- else %}{{ m.content }}{{ eos_token }}{% endif %}{%- endfor %}")
QWEN3_CODER_TEMPLATE = (  # Qwen3-Coder
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:"
    "\n\n<tools>{% for t in tools %}\n<function>\n<name>{{ t.function.name }}</name>\n"
    "<parameters>{% for k, v in t.function.parameters.properties.items() %}\n<parameter>\n"
    "<name>{{ k }}</name>\n<type>{{ v.type }}</type>\n</parameter>{% endfor %}\n</parameters>\n"
    "</function>{% endfor %}\n</tools>\n\nIf you choose to call a function ONLY reply in the "
    "following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{%- endif %}{%- for m in messages %}\n<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>{% endfor %}{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}")
PYTHONIC_TEMPLATE = (  # Llama 3.2 pythonic / Llama 4
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou are an expert in composing "
    "functions. If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
    "\n\n{{ tools | tojson }}<|eot_id|>{% endif %}{%- for m in messages %}<|start_header_id|>"
    "{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE,
             "mistral": MISTRAL_TEMPLATE, "qwen3_xml": QWEN3_CODER_TEMPLATE,
             "pythonic": PYTHONIC_TEMPLATE}
# tokenizer_config.json's response_template, as transformers' serving falls back to for Qwen2
QWEN2_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>",
                       "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"}}}


def tiny_checkpoint(folder, template: str, special: tuple[str, ...] = (),
                    response_template: dict | None = None):
    """A tokenizer folder: the SmolLM2 tokenizer with this chat template (and special tokens)."""
    tokenizer = load_tokenizer(None)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    if response_template is not None:
        config["response_template"] = response_template
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "model_type": "llama"}))
    return load_tokenizer(folder)


@pytest.fixture
def serve_checkpoint(tmp_path):
    servers = []

    def start(template: str, output: str, special: tuple[str, ...] = (),
              response_template: dict | None = None, **settings):
        tokenizer = tiny_checkpoint(tmp_path / f"ckpt{len(servers)}", template, special,
                                    response_template)
        engine = FakeEngine(tokenizer, max_model_len=4096)
        engine.script_ids = tokenizer.encode(output, add_special_tokens=False)
        app = build_app(engine, tokenizer, ServerSettings(
            served_model_names=(MODEL,), sse_keepalive_s=0, **settings))
        server = LiveServer(app).__enter__()
        server.engine, server.tokenizer = engine, tokenizer
        servers.append(server)
        return server, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def client_stream(client, **kw) -> tuple:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning_content") or ""
        for c in delta.tool_calls or []:
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return content or None, reasoning or None, [calls[i] for i in sorted(calls)], finish


def client_whole(client, **kw) -> tuple:
    choice = client.chat.completions.create(**kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    extra = choice.message.model_extra or {}
    reasoning = extra.get("reasoning_content")
    assert extra.get("reasoning") == reasoning
    return choice.message.content, reasoning, calls, choice.finish_reason


CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS, max_tokens=400, temperature=0)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_parser_through_the_openai_client(serve_checkpoint, name):
    text, content = OUTPUTS[name]
    special = ("[TOOL_CALLS]",) if name == "mistral" else ()   # a control token, as in Mistral's
    server, client = serve_checkpoint(TEMPLATES[name], text, special, tool_call_parser=name)
    out = client_whole(client, **CHAT)
    assert out[0] == content and out[3] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in out[2]] == EXPECTED_CALLS
    assert client_stream(client, **CHAT) == out
    prompt = server.tokenizer.decode(server.engine.submitted[-1].prompt_token_ids)
    assert "get_weather" in prompt and "function calling AI" not in prompt   # template's own


def test_the_response_template_parser_streams_at_every_split():
    import types

    text = "<think>Paris, then.</think>\n" + OUTPUTS["hermes"][0]
    tokenizer = types.SimpleNamespace(response_template=QWEN2_RESPONSE_TEMPLATE)
    parser = OutputParser(TOOL_PARSERS["transformers"](parse_tools(TOOLS, "auto", None),
                                                       tokenizer, "<|im_start|>assistant\n"),
                          None)
    content, reasoning, calls = parser.message(text)
    assert (content, reasoning) == ("Let me check.", "Paris, then.")
    assert [(n, json.loads(a)) for n, a in calls] == EXPECTED_CALLS
    for cut in range(len(text) + 1):
        assert stream_all(parser, text, [cut]) == whole(parser, text), cut
    assert stream_all(parser, text, list(range(1, len(text)))) == whole(parser, text)


def test_the_checkpoints_response_template_parses_by_default(serve_checkpoint):
    text = "<think>Paris, then.</think>\n" + OUTPUTS["hermes"][0]
    server, client = serve_checkpoint(HERMES_TEMPLATE, text,
                                      response_template=QWEN2_RESPONSE_TEMPLATE)
    out = client_whole(client, **CHAT)
    assert out[0] == "Let me check." and out[3] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in out[2]] == EXPECTED_CALLS
    assert client_stream(client, **CHAT) == out


def test_reasoning_content_through_the_openai_client(serve_checkpoint):
    template = HERMES_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                       "<|im_start|>assistant\n<think>\n{% endif %}")
    server, client = serve_checkpoint(template, "Two plus two.\n</think>\n\nFour.",
                                      reasoning_parser="qwen3")
    kw = dict(CHAT, tools=None)
    kw.pop("tools")
    out = client_whole(client, **kw)
    assert out == ("Four.", "Two plus two.", [], "stop")
    assert client_stream(client, **kw) == out


def test_auto_tool_choice_needs_the_flag_when_a_parser_is_named(serve_checkpoint):
    _, client = serve_checkpoint(HERMES_TEMPLATE, OUTPUTS["hermes"][0],
                                 tool_call_parser="hermes", auto_tool_choice=False)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(**CHAT)
    named = client.chat.completions.create(**CHAT, tool_choice="required")     # constrained
    assert [c.function.name for c in named.choices[0].message.tool_calls] == \
        ["get_weather", "add"]


def test_enable_thinking_reaches_the_template(serve_checkpoint):
    """chat_template_kwargs go to the template: Qwen3's closes an empty thinking block in the
    prompt when thinking is off, and the qwen3 parser then reads the output as content."""
    template = HERMES_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}")
    server, client = serve_checkpoint(template, "Four.", reasoning_parser="qwen3")
    kw = dict(CHAT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    kw.pop("tools")
    assert client_whole(client, **kw) == ("Four.", None, [], "stop")
    prompt = server.tokenizer.decode(server.engine.submitted[-1].prompt_token_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_the_vllm_tool_calling_launch_line_serves(tmp_path, wait_healthy):
    """`specserve serve tiny-random --enable-auto-tool-choice --tool-call-parser hermes
    --reasoning-parser qwen3` starts, and a `required` call on the real engine (random weights,
    the grammar makes it a call) comes back the same streamed and whole."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.server", "serve", "tiny-random", "--port", str(port),
             "--host", "127.0.0.1", "--engine-in-thread", "--max-model-len", "512",
             "--kv-cache-memory-gb", "0.02", "--num-threads", "1", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
            stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny-random", messages=[{"role": "user", "content": "1 + 2?"}],
                  tools=[ADD], tool_choice="required", max_tokens=60, temperature=0)
        out = client_whole(client, **kw)
        assert out[2] and out[2][0][0] == "add", out
        assert client_stream(client, **kw) == out
    finally:
        proc.terminate()
        proc.wait(60)
