"""Replicas behind vLLM's router (`pip install vllm-router`, or the `router` extra) on one machine.

    python -m loadtests.router [--model tiny-random] [--groups 6] [--per-group 6]
        [--prefix-words 300] [--kill-requests 48] [--out FILE.json]

Starts `--replicas` `specserve serve` processes (the embedded SmolLM2 GGUF unless --model says
otherwise; one thread each) and, in turn, a router per policy in front of them:
1. shared prefixes: `--groups` groups of `--per-group` completions, each group's prompts sharing a
   prefix of `--prefix-words` words and ending in their own question, sent one at a time in a
   shuffled order, once through `--policy cache_aware` and once through `round_robin` (each with
   its own prefixes, so neither finds the other's in a cache). The prefix-cache hit rate is read
   from every replica's /metrics (`vllm:prefix_cache_hits_total` / `..._queries_total`, summed).
2. a replica killed: `--kill-requests` completions through cache_aware, four at a time; when a
   quarter have finished, one replica is killed (SIGKILL to its process group). Each request is
   classed as started before the kill (in flight, or queued at the router) or after it, and
   counted as lost when it did not end in a 200. The router retries a failed attempt on another
   worker (ROUTER_FLAGS: one failure opens that worker's circuit breaker; health checks every
   second), so a non-streamed request in flight on the dead replica is retried, not lost.
3. rejoin: the killed replica is started again on its port; once the router's metrics show it
   healthy, new distinct prompts are sent, four at a time, half a second apart, until one lands
   on it (its own /metrics counts a request), or `REJOIN_TRIES` have been sent.
Prints one JSON summary (and writes it with --out). tests/deploy/test_router_replicas.py runs it
with the tiny random-weight model.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx

from loadtests.metrics import parse_prometheus
from loadtests.peers import Peer, free_port

NAME = "m"                     # --served-model-name of every replica
REJOIN_TRIES = 80                # requests sent, four at a time, half a second apart
REJOIN_HEALTH_LIMIT_S = 120.0    # a hang guard: the router should see the replica within seconds
# Router flags for replicas that can die: a worker's circuit opens on its first failed request
# (the failed attempt is retried on another worker: --retry-max-retries), health checks every
# second take a dead worker out and bring a restarted one back, and an open circuit lets one
# trial request through after 5 s. With the router's defaults (60 s health checks, circuit open
# after 10 failures), new requests picked for a dead worker fail until one of them trips.
ROUTER_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "5",
                "--cb-failure-threshold", "1", "--cb-success-threshold", "1",
                "--cb-timeout-duration-secs", "5", "--retry-max-retries", "3",
                "--request-timeout-secs", "600"]
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money story "
         "fact month lot right study book eye job word business issue side kind head house "
         "service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office "
         "door health person art war history party result change morning reason research girl "
         "guy moment air teacher force education river garden window paper light music").split()


def router_binary() -> str:
    """vllm-router from this Python's environment, else from PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise SystemExit("vllm-router is not installed: pip install -e '.[router]'")
    return found


def replica_peer(index: int, port: int, model: str | None, server_args: list[str]) -> Peer:
    cmd = [sys.executable, "-m", "specserve.server", "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", NAME,
           "--num-threads", "1", *server_args]
    return Peer(f"replica{index}", cmd, port, env={"OMP_NUM_THREADS": "1",
                                                   "HF_HUB_OFFLINE": "1"})


def router_peer(policy: str, port: int, metrics_port: int, workers: list[str]) -> Peer:
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *workers, "--prometheus-host", "127.0.0.1", "--prometheus-port",
           str(metrics_port), "--log-level", "warning", *ROUTER_FLAGS]
    return Peer(f"router-{policy}", cmd, port, startup_timeout_s=120.0)


def kill(peer: Peer) -> None:
    """SIGKILL the replica and whatever it spawned (its session), as a crash would."""
    if peer.proc is not None and peer.proc.poll() is None:
        os.killpg(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait(30)


def scrape(url: str) -> dict[str, float]:
    """The replica's counters this load test reads, summed over labels (empty when it is down)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30.0).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for s in parse_prometheus(text):
        if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                      "vllm:request_success_total", "vllm_router_retries_total",
                      "vllm_router_processed_requests_total"):
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def router_counts(router: Peer) -> dict:
    """The router's own view: requests it sent to each worker (by port), and its cache_aware
    decisions by outcome (prefix_hit, prefix_miss, ...)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port(router)}/metrics", timeout=30.0).text
    except httpx.HTTPError:
        return {}
    out: dict = {"processed": {}, "decisions": {}, "retries": 0}
    for s in parse_prometheus(text):
        if s.name == "vllm_router_processed_requests_total":
            out["processed"][s.labels["worker"].rsplit(":", 1)[-1]] = int(s.value)
        elif s.name == "vllm_router_prefix_routing_decisions_total":
            key = s.labels.get("outcome", "?")
            out["decisions"][key] = out["decisions"].get(key, 0) + int(s.value)
        elif s.name == "vllm_router_retries_total":
            out["retries"] += int(s.value)
    return out


