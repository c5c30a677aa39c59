"""A streaming OpenAI `/v1/completions` load generator (httpx + asyncio), bounded in count and time.

Two load shapes over the same list of requests:
- closed loop: `concurrency` workers, each sends its next request when the previous one finishes;
- open loop: request i is sent at `arrival_s[i]` after the start (Poisson or bursty gaps, see
  workloads.py), however many are still in flight, up to `max_in_flight`.
Both stop sending new requests at `time_limit_s`, and cancel what is still running at
`time_limit_s + grace_s`; cancelled requests are reported as failed with error "cancelled", keeping
what they had streamed so far (their content chunks still count as delivered tokens).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    arrival_s: float = 0.0            # open loop only: offset from the start of the cell


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0              # perf_counter at send
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itls_s: list[float] = field(default_factory=list)
    num_chunks: int = 0               # content chunks (choices with non-empty text)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False      # False: completion_tokens is the content-chunk count
    text: str = ""


@dataclass(frozen=True)
class LoadResult:
    results: list[RequestResult]
    duration_s: float


def _sse_payloads(lines):
    """Yield the JSON text of each `data:` event; comments (`:`) and other fields are skipped."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str,
                            spec: RequestSpec, extra_body: dict | None = None,
                            result: RequestResult | None = None) -> RequestResult:
    """Send one streaming request; fills `result` in place as chunks arrive (so a cancel
    keeps them)."""
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **(extra_body or {})}
    result = result if result is not None else RequestResult()
    result.start_s = time.perf_counter()
    last_chunk_s = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            done = False
            async for payload in _aiter_payloads(response):
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"in-band error: {chunk['error']}"
                    return result
                now = time.perf_counter()
                # A chunk counts when it carries text: llama.cpp ends with an empty one holding only
                # finish_reason, which is not a token.
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last_chunk_s is None:
                        result.ttft_s = now - result.start_s
                    else:
                        result.itls_s.append(now - last_chunk_s)
                    last_chunk_s = now
                    result.num_chunks += 1
                    result.text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    result.usage_reported = True
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.completion_tokens = chunk["usage"].get("completion_tokens", 0)
            if not done:
                result.error = "stream ended without [DONE]"
                return result
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - result.start_s
    if not result.usage_reported:
        result.completion_tokens = result.num_chunks
    result.ok = result.num_chunks > 0
    if not result.ok:
        result.error = "no content chunk"
    return result


async def _aiter_payloads(response: httpx.Response):
    async for line in response.aiter_lines():
        for payload in _sse_payloads([line]):
            yield payload


async def _bounded(client: httpx.AsyncClient, base_url: str, model: str, spec: RequestSpec,
                   extra_body: dict | None, deadline: float) -> RequestResult:
    """One request until the hard deadline (perf_counter); past it, failed with error
    'cancelled'."""
    result = RequestResult()
    try:
        return await asyncio.wait_for(stream_completion(client, base_url, model, spec, extra_body,
                                                        result),
                                      max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        result.ok, result.error = False, "cancelled"
        # no running usage (continuous_usage_stats): count chunks
        if not result.usage_reported:
            result.completion_tokens = result.num_chunks
        return result


def _client(max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


async def run_closed_loop(base_url: str, model: str, requests: list[RequestSpec], concurrency: int,
                          time_limit_s: float, grace_s: float = 30.0,
                          extra_body: dict | None = None) -> LoadResult:
    """Send `requests` in order from `concurrency` workers; stop sending at `time_limit_s`."""
    queue = list(reversed(requests))
    results: list[RequestResult] = []
    start = time.perf_counter()
    soft_deadline, hard_deadline = start + time_limit_s, start + time_limit_s + grace_s

    async with _client(concurrency) as client:
        async def worker() -> None:
            while queue and time.perf_counter() < soft_deadline:
                spec = queue.pop()
                results.append(await _bounded(client, base_url, model, spec, extra_body,
                                              hard_deadline))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(results, time.perf_counter() - start)


async def run_open_loop(base_url: str, model: str, requests: list[RequestSpec], time_limit_s: float,
                        grace_s: float = 30.0, max_in_flight: int = 64,
                        extra_body: dict | None = None) -> LoadResult:
    """Send request i at `requests[i].arrival_s`; arrivals after `time_limit_s` are not sent."""
    start = time.perf_counter()
    hard_deadline = start + time_limit_s + grace_s
    gate = asyncio.Semaphore(max_in_flight)
    tasks = []

    async with _client(max_in_flight) as client:
        async def one(spec: RequestSpec) -> RequestResult:
            async with gate:
                return await _bounded(client, base_url, model, spec, extra_body, hard_deadline)

        for spec in sorted(requests, key=lambda r: r.arrival_s):
            if spec.arrival_s > time_limit_s:
                break
            await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one(spec)))
        results = list(await asyncio.gather(*tasks))
    return LoadResult(results, time.perf_counter() - start)


async def first_model_id(base_url: str) -> str:
    """`data[0].id` of GET /v1/models, as load tools do."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        response = await client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
