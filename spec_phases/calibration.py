"""The model's own text and keys, for what is calibrated on them (Spherical-KV's codebooks, the
layer-skip set), and the compressor construction that needs them.

spec_phases knows no tokenizer: the text is the model's own continuation of its BOS token.
`own_text` decodes B sequences together (one forward per step for all of them) over a plain dense
cache, sequence b at positions b * length, b * length + 1, ...: RoPE makes attention depend only on
position differences, so each sequence is the text it would be at position 0, while its keys carry
the rotations of one text B times as long. Progress goes to the log.

Calibration runs on one CPU thread (`calibration_threads`): its ops are small, and two threads on
a loaded 2-core host wait at every op's barrier for the descheduled one.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specserve.kernels.dispatch import get_op
from specserve.kernels.metadata import LayerAttention
from specserve.kv_cache.compress import registry
from specserve.kv_cache.compress.base import Compressor
from specserve.spec_phases.paths import cache_dir

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def calibration_threads(device: torch.device | str) -> Iterator[None]:
    """One intra-op CPU thread for calibration on a CPU model, restored afterwards. Its ops are
    small (a few rows, a short sequence of a small model, k-means over 512 keys): a second thread
    gains little on an idle 2-core host, and on a loaded one every op waits at the threads' barrier
    for the descheduled one (measured on this project's 2-core host under load: 0.06-0.07 s a
    16-row decode step with one thread, 0.1-1.5 s with two; Spherical-KV's k-means 0.8 s against
    6.9 s)."""
    if torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class OwnText:
    token_ids: list[list[int]]        # [num_seqs][length + 1], BOS first
    # post-RoPE keys [num_layers, num_kv_heads, num_seqs * length, D]
    keys: torch.Tensor


class DenseCache:
    """Causal attention of one sequence over everything it has seen (keeps every layer's K/V):
    the whole-sequence forwards of calibration and of the benchmarks. Each layer's sliding window
    and the score soft-cap as the model declares them (`ModelConfig.attention`)."""

    def __init__(self, layers: LayerAttention):
        self.layers = layers
        num_layers = len(layers.windows)
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys, values = torch.cat(self.k[layer]), torch.cat(self.v[layer])
        n = keys.shape[0]
        pos = torch.arange(n, device=q.device)
        opts = self.layers.options(layer)
        out, _ = get_op("dense_attention", str(q.device))(q, keys, values, opts["scale"],
                                                           pos[n - q.shape[0]:], pos,
                                                           opts["window"], opts["softcap"])
        return out.to(q.dtype)


class _BatchedDenseCache:
    """Attention of one new token per sequence over that sequence's keys so far (all layers; a
    layer's sliding window keeps its last `window` keys)."""

    def __init__(self, layers: LayerAttention):
        self.layers = layers
        num_layers = len(layers.windows)
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]   # [B, kvh, D] per step
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(k)
        self.v[layer].append(v)
        opts = self.layers.options(layer)
        seen = -opts["window"] if opts["window"] else 0
        keys = torch.stack(self.k[layer][seen:], dim=2)                   # [B, kvh, n, D]
        values = torch.stack(self.v[layer][seen:], dim=2)
        out, _ = get_op("batched_attention", str(q.device))(q, keys, values, opts["scale"],
                                                             None, opts["softcap"])
        return out.to(q.dtype)


@torch.inference_mode()
def own_text(model, num_seqs: int, length: int, temperature: float = 1.0, seed: int = 0,
             what: str = "calibration") -> OwnText:
    """num_seqs continuations of BOS, length tokens each: sampled at `temperature` with a fixed seed
    (sampled, so the text does not collapse into a loop), or greedy at temperature 0."""
    cfg, dev = model.config, model.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(seed)
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 1
    ids = [[bos] for _ in range(num_seqs)]
    cache = _BatchedDenseCache(cfg.attention())
    offsets = torch.arange(num_seqs, device=dev) * length
    start = last_log = time.perf_counter()
    with calibration_threads(dev):
        for step in range(length):
            current = torch.tensor([s[-1] for s in ids], device=dev)
            hidden = model(current, offsets + step, cache)
            logits = model.compute_logits(hidden).float().cpu()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            else:
                nxt = logits.argmax(-1)
            for s, tok in zip(ids, nxt.tolist()):
                s.append(tok)
            if time.perf_counter() - last_log > 5 or step + 1 == length:
                last_log = time.perf_counter()
                logger.info("%s: the model's own text, %d/%d tokens x %d sequences (%.1fs)", what,
                            step + 1, length, num_seqs, last_log - start)
    keys = torch.stack([torch.stack(ks, dim=2) for ks in cache.k])       # [L, B, kvh, n, D]
    keys = keys.permute(0, 2, 1, 3, 4).reshape(cfg.num_layers, cfg.num_kv_heads,
                                               num_seqs * length, cfg.head_dim)
    return OwnText(ids, keys.float().cpu())


def fingerprint(model) -> str:
    """The model's config and a sample of its weights: what calibration caches are keyed by."""
    probe = torch.cat([p.detach().float().flatten()[:4096].cpu() for p in model.parameters()])
    return hashlib.sha256(str(model.config).encode() + probe.numpy().tobytes()).hexdigest()[:16]


def build_compressor(name: str, model, settings: dict) -> Compressor:
    """`kv_compressor` + `kv_compressor_config` -> the compressor sized for `model`, calibrated on
    the model's own keys where it needs them (Spherical-KV: 8 sequences decoded together)."""
    cfg = model.config

    def own_keys(num_tokens: int) -> torch.Tensor:
        num_seqs = 8 if num_tokens % 8 == 0 else 1
        return own_text(model, num_seqs, num_tokens // num_seqs, what="spherical codebooks").keys

    device = str(model.embed_tokens.weight.device)
    with calibration_threads(device):                 # Spherical-KV: own keys, then k-means
        return registry.build(name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, settings,
                              own_keys=own_keys,
                              fingerprint=fingerprint(model) if name == "spherical" else "",
                              cache_root=cache_dir(), device=device)
