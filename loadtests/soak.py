"""Reliability soak: a burst beyond capacity, bad inputs, and liveness while huge inputs are
refused.

    python -m loadtests.soak [--burst 400] [--server-args "--max-num-seqs 16"]

Starts `specserve serve` (default flags, `--trust-request-chat-template` so that a request's
template is rendered under its budget rather than refused unread, plus --server-args) on
127.0.0.1 and runs, in order:
1. burst: `--burst` streamed requests (32 output tokens) sent at once. Counts 200s, 503s and any
   other status, the Retry-After the 503s carry, and how long the admitted ones took to drain.
2. bad inputs: a list of malformed or hostile requests; each must get a 4xx, none a 5xx.
3. liveness: three 10 MB prompts and a looping request template sent while /health is polled
   every 20 ms and an unrelated stream runs: /health p99 and the stream's longest pause.
4. what was lost: after the server goes idle, /metrics must show no running or waiting request
   and an empty KV cache; the server process must still be alive.
Prints one JSON summary (and writes it with --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time
from pathlib import Path

import httpx

from loadtests import peers as peer_mod
from loadtests.metrics import parse_prometheus

BAD_INPUTS = [
    ("lone surrogate", '{"model": "smollm2", "prompt": "\\ud800x", "max_tokens": 2}'),
    ("CRLF request_id", '{"model": "smollm2", "prompt": "x", "max_tokens": 2, '
                        '"request_id": "a\\r\\nX-Injected: 1"}'),
    ("negative max_tokens", '{"model": "smollm2", "prompt": "x", "max_tokens": -1}'),
    ("unknown model", '{"model": "no-such-model", "prompt": "x", "max_tokens": 2}'),
    ("invalid JSON", '{"model": "smollm2", "prompt": '),
    ("token id out of vocabulary", '{"model": "smollm2", "prompt": [99999999], "max_tokens": 2}'),
    ("huge n", '{"model": "smollm2", "prompt": "x", "max_tokens": 2, "n": 100000}'),
    ("negative temperature", '{"model": "smollm2", "prompt": "x", "max_tokens": 2, '
                             '"temperature": -5}'),
]
CHAT_TEMPLATE_LOOP = "{% for i in range(1000) %}{% for j in range(100000) %}{% endfor %}" \
                     "{% endfor %}"


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: status, Retry-After, chunk gaps, seconds."""
    t0 = time.perf_counter()
    gaps, last = [], None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                    "seconds": time.perf_counter() - t0, "gaps": []}
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return {"status": 200, "retry_after": None, "seconds": time.perf_counter() - t0,
            "gaps": gaps}


async def burst(url: str, num: int) -> dict:
    body = {"model": "smollm2", "prompt": "Question: Why do rivers bend?\nAnswer:",
            "max_tokens": 32, "ignore_eos": True}
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=num)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        results = await asyncio.gather(*(stream_one(client, url, body) for _ in range(num)))
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    retry = [int(r["retry_after"]) for r in results if r["retry_after"]]
    drain = max((r["seconds"] for r in results if r["status"] == 200), default=0.0)
    return {"sent": num, "statuses": statuses,
            "server_errors": sum(n for s, n in statuses.items()
                                 if s.startswith("5") and s != "503"),
            "retry_after_s": sorted(set(retry)), "admitted_drain_s": round(drain, 1),
            "retry_after_within_2x_drain": bool(retry) and max(retry) <= 2 * max(drain, 1.0)
            and min(retry) >= drain / 2}


def bad_inputs(url: str) -> dict:
    out = {}
    with httpx.Client(timeout=60.0) as client:
        for name, raw in BAD_INPUTS:
            r = client.post(f"{url}/v1/completions", content=raw,
                            headers={"content-type": "application/json"})
            out[name] = r.status_code
    return {"tried": len(out), "statuses": out,
            "server_errors": sum(1 for s in out.values() if s >= 500)}


async def liveness(url: str) -> dict:
    """/health latency and an unrelated stream's longest pause while huge inputs are refused."""
    huge = {"model": "smollm2", "prompt": "word " * 2_000_000, "max_tokens": 2}
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": CHAT_TEMPLATE_LOOP, "max_tokens": 2}
    stream_body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 48,
                   "ignore_eos": True}
    health: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await client.get(f"{url}/health")
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        async def hostile() -> list[int]:
            replies = await asyncio.gather(
                *(client.post(f"{url}/v1/completions", json=huge) for _ in range(3)),
                client.post(f"{url}/v1/chat/completions", json=chat))
            return [r.status_code for r in replies]
        poller = asyncio.create_task(poll())
        stream_task = asyncio.create_task(stream_one(client, url, stream_body))
        await asyncio.sleep(0.5)                      # the stream is under way
        statuses = await hostile()
        stream = await stream_task
        done.set()
        await poller
    health.sort()
    return {"hostile_statuses": statuses, "health_polls": len(health),
            "health_p99_ms": round(1000 * health[int(0.99 * (len(health) - 1))], 1),
            "stream_status": stream["status"],
            "stream_longest_pause_ms": round(1000 * max(stream["gaps"], default=0.0), 1)}


def lost(url: str, proc_alive: bool, wait_s: float = 60.0) -> dict:
    deadline = time.monotonic() + wait_s
    with httpx.Client(timeout=10.0) as client:
        while True:
            values = {s.name: s.value for s in parse_prometheus(client.get(f"{url}/metrics").text)
                      if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                    "vllm:kv_cache_usage_perc")}
            if not any(values.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        healthy = client.get(f"{url}/health").status_code == 200
    return {"after_idle": values, "healthy": healthy, "server_alive": proc_alive,
            "nothing_lost": healthy and proc_alive and not any(values.values())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=400)
    ap.add_argument("--server-args", default="", help="extra `specserve serve` flags")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    peer = peer_mod.specserve_peer(peer_mod.free_port(), "plain", 2048,
                                   extra_args=["--trust-request-chat-template",
                                               *shlex.split(args.server_args)])
    summary: dict = {"cmd": shlex.join(peer.cmd)}
    peer.start(Path("loadtests/results/logs"))
    try:
        peer.wait_ready()
        summary["burst"] = asyncio.run(burst(peer.base_url, args.burst))
        summary["bad_inputs"] = bad_inputs(peer.base_url)
        summary["liveness"] = asyncio.run(liveness(peer.base_url))
        summary["lost"] = lost(peer.base_url, peer.proc.poll() is None)
    finally:
        peer.stop()
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return summary


if __name__ == "__main__":
    main()
