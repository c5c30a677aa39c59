"""What a streamed token costs through the server at c = 1 (a benchmark, not a test): starts
`specserve serve` on the embedded model, streams `--requests` chat prompts of `--max-tokens`
tokens one after another with the compare harness' own client, and prints TPOT p50 and tok/s
beside the CPU time a token took in each process: the API server, the engine core (its own
process, or the API's with `--engine-in-thread`) and this client, read from /proc. Each
variant (after `--`) is a server run; repeat variants to alternate them. A variant is a
space-separated list of extra `specserve serve` flags and NAME=VALUE environment settings (""
for none; no variant: one default run).

    python benchmarks/server_token_cost.py -- "" --engine-in-thread "" --engine-in-thread
    python benchmarks/server_token_cost.py -- "" GOMP_SPINCOUNT=2000 "" GOMP_SPINCOUNT=2000
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

# loadtests/ is a tool folder of the checkout, not installed with the server
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtests.client import RequestSpec, stream_completion  # noqa: E402
from loadtests.peers import SERVED_MODEL_NAME, free_port, specserve_peer  # noqa: E402
from loadtests.workloads import chat_prompts  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def run(variant: str, num_requests: int, max_tokens: int, log_dir: Path) -> str:
    words = shlex.split(variant)
    peer = specserve_peer(free_port(), extra_args=[w for w in words if "=" not in w])
    peer.env = dict(w.split("=", 1) for w in words if "=" in w)
    peer.start(log_dir)
    try:
        peer.wait_ready()
        server = peer.proc.pid
        async with httpx.AsyncClient(timeout=300) as client:
            async def stream(prompt: str, tokens: int):
                r = await stream_completion(client, peer.base_url, SERVED_MODEL_NAME,
                                            RequestSpec(prompt, tokens), peer.extra_body)
                if not r.ok:
                    raise RuntimeError(f"request failed: {r.error}\n{peer.log_tail()}")
                return r
            prompts = chat_prompts(num_requests + 1, 1)
            await stream(prompts[0], 16)
            # the engine core: the busiest process (its warm-up ran there), a child of the
            # server's or, with --engine-in-thread, the server itself
            engine = max([server, *children(server)], key=cpu_seconds)
            before = cpu_seconds(server), cpu_seconds(engine), time.process_time()
            start, tpots, tokens = time.perf_counter(), [], 0
            for prompt in prompts[1:]:
                r = await stream(prompt, max_tokens)
                tpots.append(statistics.median(r.itls_s) * 1e3)
                tokens += r.completion_tokens
            elapsed = time.perf_counter() - start
            api = cpu_seconds(server) - before[0]
            core = cpu_seconds(engine) - before[1]
            mine = time.process_time() - before[2]
    finally:
        peer.stop()
    per = 1e3 / tokens
    return (f"{variant or 'default'!r}: TPOT p50 {statistics.median(tpots):.2f} ms, "
            f"{tokens / elapsed:.1f} tok/s; CPU ms a token: API process {api * per:.2f}, "
            f"engine {core * per:.2f}, client {mine * per:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variant", nargs="*", default=[""])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        for variant in args.variant or [""]:
            print(asyncio.run(run(variant, args.requests, args.max_tokens, Path(log_dir))),
                  flush=True)


if __name__ == "__main__":
    main()