def shared_prefix_prompts(seed: int, groups: int, per_group: int,
                          prefix_words: int) -> list[str]:
    """groups x per_group prompts: each group's share a long prefix; the order is shuffled."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        for q in range(per_group):
            question = " ".join(rng.choice(WORDS) for _ in range(8))
            prompts.append(f"Document {seed}-{g}: {prefix}\nQuestion {q}: {question}?")
    rng.shuffle(prompts)
    return prompts


def complete(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> int:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return client.post(f"{url}/v1/completions", json=body).status_code


def prefix_phase(policy: str, replicas: list[Peer], prompts: list[str],
                 max_tokens: int) -> dict:
    """The prompts one at a time through a new router with `policy`: prefix-cache hit rate over
    all replicas, and how many requests each replica served."""
    router = router_peer(policy, free_port(), free_port(), [r.base_url for r in replicas])
    router.start(LOG_DIR)
    try:
        router.wait_ready()
        before = [scrape(r.base_url) for r in replicas]
        statuses = []
        with httpx.Client(timeout=600.0) as client:
            for prompt in prompts:
                statuses.append(complete(client, router.base_url, prompt, max_tokens))
        after = [scrape(r.base_url) for r in replicas]
        seen = router_counts(router)
    finally:
        router.stop()

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)
    hits = sum(delta("vllm:prefix_cache_hits_total", i) for i in range(len(replicas)))
    queries = sum(delta("vllm:prefix_cache_queries_total", i) for i in range(len(replicas)))
    return {"policy": policy, "requests": len(prompts),
            "ok": sum(s == 200 for s in statuses),
            "per_replica": [int(delta("vllm:request_success_total", i))
                            for i in range(len(replicas))],
            "prefix_cache_hits": int(hits), "prefix_cache_queries": int(queries),
            "hit_rate": round(hits / queries, 4) if queries else 0.0,
            "router_decisions": seen.get("decisions", {})}


async def _kill_load(router_url: str, victim: Peer, prompts: list[str], max_tokens: int,
                     concurrency: int, kill_after: int) -> dict:
    results: list[dict] = []
    killed_at: list[float] = []
    in_flight_on_victim: list[float] = []
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)

    async def one(client: httpx.AsyncClient, prompt: str) -> None:
        start = time.monotonic()
        body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        try:
            status = (await client.post(f"{router_url}/v1/completions", json=body)).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        results.append({"start": start, "status": status})
        if len(results) >= kill_after and not killed_at:
            killed_at.append(0.0)                      # claimed: one task kills
            gauges = await asyncio.to_thread(_in_flight, victim.base_url)
            in_flight_on_victim.append(gauges)
            await asyncio.to_thread(kill, victim)
            killed_at[0] = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await one(client, queue.get_nowait())

    async with httpx.AsyncClient(timeout=600.0) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    kill_time = killed_at[0] if killed_at else float("inf")
    before = [r for r in results if r["start"] < kill_time]
    after = [r for r in results if r["start"] >= kill_time]
    return {"requests": len(results), "concurrency": concurrency,
            "in_flight_on_killed_replica": in_flight_on_victim[0] if in_flight_on_victim else 0,
            "started_before_kill": len(before),
            "lost_started_before_kill": sum(r["status"] != 200 for r in before),
            "started_after_kill": len(after),
            "lost_started_after_kill": sum(r["status"] != 200 for r in after),
            "statuses": sorted({str(r["status"]) for r in results})}


async def _batch(url: str, prompts: list[str], max_tokens: int) -> list[int | str]:
    async def one(client: httpx.AsyncClient, prompt: str) -> int | str:
        body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        try:
            return (await client.post(f"{url}/v1/completions", json=body)).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__
    async with httpx.AsyncClient(timeout=600.0) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


def _in_flight(url: str) -> float:
    """Running + waiting requests on a replica, from its /metrics, just before it is killed."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return 0.0
    return sum(s.value for s in parse_prometheus(text)
               if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def kill_phase(replicas: list[Peer], prompts: list[str], max_tokens: int,
               concurrency: int) -> dict:
    """Load through cache_aware; the last replica killed a quarter of the way; then restarted and
    new requests sent until one lands on it."""
    victim = replicas[-1]
    router = router_peer("cache_aware", free_port(), free_port(), [r.base_url for r in replicas])
    router.start(LOG_DIR)
    try:
        router.wait_ready()
        result = asyncio.run(_kill_load(router.base_url, victim, prompts, max_tokens,
                                        concurrency, max(1, len(prompts) // 4)))
        seen = router_counts(router)
        result["router_retries"] = seen.get("retries", 0)
        result["router_sent_per_port"] = seen.get("processed", {})
        victim.start(LOG_DIR)                          # the same command, the same port
        victim.wait_ready()
        rng = random.Random(7)
        statuses, landed = [], 0
        result["router_saw_it_healthy_s"] = wait_router_health(router, victim)
        while not landed and len(statuses) < REJOIN_TRIES:
            # four at a time: cache_aware sends a request that matches no prefix to an idle
            # worker, and with one at a time every worker is idle and it keeps to one of them
            batch = [f"Rejoin {len(statuses) + i}: " + " ".join(rng.choice(WORDS)
                                                                for _ in range(40))
                     for i in range(concurrency)]
            statuses += asyncio.run(_batch(router.base_url, batch, max_tokens))
            landed = int(scrape(victim.base_url).get("vllm:request_success_total", 0))
            if not landed:
                time.sleep(0.5)       # an open circuit lets a trial through after 5 s
        result["router_sent_per_port_after_rejoin"] = router_counts(router).get("processed", {})
        result.update({"rejoined": landed > 0, "requests_until_rejoined": len(statuses),
                       "lost_after_restart": sum(s != 200 for s in statuses)})
    finally:
        router.stop()
    return result


def wait_router_health(router: Peer, replica: Peer) -> float | None:
    """Seconds until the router's own metrics show `replica` healthy again (None: not within
    REJOIN_HEALTH_LIMIT_S; the rejoin requests are sent anyway)."""
    start = time.monotonic()
    while time.monotonic() - start < REJOIN_HEALTH_LIMIT_S:
        try:
            text = httpx.get(f"http://127.0.0.1:{metrics_port(router)}/metrics", timeout=10).text
        except httpx.HTTPError:
            text = ""
        if any(s.name == "vllm_router_worker_health" and s.value == 1
               and s.labels.get("worker") == replica.base_url for s in parse_prometheus(text)):
            return round(time.monotonic() - start, 1)
        time.sleep(0.5)
    return None


def metrics_port(router: Peer) -> int:
    return int(router.cmd[router.cmd.index("--prometheus-port") + 1])


LOG_DIR = Path("loadtests/results/logs/router")


def run(model: str | None, replicas: int = 2, groups: int = 6, per_group: int = 6,
        prefix_words: int = 300, max_tokens: int = 16, kill_requests: int = 48,
        concurrency: int = 4, server_args: list[str] | None = None,
        log_dir: Path | None = None) -> dict:
    global LOG_DIR
    if log_dir is not None:
        LOG_DIR = log_dir
    peers = [replica_peer(i, free_port(), model, server_args or []) for i in range(replicas)]
    summary: dict = {"model": model or "embedded SmolLM2-135M GGUF", "replicas": replicas,
                     "replica_cmd": shlex.join(peers[0].cmd), "router_flags": ROUTER_FLAGS}
    try:
        for peer in peers:
            peer.start(LOG_DIR)
        for peer in peers:
            peer.wait_ready()
        summary["prefix"] = [
            prefix_phase(policy, peers, shared_prefix_prompts(seed, groups, per_group,
                                                              prefix_words), max_tokens)
            for seed, policy in ((1, "cache_aware"), (2, "round_robin"))]
        rng = random.Random(3)
        kill_prompts = [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(60))
                        for i in range(kill_requests)]
        summary["kill"] = kill_phase(peers, kill_prompts, max_tokens, concurrency)
    finally:
        for peer in peers:
            peer.stop()
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtests.router", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="MODEL for `specserve serve` (default: the "
                    "embedded GGUF; tiny-random: the random-weight test model)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kill-requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--server-args", default="", help="extra `specserve serve` flags")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    summary = run(args.model, args.replicas, args.groups, args.per_group, args.prefix_words,
                  args.max_tokens, args.kill_requests, args.concurrency,
                  shlex.split(args.server_args), args.log_dir)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return summary


if __name__ == "__main__":
    main()
