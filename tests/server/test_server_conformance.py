"""Our JSON and SSE against the recorded vLLM 0.32-shaped examples in `recorded/` (see its README:
reconstructed from openai-api.md, not live captures). Compared: key order, value types, event order
and SSE framing; never the generated text."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

RECORDED = Path(__file__).parent / "recorded"
MESSAGES = [{"role": "user", "content": "Hi"}]


def shape(value):
    """Key order and JSON types, recursively (a list is described by its first element)."""
    if isinstance(value, dict):
        return [(key, shape(val)) for key, val in value.items()]
    if isinstance(value, list):
        return ["list", shape(value[0])] if value else ["list"]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "null" if value is None else type(value).__name__


def sse_events(text: str) -> list:
    """Strict framing: every event is exactly `data: <payload>\\n\\n`; the last one is [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-80:]
    events = text.split("\n\n")
    assert events[-1] == ""
    parsed = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        payload = event[len("data: "):]
        parsed.append(payload if payload == "[DONE]" else json.loads(payload))
    return parsed


def event_shapes(events: list) -> list:
    """Collapse runs of same-shaped events, so token counts do not matter, only the event order."""
    shapes = []
    for event in events:
        s = shape(event)
        if not shapes or shapes[-1] != s:
            shapes.append(s)
    return shapes


@pytest.mark.parametrize("recorded, path, body", [
    ("completion.json", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3}),
    ("completion_logprobs_echo.json", "/v1/completions",
     {"prompt": "The", "max_tokens": 1, "logprobs": 1, "echo": True}),
    ("chat.json", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
    ("chat_logprobs.json", "/v1/chat/completions",
     {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 1}),
])
def test_json_shapes(server, recorded, path, body):
    expected = json.loads((RECORDED / recorded).read_text())
    ours = httpx.post(server.url + path, json={"model": "fake-model", "temperature": 0, **body},
                      timeout=30).json()
    assert shape(ours) == shape(expected)


@pytest.mark.parametrize("recorded, path, body", [
    ("completion_stream_usage.sse", "/v1/completions", {"prompt": "The capital of France is"}),
    ("chat_stream_usage.sse", "/v1/chat/completions", {"messages": MESSAGES}),
])
def test_sse_shapes_and_order(server, recorded, path, body):
    expected = sse_events((RECORDED / recorded).read_text())
    r = httpx.post(server.url + path, timeout=30, json={
        "model": "fake-model", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0, **body})
    assert r.headers["content-type"].startswith("text/event-stream")
    ours = sse_events(r.text)
    assert event_shapes(ours) == event_shapes(expected)
    assert len({e["id"] for e in ours[:-1]}) == 1 and len({e["created"] for e in ours[:-1]}) == 1
    assert ours[-2]["choices"] == [] and "usage" in ours[-2]
    assert all("usage" not in e for e in ours[:-2])       # omitted on content chunks (vLLM 0.32)


def test_error_and_models_shapes(server):
    expected = json.loads((RECORDED / "error_400.json").read_text())
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "top_p": 0})
    assert r.status_code == 400 and r.json() == expected
    models = httpx.get(server.url + "/v1/models").json()
    assert shape(models) == shape(json.loads((RECORDED / "models.json").read_text()))


def test_no_empty_chunk_before_first_token(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 30, "stream": True, "temperature": 0})
    events = sse_events(r.text)[:-1]
    texts = [e["choices"][0]["text"] for e in events]
    assert all(texts[:-1]) and "\ufffd" not in "".join(texts)   # 世界 arrives whole
    assert "世界" in "".join(texts)
