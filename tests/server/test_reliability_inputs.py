"""Bad input gets a 400 naming its param (never a 500, a reset connection or a hang): lone UTF-16
surrogates in text, unsafe request ids; the API key scheme is case-insensitive; /health matches its
schema; an engine error on a non-streaming request carries the engine's message."""
from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from specserve.server.app import build_app
from specserve.server.settings import ServerSettings
from specserve.server.tokenizer import load_tokenizer

from conftest import MODEL, FakeEngine

SURROGATE = '"\\ud800x"'                       # a JSON escape that decodes to a lone surrogate


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


def client_for(tok, **settings):
    engine = FakeEngine(tok)
    app = build_app(engine, tok, ServerSettings(served_model_names=(MODEL,), **settings))
    return TestClient(app), engine


def post(client, path, raw_json: str):
    return client.post(path, content=raw_json, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "%s", "prompt": %s, "max_tokens": 2}' % (MODEL, SURROGATE),
     "prompt"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": %s}], '
     '"max_tokens": 2}' % (MODEL, SURROGATE), "messages"),
    ("/tokenize", '{"model": "%s", "prompt": %s}' % (MODEL, SURROGATE), "prompt"),
])
def test_lone_surrogates_are_a_400_naming_the_param(tok, path, body, param):
    client, engine = client_for(tok)
    reply = post(client, path, body)
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]
    assert not engine.submitted


@pytest.mark.parametrize("rid", ["abc\r\nX-Injected: 1", "a" * 10_000, "", "has space"])
def test_unsafe_request_ids_are_refused_before_any_work(tok, rid):
    client, engine = client_for(tok)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": rid}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "request_id"
    assert not engine.submitted
    ok = client.post("/v1/completions", json={**body, "request_id": "req-42_A.b"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "req-42_A.b"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_authorization_scheme_is_case_insensitive(tok, scheme):
    client, _ = client_for(tok, api_key="s3cret")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    ok = client.post("/v1/completions", json=body, headers={"Authorization": f"{scheme} s3cret"})
    assert ok.status_code == 200
    bad = client.post("/v1/completions", json=body, headers={"Authorization": f"{scheme} nope"})
    assert bad.status_code == 401
    other = client.post("/v1/completions", json=body, headers={"Authorization": "Basic s3cret"})
    assert other.status_code == 401


def test_health_and_ping_match_the_openapi_document(tok):
    client, _ = client_for(tok)
    spec = client.get("/openapi.json").json()
    for path in ("/health", "/ping"):
        reply = client.get(path)
        assert reply.status_code == 200 and reply.content == b""
        documented = spec["paths"][path]["get"]["responses"]["200"]
        assert "application/json" not in documented.get("content", {}), documented


def test_an_engine_error_is_reported_with_its_message_streaming_or_not(tok):
    client, engine = client_for(tok)
    engine.error_after = 1
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 500
    message = reply.json()["error"]["message"]
    assert "EngineRequestError" not in message and message
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert any(e.get("error", {}).get("message") == message for e in events), events


def test_a_503_carries_the_engines_drain_estimate_as_retry_after():
    from specserve.scheduler.messages import EngineOverloadedError
    from specserve.server.errors import map_engine_exception
    err = map_engine_exception(EngineOverloadedError("full", retry_after_s=42), retry_after_s=1)
    assert err.status == 503 and err.headers["Retry-After"] == "42"


class CountingTokenizer:
    """The real tokenizer, counting encode calls (a prompt refused by length is never tokenized)."""

    def __init__(self, tok):
        self._tok, self.encodes = tok, 0

    def encode(self, *args, **kwargs):
        self.encodes += 1
        return self._tok.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.mark.parametrize("path,field,param", [
    ("/v1/completions", "prompt", "prompt"), ("/tokenize", "prompt", "prompt"),
    ("/v1/chat/completions", "messages", "messages")])
def test_a_prompt_too_long_to_fit_is_refused_by_length_before_tokenizing(tok, path, field, param):
    """Issue 19 D3: 4 MB of text cannot fit 256 tokens of any entry of this vocabulary; it gets
    the context-length 400 without being tokenized (which took seconds on the event loop)."""
    counting = CountingTokenizer(tok)
    engine = FakeEngine(tok)
    client = TestClient(build_app(engine, counting, ServerSettings(served_model_names=(MODEL,))))
    text = "word " * 800_000
    body = {"model": MODEL, "max_tokens": 2}
    body[field] = text if field == "prompt" else [{"role": "user", "content": text}]
    reply = client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert err["param"] == param and "maximum context length" in err["message"]
    assert counting.encodes == 0 and not engine.submitted
    # a prompt the context can hold is still tokenized and served
    body[field] = "word " * 10 if field == "prompt" else [{"role": "user", "content": "hi"}]
    assert client.post(path, json=body).status_code == 200 and counting.encodes == 1


def test_truncated_prompts_are_not_refused_by_length(tok):
    client, engine = client_for(tok)
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 100_000,
                                                 "max_tokens": 2, "truncate_prompt_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert len(engine.submitted[0].prompt_token_ids) == 8


def test_a_request_past_the_deadline_fails_with_504_and_is_aborted(tok):
    """Issue 19 (3): --request-timeout fails a request still running at its deadline, streaming
    (in-band) or not, and aborts it in the engine (its KV blocks freed)."""
    engine = FakeEngine(tok, step_delay=0.05)
    settings = ServerSettings(served_model_names=(MODEL,), request_timeout_s=0.3)
    client = TestClient(build_app(engine, tok, settings))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 504, reply.text
    assert "--request-timeout" in reply.json()["error"]["message"]
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert any("--request-timeout" in e.get("error", {}).get("message", "") for e in events)
    assert any(e.get("choices") for e in events)             # tokens streamed before the deadline
    assert not engine.held()                                  # both were aborted
    quick = client.post("/v1/completions", json={**body, "max_tokens": 2})
    assert quick.status_code == 200
    with pytest.raises(ValueError, match="request-timeout"):
        ServerSettings(served_model_names=(MODEL,), request_timeout_s=0)


def test_the_soak_commands_bad_inputs_each_get_a_4xx(tok):
    """loadtests/soak.py sends these to a live server; here the same bodies meet the app."""
    from loadtests.soak import BAD_INPUTS
    engine = FakeEngine(tok)
    client = TestClient(build_app(engine, tok, ServerSettings(served_model_names=("smollm2",))))
    for name, raw in BAD_INPUTS:
        reply = post(client, "/v1/completions", raw)
        assert 400 <= reply.status_code < 500, (name, reply.status_code, reply.text)
    assert not engine.submitted
