"""Self-speculation by layer skipping: the target itself, running only a subset of its layers,
drafts greedily on the same paged KV cache (no extra weights). The verify pass rewrites every
drafted slot with full-model K/V, so the skipped layers never leak into the output.

`python -m specserve.spec_phases.proposers.layer_skip [MODEL]` calibrates the default skip set for a
model by measured agreement with the full model and stores it in the specserve cache; the engine
does the same at first start when the cache has none (seconds, logged as it goes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.spec_phases.calibration import DenseCache, calibration_threads, own_text
from specserve.spec_phases.paths import cache_dir, resolve_model_path
from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer

logger = logging.getLogger(__name__)
CALIB_VERSION = 2     # 1: single-layer agreement order on a greedy 160-token text (minutes)
NUM_SEQS, SEQ_LENGTH = 8, 24
PATIENCE = 4          # prefixes scored past the best before the search stops

# (token id, position, block ids) per row -> raw logits [rows, vocab]
RowForward = Callable[[list[tuple[int, int, tuple[int, ...]]], list[int]], torch.Tensor]

class LayerSkipProposer(Proposer):
    name = "layer_skip"

    def __init__(self, forward: RowForward, num_layers: int, skip_layers: tuple[int, ...]):
        self.forward = forward
        self.layers = [i for i in range(num_layers) if i not in set(skip_layers)]

    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in requests]
        current = [r.token_ids[-1] for r in requests]
        passes = []
        for step in range(max(max_lens, default=0)):
            t = time.perf_counter()
            active = [i for i, k in enumerate(max_lens) if k > step]
            rows = [(current[i], requests[i].num_computed_tokens + step, requests[i].block_ids)
                    for i in active]
            next_tokens = self.forward(rows, self.layers).argmax(dim=-1).tolist()
            for i, tok in zip(active, next_tokens):
                drafts[i].append(tok)
                current[i] = tok
            passes.append((len(active), time.perf_counter() - t))
        return Drafts(drafts, passes)


@torch.inference_mode()
def layer_influence(model, ids: torch.Tensor, pos: torch.Tensor
                    ) -> tuple[list[float], torch.Tensor]:
    """One full forward over ids: per layer, how much it turns the residual stream (1 - the mean
    cosine between the stream before and after it; ShortGPT's block influence), and the full
    model's greedy predictions [n]. Small influence = cheap to skip."""
    attn = DenseCache(model.config.attention())
    x, delta = model.embed(ids), None
    ropes = model.rope_tables(pos)
    influence = []
    for layer in model.layers:
        before = x if delta is None else x + delta
        x, delta = layer(x, delta, ropes, attn)
        after = x + delta
        influence.append(1 - float(F.cosine_similarity(before.float(), after.float(), -1).mean()))
    hidden = model.norm.add_forward(x, delta)[1]
    return influence, model.compute_logits(hidden).argmax(-1)


@torch.inference_mode()
def calibrate(model, token_ids: list[int], k: int = 4) -> tuple[tuple[int, ...], dict]:
    """Pick the skip set maximising the expected speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)), where a
    is the measured greedy agreement with the full model and c the fraction of layers kept. Layers
    are dropped in order of least influence on the residual stream (`layer_influence`, one
    forward); each prefix of that order is scored by one forward, until agreement falls under 0.2
    or the speedup has not improved for PATIENCE prefixes. The set is never empty (an empty set
    would draft with the full model), even where no set is expected to pay — that is logged."""
    ids = torch.tensor(token_ids, device=model.embed_tokens.weight.device)
    pos = torch.arange(len(ids), device=ids.device)
    n = model.config.num_layers
    influence, ref = layer_influence(model, ids, pos)
    order = sorted(range(1, n - 1), key=lambda i: influence[i])     # first and last always kept
    best, best_speedup, trace, since_best = (), 0.0, [], 0
    start = time.perf_counter()
    for num_skip in range(1, len(order) + 1):
        skip = set(order[:num_skip])
        layers = [i for i in range(n) if i not in skip]
        hidden = model(ids, pos, DenseCache(model.config.attention()), layers)
        agree = model.compute_logits(hidden).argmax(-1) == ref
        a = min(float(agree.float().mean()), 0.999)
        c = (n - num_skip) / n
        speedup = (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))
        trace.append({"num_skip": num_skip, "agreement": round(a, 3), "speedup": round(speedup, 3)})
        logger.info("layer_skip calibration: %d layers skipped, agreement %.3f, expected %.2fx "
                    "(%.1fs)", num_skip, a, speedup, time.perf_counter() - start)
        since_best += 1
        if speedup > best_speedup:
            best, best_speedup, since_best = tuple(sorted(skip)), speedup, 0
        if a < 0.2 or since_best >= PATIENCE:
            break
    if best_speedup <= 1.0:
        logger.warning("layer_skip is not expected to pay on this model: best skip set %s gives an "
                       "estimated %.2fx at k=%d", list(best), best_speedup, k)
    return best, {"layer_influence": [round(x, 5) for x in influence], "trace": trace,
                  "expected_speedup": best_speedup}


def _cache_file(model: str | None) -> Path:
    path = resolve_model_path(model)
    key = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{CALIB_VERSION}".encode())
    return cache_dir() / "layer_skip" / f"{path.stem}-{key.hexdigest()[:16]}.json"


def default_skip_layers(model: str | None, llama, k: int = 4) -> tuple[int, ...]:
    """The calibrated skip set for `model` from the cache, calibrating (and caching) it if missing:
    on NUM_SEQS x SEQ_LENGTH tokens of the model's own text, packed into one sequence."""
    file = _cache_file(model)
    if file.exists():
        return tuple(json.loads(file.read_text())["skip_layers"])
    logger.info("layer_skip: calibrating the skip set (once; cached in %s)", file.parent)
    start = time.perf_counter()
    text = own_text(llama, NUM_SEQS, SEQ_LENGTH, what="layer_skip calibration")
    with calibration_threads(llama.embed_tokens.weight.device):
        skip, report = calibrate(llama, [t for seq in text.token_ids for t in seq], k)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"skip_layers": list(skip), **report}, indent=1))
    tmp.replace(file)
    logger.info("layer_skip: skip set %s calibrated in %.1fs -> %s", list(skip),
                time.perf_counter() - start, file)
    return skip


def main() -> None:
    ap = argparse.ArgumentParser(description="Calibrate the layer_skip drafter's default skip set.")
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-k", type=int, default=4, help="draft length the speedup estimate assumes")
    args = ap.parse_args()
    from specserve.spec_phases.loader import load_model
    llama = load_model(args.model)
    file = _cache_file(args.model)
    if file.exists():
        file.unlink()
    skip = default_skip_layers(args.model, llama, args.k)
    print(json.dumps({"model": str(resolve_model_path(args.model)), "skip_layers": list(skip),
                      "cache": str(file)}))


if __name__ == "__main__":
    main()
