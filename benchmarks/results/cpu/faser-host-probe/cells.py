"""Probe (not a benchmark of record): the compare harness' cells (workloads A then B at c = 1, 8,
16, 8-s windows) against each server, with each cell's window printed on the engine's clock, so
that the engine's per-step dump (step_dump.patch, PROBE_STEPS=prefix) can be cut per cell.

    git apply benchmarks/results/cpu/faser-host-probe/step_dump.patch
    PROBE_STEPS=/tmp/steps python benchmarks/results/cpu/faser-host-probe/cells.py \
        specserve-plain,specserve-ngram-adaptive 2 8 > cells.log
    git checkout scheduler/engine.py
"""
import asyncio
import re
import sys
import time
import urllib.request
from pathlib import Path

from specserve.loadtests import compare, peers as peer_mod
from specserve.loadtests.client import RequestSpec, first_model_id, run_closed_loop
from specserve.loadtests.stats import summarize

KEYS = ["vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:iteration_tokens_total_count", "vllm:generation_tokens_total"]


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for k in KEYS:
        m = re.search(r"^" + re.escape(k) + r"(\{[^}]*\})? ([0-9.e+]+)", text, re.M)
        out[k.split(":")[1]] = float(m.group(2)) if m else None
    return out


def main() -> None:
    names, rounds, cell_s = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3])
    loads = compare.workloads(0, 32)
    for rnd in range(rounds):
        for name in names:
            peer = compare.SERVERS[name](peer_mod.free_port())
            peer.start(Path("/tmp/faser-host-probe-logs"))
            try:
                peer.wait_ready()
                model = asyncio.run(first_model_id(peer.base_url))
                warm = [RequestSpec("Question: What is a cache?\nAnswer:", 8)] * 4
                asyncio.run(run_closed_loop(peer.base_url, model, warm, 2, 60.0,
                                            extra_body=peer.extra_body))
                body = {**peer.extra_body, "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}}
                for wl, c in [(w, c) for w in ("A", "B") for c in (1, 8, 16)]:
                    m0 = scrape(peer.base_url)
                    c0 = time.perf_counter()
                    load = asyncio.run(run_closed_loop(peer.base_url, model, loads[wl], c,
                                                       cell_s, grace_s=0.0, extra_body=body))
                    c1 = time.perf_counter()
                    m1 = scrape(peer.base_url)
                    s = summarize(load.results, load.duration_s)
                    d = {k: (m1[k] - m0[k]) if m1[k] is not None else None for k in m1}
                    print(f"CELL {rnd} {name} {wl}{c} {c0:.6f} {c1:.6f}", flush=True)
                    print(f"{rnd} {name:28s} {wl} c={c} {s['output_tokens_per_s']:.1f} tok/s {d}",
                          flush=True)
            finally:
                peer.stop()


if __name__ == "__main__":
    main()
