"""What the fast path costs in accuracy on the embedded model: the same GGUF blocks served with
float32 activations and a float32 KV cache (`--dtype float32`), with int8 activations
(`linear_i8.c`) over a float32 cache, and with int8 activations over a bfloat16 and an fp8 cache
(`--dtype auto`, `--kv-cache-dtype auto` = bfloat16 on the CPU, or fp8: each key and value
rounded to the cache's type as the cache stores it, attended at float32), and the bf16 cache
attended by the server's C kernel itself (`int8 bf16 KV, C`: on the bf16 dot-product units where
the build has them, queries and softmax weights rounded to bf16). Perplexity on a fixed
text, top-1 agreement of the next token along it with the float32 path, and greedy continuations
of held prompts (32 tokens each: identical sequences, and the first token where they part).
A benchmark, not a test.

    python benchmarks/accuracy_i8.py
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specserve.kernels.cpu import paged_attention as cpu_paged
from specserve.kernels.metadata import PagedAttentionMetadata
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.paths import embedded_model_path

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way. "
    "The mitochondrion is an organelle found in the cells of most eukaryotes. It generates most "
    "of the chemical energy needed to power the cell's biochemical reactions, stored in a small "
    "molecule called adenosine triphosphate. Mitochondria have their own genome, which is "
    "inherited from the mother in most species. "
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = "
    "len(items) // 2\n    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])"
    "\n    return merge(left, right)\n"
    "The Treaty of Westphalia, signed in 1648, ended the Thirty Years' War and established the "
    "principle of state sovereignty that shapes international relations to this day.")
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "Photosynthesis is the process by which", "List three prime numbers greater than 100:",
    "The history of the Roman Empire", "import numpy as np\n\ndef normalize(x):",
    "Q: What is the boiling point of water?\nA:", "The best way to learn a language is",
    "In 1969, the first humans", "SELECT name FROM users WHERE", "Dear hiring manager,",
    "The three laws of thermodynamics are", "A haiku about autumn:\n",
    "To make a cup of tea, first", "The difference between a list and a tuple in Python is"]
NEW_TOKENS = 32


KV_TYPES = {"float32": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# (name, int8 activations, KV cache type, attended by the C kernel over a paged cache)
VARIANTS = (("float32", False, "float32", False), ("int8", True, "float32", False),
            ("int8 bf16 KV", True, "bfloat16", False), ("int8 fp8 KV", True, "fp8", False),
            ("int8 bf16 KV, C", True, "bfloat16", True))


def attention(kv_type: torch.dtype | None, kernel: bool = False):
    """A causal attention over keys and values rounded to kv_type as the cache stores them:
    SDPA at float32, or (kernel) the server's C paged attention over a cache of kv_type (a bf16
    cache on the bf16 dot-product units where the build has them: `paged_attention_dot.h`)."""
    def attend(layer, q, k, v):
        if kernel:
            return paged(q, k.to(kv_type), v.to(kv_type))
        if kv_type is not None:
            k, v = k.to(kv_type).float(), v.to(kv_type).float()
        return causal(layer, q, k, v)
    return attend


def paged(q, k, v, block: int = 16):
    """q [n, heads, D] attended causally over k, v [n, kv heads, D] as one request's paged
    cache (blocks 0, 1, ... in order) by the C kernel, prompt rows in its tiles."""
    n, blocks = q.shape[0], -(-q.shape[0] // block)
    pad = blocks * block - n
    k, v = (torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]).contiguous() for x in (k, v))
    meta = PagedAttentionMetadata([0, n], [n], [tuple(range(blocks))], block)
    return cpu_paged.paged_attention(q.float().contiguous(), k, v, meta, q.shape[-1] ** -0.5)


def causal(layer, q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


def logits(model, ids: list[int], attend=causal) -> torch.Tensor:
    with torch.inference_mode():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, torch.arange(len(ids)), attend))


def greedy(model, ids: list[int], attend=causal) -> list[int]:
    out = list(ids)
    for _ in range(NEW_TOKENS):
        out.append(int(logits(model, out, attend)[-1].argmax()))
    return out[len(ids):]


def main() -> None:
    from transformers import AutoTokenizer
    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    models = {}
    for int8 in (False, True):
        models[int8] = load_model(None)
        assert models[int8].pack_for_cpu(int8)
    ids = tok.encode(TEXT)
    print(f"fixed text: {len(ids)} tokens")
    per, outs = {}, {}
    for name, int8, kv, kernel in VARIANTS:
        attend = attention(KV_TYPES[kv], kernel)
        lg = logits(models[int8], ids, attend)[:-1]
        per[name] = lg
        nll = F.cross_entropy(lg, torch.tensor(ids[1:]))
        outs[name] = [greedy(models[int8], tok.encode(p), attend) for p in PROMPTS]
        line = f"{name:>13}: perplexity {math.exp(float(nll)):.4f}"
        if name != "float32":
            agree = (per["float32"].argmax(-1) == lg.argmax(-1)).float().mean()
            same = sum(a == b for a, b in zip(outs["float32"], outs[name]))
            firsts = [next((i for i in range(NEW_TOKENS) if a[i] != b[i]), NEW_TOKENS)
                      for a, b in zip(outs["float32"], outs[name])]
            line += (f", next-token top-1 agreement with float32 {100 * float(agree):.1f}%, "
                     f"greedy {NEW_TOKENS} tokens: {same} of {len(PROMPTS)} prompts identical; "
                     f"first differing token (or {NEW_TOKENS}): {firsts}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
