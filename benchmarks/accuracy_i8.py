"""What int8 activations cost in accuracy on the embedded model: the same GGUF blocks served with
float32 activations (`--dtype float32`) and with int8 ones (`--dtype auto`, `linear_i8.c`).
Perplexity on a fixed text, top-1 agreement of the next token along it, and greedy continuations
of held prompts (32 tokens each: identical sequences, and the first token where they part).
A benchmark, not a test.

    python benchmarks/accuracy_i8.py
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


def causal(layer, q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, torch.arange(len(ids)), causal))


def greedy(model, ids: list[int]) -> list[int]:
    out = list(ids)
    for _ in range(NEW_TOKENS):
        out.append(int(logits(model, out)[-1].argmax()))
    return out[len(ids):]


def main() -> None:
    from transformers import AutoTokenizer
    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    models = {}
    for name, int8 in (("float32", False), ("int8", True)):
        models[name] = load_model(None)
        assert models[name].pack_for_cpu(int8)
    ids = tok.encode(TEXT)
    print(f"fixed text: {len(ids)} tokens")
    per = {}
    for name, model in models.items():
        lg = logits(model, ids)[:-1]
        per[name] = lg
        nll = F.cross_entropy(lg, torch.tensor(ids[1:]))
        print(f"{name:>8}: perplexity {math.exp(float(nll)):.4f}")
    agree = (per["float32"].argmax(-1) == per["int8"].argmax(-1)).float().mean()
    print(f"next-token top-1 agreement along the text: {100 * float(agree):.1f}%")
    same, firsts = 0, []
    for p in PROMPTS:
        a, b = (greedy(models[n], tok.encode(p)) for n in ("float32", "int8"))
        same += a == b
        firsts.append(next((i for i in range(NEW_TOKENS) if a[i] != b[i]), NEW_TOKENS))
    print(f"greedy {NEW_TOKENS} tokens: {same} of {len(PROMPTS)} prompts identical; first "
          f"differing token (or {NEW_TOKENS}): {firsts}")


if __name__ == "__main__":
    main()
