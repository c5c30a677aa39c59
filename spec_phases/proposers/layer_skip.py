"""Self-speculation by layer skipping: the target itself, running only a subset of its layers,
drafts greedily on the same paged KV cache (no extra weights). The verify pass rewrites every
drafted slot with full-model K/V, so the skipped layers never leak into the output.

`python -m specserve.spec_phases.proposers.layer_skip [MODEL]` calibrates the default skip set for a
model by measured agreement with the full model and stores it in the specserve cache.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from collections.abc import Callable

import torch

from specserve.spec_phases.calibration import DenseCache, own_text
from specserve.spec_phases.paths import cache_dir, resolve_model_path
from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer

logger = logging.getLogger(__name__)

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
def calibrate(model, token_ids: list[int], k: int = 4) -> tuple[tuple[int, ...], dict]:
    """Pick the skip set maximising the expected speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)), where a
    is the measured greedy agreement with the full model and c the fraction of layers kept. Layers
    are dropped in order of least single-layer damage; the set is never empty (an empty set would
    draft with the full model), even where no set is expected to pay — that is logged."""
    ids = torch.tensor(token_ids, device=model.embed_tokens.weight.device)
    pos = torch.arange(len(ids), device=ids.device)
    n = model.config.num_layers

    def argmax(layers: list[int] | None = None) -> torch.Tensor:
        return model.compute_logits(model(ids, pos, DenseCache(n), layers)).argmax(-1)

    ref = argmax()
    start = time.perf_counter()

    def agreement(skip: set[int]) -> float:
        return float((argmax([i for i in range(n) if i not in skip]) == ref).float().mean())

    single = {}
    for layer in range(1, n - 1):                                         # first, last always kept
        single[layer] = agreement({layer})
        if layer % 10 == 0:
            logger.info("layer_skip calibration: layer %d/%d scored (%.1fs)", layer, n - 2,
                        time.perf_counter() - start)
    order = sorted(single, key=single.get, reverse=True)                  # least important first
    best, best_speedup, trace = (), 0.0, []
    for num_skip in range(1, len(order) + 1):
        skip = set(order[:num_skip])
        a = min(agreement(skip), 0.999)
        c = (n - num_skip) / n
        speedup = (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))
        trace.append({"num_skip": num_skip, "agreement": round(a, 3), "speedup": round(speedup, 3)})
        if speedup > best_speedup:
            best, best_speedup = tuple(sorted(skip)), speedup
        if a < 0.2:
            break
    logger.info("layer_skip calibration: %d skip sets tried in %.1fs", len(trace),
                time.perf_counter() - start)
    if best_speedup <= 1.0:
        logger.warning("layer_skip is not expected to pay on this model: best skip set %s gives an "
                       "estimated "
                       "%.2fx at k=%d", list(best), best_speedup, k)
    return best, {"single_layer_agreement": single, "trace": trace,
                  "expected_speedup": best_speedup}


def _cache_file(model: str | None) -> "object":
    path = resolve_model_path(model)
    key = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()[:16]
    return cache_dir() / "layer_skip" / f"{path.stem}-{key}.json"


def default_skip_layers(model: str | None, llama, k: int = 4) -> tuple[int, ...]:
    """The calibrated skip set for `model` from the cache, calibrating (and caching) it if
    missing."""
    file = _cache_file(model)
    if file.exists():
        return tuple(json.loads(file.read_text())["skip_layers"])
    logger.info("layer_skip: calibrating the skip set (once; cached in %s)", file.parent)
    token_ids = own_text(llama, 1, 160, temperature=0, what="layer_skip calibration").token_ids[0]
    skip, report = calibrate(llama, token_ids, k)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"skip_layers": list(skip), **report}, indent=1))
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
