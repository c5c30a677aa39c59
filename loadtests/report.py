"""Turn one run's results into JSON, a Markdown ratio table and PNG plots.

`results.json` shape (written by run.py, read here):
    {"meta": {...}, "peers": {name: {"status": "ok"|error text, ...}},
     "cells": [{"label", "workload", "concurrency", "rate", "peer", "summary": stats.summarize(...),
                "spec_decode": metrics.SpecDecodeStats.to_dict() | None, "e2e_s": [...],
                "ttft_s": [...]}],
     "vllm_bench": {...} | None}
Ratios are specserve's best mode over the best other peer, per cell; above 1 means specserve is
better (for latencies the ratio is inverted so that this stays true).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from loadtests.vllm_bench import markdown as bench_markdown

OURS_PREFIX = "specserve"


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _by_cell(cells: list[dict]) -> dict[str, dict[str, dict]]:
    table: dict[str, dict[str, dict]] = {}
    for cell in cells:
        table.setdefault(cell["label"], {})[cell["peer"]] = cell
    return table


def best(cells_of_label: dict[str, dict], ours: bool, key: str, higher_is_better: bool = True):
    """(peer, value) of the best specserve mode (ours=True) or best other peer for one metric."""
    def value(cell: dict) -> float:
        part, _, field = key.partition(".")
        v = cell["summary"][part][field] if field else cell["summary"][part]
        return math.nan if v is None else v

    candidates = [(peer, value(c)) for peer, c in cells_of_label.items()
                  if peer.startswith(OURS_PREFIX) == ours and c["summary"]["num_completed"] > 0]
    candidates = [(p, v) for p, v in candidates if not math.isnan(v)]
    if not candidates:
        return None, math.nan
    return (max if higher_is_better else min)(candidates, key=lambda pv: pv[1])


def ratio_rows(results: dict) -> list[dict]:
    rows = []
    for label, by_peer in _by_cell(results["cells"]).items():
        row = {"label": label}
        for key, name, higher in (("output_tokens_per_s", "tput", True),
                                  ("ttft_s.p50", "ttft", False),
                                  ("itl_s.p50", "itl", False), ("e2e_s.p99", "e2e99", False),
                                  ("goodput_requests_per_s", "goodput", True)):
            our_peer, ours = best(by_peer, True, key, higher)
            their_peer, theirs = best(by_peer, False, key, higher)
            if higher:
                r = ours / theirs if theirs and not math.isnan(theirs) else math.nan
            else:
                r = theirs / ours if ours and not math.isnan(ours) else math.nan
            row[name] = {"ratio": r, "ours": ours, "our_peer": our_peer, "theirs": theirs,
                         "their_peer": their_peer}
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    peers = list(results["peers"])
    lines = ["### Ratios: specserve (best mode) / best peer, per cell (> 1 means specserve is "
             "better)", "",
             "| cell | out tok/s ratio | best peer | TTFT p50 ratio | ITL p50 ratio "
             "| E2E p99 ratio | goodput ratio |", "|---|---|---|---|---|---|---|"]
    for row in ratio_rows(results):
        t = row["tput"]
        lines.append(f"| {row['label']} | {_fmt(t['ratio'])} ({_fmt(t['ours'], 1)} vs "
                     f"{_fmt(t['theirs'], 1)}) | {t['their_peer'] or '–'} "
                     f"| {_fmt(row['ttft']['ratio'])} | {_fmt(row['itl']['ratio'])} "
                     f"| {_fmt(row['e2e99']['ratio'])} | {_fmt(row['goodput']['ratio'])} |")
    lines += _peer_table(results, peers, "Output tokens/s per peer (completed / sent requests)",
                         lambda s: f"{_fmt(s['output_tokens_per_s'], 1)} "
                                   f"({s['num_completed']}/{s['num_requests']})")
    lines += _peer_table(results, peers, "Latency per peer: TTFT p50 / ITL p50 / E2E p99 (seconds)",
                         lambda s: f"{_fmt(s['ttft_s']['p50'])} / {_fmt(s['itl_s']['p50'], 3)} / "
                                   f"{_fmt(s['e2e_s']['p99'])}")
    spec = [c for c in results["cells"] if c.get("spec_decode") and c["spec_decode"]["num_drafts"]]
    if spec:
        lines += ["", "### Speculative decoding (from `/metrics` counter deltas)", "",
                  "| cell | peer | acceptance rate | mean acceptance length | per position |",
                  "|---|---|---|---|---|"]
        for c in spec:
            sd = c["spec_decode"]
            per_pos = ", ".join(_fmt(v) for v in sd["acceptance_per_pos"])
            lines.append(f"| {c['label']} | {c['peer']} | {_fmt(sd['acceptance_rate'])} "
                         f"| {_fmt(sd['mean_acceptance_length'])} | {per_pos} |")
    lines.append(bench_markdown(results.get("vllm_bench")))
    lines += ["", "### Peers", ""]
    for name, info in results["peers"].items():
        lines.append(f"- **{name}**: {info.get('status', '?')}")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir: Path) -> list[Path]:
    """throughput.png (tokens/s vs concurrency), latency_cdf.png (E2E CDFs), acceptance.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    closed = [c for c in results["cells"] if c.get("concurrency")]
    workloads = sorted({c["workload"] for c in closed})
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(5 * max(1, len(workloads)), 4),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for peer in results["peers"]:
            points = sorted((c["concurrency"], c["summary"]["output_tokens_per_s"]) for c in closed
                            if c["workload"] == workload and c["peer"] == peer)
            if points:
                ax.plot(*zip(*points), marker="o", label=peer)
        ax.set(title=workload, xlabel="concurrency", ylabel="output tokens/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    labels = list(_by_cell(results["cells"]))
    ncols = min(4, max(1, len(labels)))
    nrows = -(-max(1, len(labels)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3.3 * nrows), squeeze=False)
    for ax, label in zip(axes.flat, labels):
        for peer, cell in _by_cell(results["cells"])[label].items():
            values = sorted(cell.get("e2e_s") or [])
            if values:                                 # the CDF starts at 0 at the fastest request
                fracs = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
                ax.step([values[0]] + values, fracs, where="post", label=peer)
        ax.set(title=label, xlabel="E2E latency (s)", ylabel="fraction of requests", ylim=(0, 1.05))
        ax.title.set_fontsize(8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(labels):]:
        ax.set_visible(False)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    spec = [c for c in results["cells"]
            if c.get("spec_decode") and c["spec_decode"]["acceptance_per_pos"]
            and c["spec_decode"]["num_drafts"]]
    if spec:
        fig, ax = plt.subplots(figsize=(10, 4))
        width = 0.8 / len(spec)
        for i, c in enumerate(spec):
            per_pos = c["spec_decode"]["acceptance_per_pos"]
            ax.bar([p + i * width for p in range(len(per_pos))], per_pos, width,
                   label=f"{c['peer']} · {c['label']}")
        num_pos = max(len(c["spec_decode"]["acceptance_per_pos"]) for c in spec)
        ax.set_xticks([p + 0.4 - width / 2 for p in range(num_pos)],
                      [str(p) for p in range(num_pos)])
        ax.set(xlabel="draft position", ylabel="accepted / drafts", title="acceptance per position",
               ylim=(0, 1))
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        written.append(out_dir / "acceptance.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, report.md and the PNGs under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["markdown"].write_text(markdown(results))
    try:
        for png in plot(results, out_dir):
            paths[png.stem] = png
    except ImportError as exc:                     # matplotlib is a benchmark-only dependency
        paths["markdown"].write_text(markdown(results) + f"\n(no plots: {exc})\n")
    return paths


def _peer_table(results: dict, peers: list[str], title: str, cell) -> list[str]:
    """One row per cell, one column per peer: cell(summary), or a dash where the peer has none."""
    lines = ["", f"### {title}", "", "| cell | " + " | ".join(peers) + " |",
             "|---|" + "---|" * len(peers)]
    for label, by_peer in _by_cell(results["cells"]).items():
        summaries = [by_peer.get(p, {}).get("summary") for p in peers]
        lines.append(f"| {label} | "
                     + " | ".join("–" if s is None else cell(s) for s in summaries) + " |")
    return lines
