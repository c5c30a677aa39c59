"""`usage.speculative`: the per-response speculative-decoding extension of the usage object.

Exact arithmetic against a fake engine that reports known per-request counters; presence and
consistency against the real engine on the tiny model, with speculation on and off."""
from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest
from conftest import MODEL, FakeEngine
from specserve.scheduler.async_engine import AsyncEngine
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.messages import SpecStats
from specserve.server.app import build_app
from specserve.server.settings import ServerSettings
from specserve.server.tokenizer import load_tokenizer
from starlette.testclient import TestClient

STANDARD = {"prompt_tokens", "completion_tokens", "total_tokens"}


class SpeculatingFake(FakeEngine):
    """After its j-th output a request reports j drafts of 3 tokens with 2 accepted each, the way
    the engine reports cumulative SpecStats on every output."""

    async def _generate(self, request):
        steps = 0
        async for out in super()._generate(request):
            steps += 1
            yield dataclasses.replace(out,
                                      spec=SpecStats(steps, 3 * steps, 2 * steps, (steps, steps)))


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def expected(num_outputs: int) -> dict:
    return {"num_drafts": num_outputs, "draft_tokens": 3 * num_outputs,
            "accepted_tokens": 2 * num_outputs,
            "acceptance_rate": 2 / 3, "mean_draft_length": 3.0}


def test_completion_usage_sums_the_choices(make_server, tokenizer):
    server = make_server(SpeculatingFake(tokenizer))
    out = client(server).completions.create(model=MODEL, prompt=["a", "b b"], n=2, max_tokens=4,
                                            temperature=0)
    assert out.usage.prompt_tokens == 1 + 2 and out.usage.completion_tokens == 16
    assert out.usage.total_tokens == 19                   # the standard fields parse as before
    spec = out.usage.model_extra["speculative"]
    assert spec == pytest.approx(expected(4 * 4))         # 4 choices x 4 one-token outputs


def test_chat_usage_and_streamed_final_usage_chunk(make_server, tokenizer):
    server = make_server(SpeculatingFake(tokenizer))
    c = client(server)
    messages = [{"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                     n=2)
    assert chat.usage.completion_tokens == 6
    assert chat.usage.model_extra["speculative"] == pytest.approx(expected(2 * 3))
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                            temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 5
    assert final.usage.model_extra["speculative"] == pytest.approx(expected(5))
    assert all(ch.usage is None for ch in chunks[:-1])    # only the usage chunk carries usage
    streamed = list(c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0,
                                         stream=True,
                                         stream_options={"include_usage": True}))
    assert streamed[-1].usage.model_extra["speculative"] == pytest.approx(expected(2))


def test_continuous_usage_chunks_carry_the_running_counters(make_server, tokenizer):
    server = make_server(SpeculatingFake(tokenizer))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    usages = [e["usage"] for e in events(reply.text) if e.get("usage")]
    drafted = [u["speculative"]["num_drafts"] for u in usages]
    assert drafted == sorted(drafted) and drafted[-1] == 3
    assert usages[-1]["speculative"] == pytest.approx(expected(3))


def test_no_extension_without_speculation(make_server, fake_engine):
    server = make_server(fake_engine)
    c = client(server)
    out = c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert "speculative" not in (out.usage.model_extra or {})
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=2)
    assert "speculative" not in (chat.usage.model_extra or {})
    chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}))
    assert set(chunks[-1].usage.model_dump(exclude_none=True)) == STANDARD


# -- the real engine
# --------------------------------------------------------------------------------
def serve(spec):
    engine = AsyncEngine(EngineConfig(model="tiny-random", max_model_len=256, num_kv_blocks=64,
                                      num_threads=1,
                                      speculative=spec))
    settings = ServerSettings(served_model_names=("tiny",), sse_keepalive_s=0)
    return engine, TestClient(build_app(engine, load_tokenizer("tiny-random"), settings))


@pytest.fixture(scope="module")
def spec_server():
    engine, client = serve(SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                             prompt_lookup_max=4, num_speculative_tokens=4,
                                             frontier_size=2))
    with client:
        yield client, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain_server():
    engine, client = serve(None)
    with client:
        yield client, engine
    engine.shutdown()


@pytest.fixture
def real_spec(spec_server, idle_check):
    yield spec_server[0]
    idle_check(spec_server[1])                           # no leak after each test


@pytest.fixture
def real_plain(plain_server, idle_check):
    yield plain_server[0]
    idle_check(plain_server[1])


BODY = {"model": "tiny", "prompt": "a b c a b c a b c a b c", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def test_real_engine_reports_its_own_counters(real_spec):
    usage = real_spec.post("/v1/completions", json={**BODY, "n": 2}).json()["usage"]
    assert set(usage) == STANDARD | {"speculative"} and usage["completion_tokens"] == 24
    spec = usage["speculative"]
    assert spec["draft_tokens"] > 0, "the n-gram drafter proposed nothing on a repetitive prompt"
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert spec["mean_draft_length"] == pytest.approx(spec["draft_tokens"] / spec["num_drafts"])
    assert 1 <= spec["mean_draft_length"] <= 4
    # accepted drafts are output tokens the steps did not have to produce one by one
    assert spec["accepted_tokens"] <= usage["completion_tokens"] - 2
    chat = real_spec.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "a b a b a b a b"}],
        "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}).json()
    assert "speculative" in chat["usage"] and chat["usage"]["completion_tokens"] == 6
    stream = real_spec.post("/v1/completions", json={**BODY, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    final = events(stream.text)[-1]
    assert final["choices"] == [] and final["usage"]["speculative"]["draft_tokens"] > 0


def test_real_engine_request_without_drafts_still_reports_zeros(real_spec):
    """Speculation is on: a request that never drafted reports zeros (max_tokens 1: no decode
    step)."""
    usage = real_spec.post("/v1/completions", json={**BODY, "max_tokens": 1}).json()["usage"]
    assert usage["speculative"] == {"num_drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                    "acceptance_rate": 0.0, "mean_draft_length": 0.0}


def test_real_engine_without_speculation_has_no_extension(real_spec, real_plain):
    assert set(real_plain.post("/v1/completions", json=BODY).json()["usage"]) == STANDARD
    off = real_spec.post("/v1/completions",
                         json={**BODY, "num_speculative_tokens": 0}).json()["usage"]
    assert set(off) == STANDARD                           # this request turned speculation off
