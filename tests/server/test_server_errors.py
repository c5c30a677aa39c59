"""Every error row of openai-api.md §2.6 and §6 over raw HTTP: status, type, param and message."""
from __future__ import annotations

import httpx
import pytest
from conftest import MODEL, FakeEngine

from specserve.scheduler.messages import EngineOverloadedError


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def error_of(response) -> dict:
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == response.status_code
    return err


@pytest.mark.parametrize("body, param, message", [
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    ({"prompt": None}, "prompt", "prompt must be provided and non-empty."),
    ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0."),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0."),
    ({"n": 0}, "n", "n must be at least 1, got 0."),
    ({"logprobs": -1}, "logprobs", "`logprobs` must be a positive value or -1."),
    ({"logprobs": 21}, "logprobs", "logprobs must be at most 20, got 21."),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "prompt_logprobs is not available when stream=true."),
    ({"prompt": [70000]}, "prompt", "token id 70000 is out of vocabulary (size 49152)."),
    ({"temperature": "hot"}, "temperature", "1 validation error: temperature:"),
    ({"response_format": {"type": "xml"}}, "response_format",
     "response_format.type must be one of 'text', 'json_object', 'json_schema'; got 'xml'."),
    ({"priority": 1}, "priority", "priority is not supported by this server"),
    ({"guided_json": 5}, "guided_json", "guided_json must be a JSON schema object."),
    ({"guided_grammar": 5}, "guided_grammar", "guided_grammar must be a non-empty string."),
])
def test_validation_rows(server, body, param, message):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", **body})
    err = error_of(r)
    assert r.status_code == 400 and err["type"] == "BadRequestError"
    assert err["param"] == param and err["message"].startswith(message)


def test_context_length_rule(server):
    long_prompt = list(range(100, 600))                   # 500 tokens, max_model_len 512
    r = post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 16})
    err = error_of(r)
    assert err["param"] == "max_tokens" and err["message"] == (
        "This model's maximum context length is 512 tokens. However, you requested 516 tokens "
        "(500 in the messages, 16 in the completion). Please reduce the length of the messages or "
        "completion.")
    r = post(server, "/v1/completions", {"prompt": list(range(100, 612)), "max_tokens": 1})
    assert error_of(r)["param"] == "input_tokens"
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi " * 600}]})
    assert r.status_code == 400 and error_of(r)["param"] == "input_tokens"
    assert (post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 12}).status_code
            == 200)


