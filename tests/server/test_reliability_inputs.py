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
