"""Clients that go away (streaming or not) abort their engine requests: nothing stays held once
idle."""
from __future__ import annotations

import asyncio
import random

import httpx
from conftest import FakeEngine, wait_until


def idle_and_clean(server) -> bool:
    engine = server.engine
    return not engine.held() and not server.app.state.serving.client.in_flight


def test_200_streams_cut_midway_leave_nothing_held(make_server, tokenizer):
    engine = FakeEngine(tokenizer, step_delay=0.002)
    server = make_server(engine)
    rng = random.Random(0)
    cut_after = [rng.randint(1, 6) for _ in range(200)]

    async def one(client: httpx.AsyncClient, i: int, limit: asyncio.Semaphore) -> int:
        body = {"prompt": f"stream {i}", "max_tokens": 400, "stream": True, "ignore_eos": True,
                "n": 1 + i % 2, "stop": ["never-seen"] if i % 3 == 0 else None}
        if i % 4 == 0:
            body = {"messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 300,
                    "stream": True, "ignore_eos": True}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with limit:
            async with client.stream("POST", server.url + path, json=body) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen >= cut_after[i]:
                            # leaving the block closes the connection mid-stream
                            break
                return seen

    async def run():
        limit = asyncio.Semaphore(25)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=30)) as client:
            return await asyncio.gather(*(one(client, i, limit) for i in range(200)))

    seen = asyncio.run(run())
    assert seen == cut_after
    wait_until(lambda: idle_and_clean(server), "every cut stream to be aborted")
    submitted = {r.request_id for r in engine.submitted}
    assert len(submitted) == 200 + sum(1 for i in range(200) if i % 4 and i % 2)   # n=2 adds one
    assert submitted == engine.aborted | engine.finished
    assert len(engine.aborted) > 190                      # they were cut, not run to the end


def test_non_streaming_client_gone_aborts(make_server, tokenizer):
    engine = FakeEngine(tokenizer, step_delay=0.01)
    server = make_server(engine)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(client.post(server.url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 400, "ignore_eos": True, "n": 3}))
            while len(engine.submitted) < 3:
                await asyncio.sleep(0.01)
            task.cancel()                          # closes the connection
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(run())
    wait_until(lambda: idle_and_clean(server), "the abandoned request to be aborted")
    assert {r.request_id for r in engine.submitted} == engine.aborted


def test_stream_gone_before_its_first_token_aborts_without_an_error(make_server, tokenizer,
                                                                   caplog):
    """A streaming client that leaves while its request waits for the first token (a load test's
    window closing on queued requests): the request is aborted and the server logs no error."""
    engine = FakeEngine(tokenizer, step_delay=3.0)        # the first token long after the cancel
    server = make_server(engine)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(client.post(server.url + "/v1/completions", json={
                "prompt": f"x {i}", "max_tokens": 400, "stream": True})) for i in range(3)]
            while len(engine.submitted) < 3:
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()                      # closes the connection
            await asyncio.gather(*tasks, return_exceptions=True)

    with caplog.at_level("ERROR"):
        asyncio.run(run())
        wait_until(lambda: idle_and_clean(server), "the abandoned streams to be aborted")
    assert {r.request_id for r in engine.submitted} == engine.aborted
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_finished_streams_are_not_aborted(server):
    for stream in (True, False):
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "x", "max_tokens": 3, "stream": stream,
                                                             "n": 2}, timeout=30)
        assert r.status_code == 200
    wait_until(lambda: idle_and_clean(server), "requests to finish")
    assert server.engine.aborted == set() and len(server.engine.finished) == 4