def test_bad_json_wrong_content_type_unknown_fields(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["type"] == "BadRequestError"
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert error_of(r)["message"] == "Unsupported Media Type: Only 'application/json' is allowed"
    # curl -d (form content type) with a JSON body is read as JSON (the README's curl line)
    # (greedy, so the fake engine starts at the script's first words: a sampled start may land
    # inside a multi-byte character whose two tokens decode to no text yet)
    r = httpx.post(server.url + "/v1/completions",
                   content=b'{"prompt": "x", "max_tokens": 2, "temperature": 0}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": 3})
    assert r.status_code == 200


def test_routes_models_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and error_of(r)["type"] == "NotFoundError"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and error_of(r)["type"] == "MethodNotAllowed"
    r = post(server, "/v1/chat/completions",
             {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    err = error_of(r)
    assert (r.status_code == 404 and err["param"] == "model"
            and err["message"] == "The model `nope` does not exist.")


def test_chat_specific_refusals(server):
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    cases = [({"top_logprobs": 2}, "top_logprobs"),
             ({"tools": [{"type": "function"}]}, "tools.0"),
             ({"tool_choice": "auto"}, "tool_choice"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
              "messages.0.content"),
             ({"messages": []}, "messages"),
             ({"max_completion_tokens": 0}, "max_completion_tokens")]
    for extra, param in cases:
        r = post(server, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 400 and error_of(r)["param"] == param, (extra, r.text)
    ok = post(server, "/v1/chat/completions",
              {**base, "tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": "none"})
    assert ok.status_code == 200


def test_chat_template_errors_are_400(make_server, tokenizer):
    untrusted = post(make_server(), "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"})
    assert untrusted.status_code == 400 and error_of(untrusted)["param"] == "chat_template"
    assert "--trust-request-chat-template" in error_of(untrusted)["message"]
    no_template = make_server(chat_template=None, trust_request_chat_template=True)
    bad = post(no_template, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% if %}"})
    assert bad.status_code == 400 and error_of(bad)["param"] == "messages"
    raising = post(no_template, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "x"}],
                    "chat_template": "{{ raise_exception('no') }}"})
    assert raising.status_code == 400
    looping = post(no_template, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "x"}], "chat_template":
                    "{% for i in range(1000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}"})
    assert looping.status_code == 400 and error_of(looping)["param"] == "chat_template"
    assert "budget" in error_of(looping)["message"]
    ok = post(no_template, "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
               "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert ok.status_code == 200


def test_api_key_guards_v1_and_tokenize_only(make_server):
    s = make_server(api_key="sesame")
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        r = httpx.request(method, s.url + path, json={"prompt": "x"})
        assert r.status_code == 401 and error_of(r)["type"] == "AuthenticationError"
    r = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200
    r = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sesame2"})
    assert r.status_code == 401
    for path in ("/health", "/version", "/openapi.json", "/ping"):
        assert httpx.get(s.url + path).status_code == 200


def test_body_size_limit_refused_before_parsing(make_server):
    s = make_server(max_body_bytes=1000)
    r = post(s, "/v1/completions", {"prompt": "x" * 2000})
    assert r.status_code == 413 and error_of(r)["code"] == 413
    chunked = httpx.post(s.url + "/v1/completions",
                         content=iter([b'{"prompt": "', b"y" * 1500, b'"}']),
                         headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert s.engine.submitted == []


def test_overload_and_dead_engine(make_server, tokenizer):
    busy = make_server(FakeEngine(tokenizer, max_waiting=0))
    for stream in (False, True):
        r = post(busy, "/v1/completions", {"prompt": "x", "stream": stream})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert error_of(r)["type"] == "ServiceUnavailableError"
    lazy = FakeEngine(tokenizer)
    # raised from the iterator, not submit
    lazy.raise_on_first_step = EngineOverloadedError("full")
    r = post(make_server(lazy), "/v1/completions", {"prompt": "x", "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    dead_engine = FakeEngine(tokenizer)
    dead = make_server(dead_engine)
    assert httpx.get(dead.url + "/health").status_code == 200
    dead_engine.is_dead = True
    assert httpx.get(dead.url + "/health").status_code == 503
    assert post(dead, "/v1/completions", {"prompt": "x"}).status_code == 503


def test_error_after_stream_started_is_an_sse_event_then_done(make_server, tokenizer):
    engine = FakeEngine(tokenizer)
    engine.error_after = 3
    s = make_server(engine)
    # greedy: the fake starts its script at 0, so no EOS comes before the injected error
    r = post(s, "/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 10,
                                    "temperature": 0})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith('data: {"error":') and '"code":500' in events[-2]
    assert '"type":"InternalServerError"' in events[-2]
    assert engine.held() == set()
    r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 10, "temperature": 0})
    assert r.status_code == 500 and error_of(r)["type"] == "InternalServerError"
    # still up
    assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_request_id_header_echoed_and_used(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
             headers={"X-Request-Id": "abc123"})
    assert r.headers["x-request-id"] == "abc123" and r.json()["id"] == "cmpl-abc123"
    assert server.engine.submitted[-1].request_id.startswith("abc123-0-")
    r2 = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
              headers={"X-Request-Id": "abc123"})
    assert server.engine.submitted[-1].request_id != server.engine.submitted[-2].request_id
    assert r2.json()["id"] == "cmpl-abc123"
    r3 = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert r3.json()["id"] == "cmpl-" + r3.headers["x-request-id"]


def test_tokenize_detokenize_version(server, tokenizer):
    r = post(server, "/tokenize", {"prompt": "The capital of France is", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode("The capital of France is") and body["count"] == 5
    assert body["max_model_len"] == 512 and body["token_strs"][1] == "Ġcapital"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokenizer.decode(chat["tokens"]).endswith("<|im_start|>assistant\n")
    assert (post(server, "/detokenize", {"tokens": body["tokens"]}).json()
            == {"prompt": "The capital of France is"})
    assert post(server, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
