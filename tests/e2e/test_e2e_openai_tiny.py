"""The official openai client against a real server running the real engine (tiny random
weights)."""
from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
from conftest import NAME


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_completions_n_prompts_logprobs_echo(real_server):
    out = client(real_server).completions.create(model=NAME,
                                                 prompt=["Hello there", "The capital of"], n=2,
                                                 max_tokens=5, temperature=0, logprobs=2, echo=True)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert (out.choices[0].text == out.choices[1].text
            and out.choices[0].text.startswith("Hello there"))
    lp = out.choices[2].logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])
    assert out.usage.completion_tokens == 20


def test_greedy_stream_equals_non_stream_and_seed_reproduces(real_server):
    c = client(real_server)
    plain = c.completions.create(model=NAME, prompt="Once upon", max_tokens=12, temperature=0)
    pieces = [ch.choices[0].text for ch in c.completions.create(model=NAME, prompt="Once upon",
                                                                max_tokens=12,
                                                                temperature=0,
                                                                stream=True) if ch.choices]
    assert "".join(pieces) == plain.choices[0].text
    a = c.completions.create(model=NAME, prompt="Once upon", max_tokens=12, temperature=1.0, seed=7)
    b = c.completions.create(model=NAME, prompt="Once upon", max_tokens=12, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_split_across_tokens_real(real_server):
    c = client(real_server)
    full = c.completions.create(model=NAME, prompt="Once upon", max_tokens=12,
                                temperature=0).choices[0].text
    # a stop string straddling whatever token boundary is there
    cut = len(full) // 2
    stop = full[cut - 2:cut + 2]
    out = c.completions.create(model=NAME, prompt="Once upon", max_tokens=12, temperature=0,
                               stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)]
    assert (out.choices[0].finish_reason == "stop"
            and out.choices[0].model_extra["stop_reason"] == stop)


def test_chat_sync_async_stream_real(real_server):
    c = client(real_server)
    messages = [{"role": "user", "content": "Hi"}]
    out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=2)
    assert len(out.choices[0].logprobs.content) == 4 and out.usage.completion_tokens == 4
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                       stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream)
    assert text == out.choices[0].message.content

    async def run():
        a = openai.AsyncOpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0)
        r = await a.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                            temperature=0)
        await a.close()
        return r.choices[0].message.content

    assert asyncio.run(run()) == text


def test_errors_real(real_server):
    c = client(real_server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=NAME, prompt="x", max_tokens=300)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=NAME, prompt=[49152])
    assert httpx.get(real_server.url + "/v1/models").json()["data"][0]["max_model_len"] == 256


def test_200_streams_cut_midway_leave_no_blocks(real_server):
    rng = random.Random(1)
    cut_after = [rng.randint(1, 4) for _ in range(200)]

    async def one(http: httpx.AsyncClient, i: int, limit: asyncio.Semaphore):
        async with limit:
            body = {"model": NAME, "prompt": f"stream number {i}", "max_tokens": 200,
                    "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", real_server.url + "/v1/completions",
                                   json=body) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen >= cut_after[i]:
                            return seen

    async def run():
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i, limit) for i in range(200)))

    assert asyncio.run(run()) == cut_after
    real_server.wait_idle()                       # check_integrity: 0 blocks held once idle
