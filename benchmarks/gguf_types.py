"""A Q4_K_M-like GGUF served from its blocks: a random-weight Llama of SmolLM2-135M's size in a
K-quant-friendly shape (hidden 768, 12 layers), Q4_K q/k/o/gate/up and token embedding, Q6_K
v/down and LM head (as llama.cpp's Q4_K_M mixes them), written once; then the engine's output
tokens/s and weight bytes a step with int8 activations (`--dtype auto`: every tensor from its
blocks) and float32 ones (`--dtype float32`: Q4_K from its blocks, Q6_K dequantized), alternated.
A benchmark, not a test.

    python benchmarks/gguf_types.py [--out /tmp/q4_k_m.gguf] [--rounds 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from throughput import run

SHAPE = dict(hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4, vocab=49152)
BLOCK = {"Q4_K": (144, [0, 2]), "Q6_K": (210, [208])}      # bytes per 256, float16 fields


def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    nbytes, fields = BLOCK[kind]
    raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    for at in fields:
        scale = rng.uniform(2e-4, 1e-3, raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write(path: Path) -> None:
    import gguf
    s, rng = SHAPE, np.random.default_rng(0)
    head_dim = s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    t = gguf.GGMLQuantizationType

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        raw = random_blocks(kind, rows, cols, rng)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t[kind])
    add("token_embd.weight", "Q4_K", s["vocab"], s["hidden"])
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        for leaf, kind, rows, cols in (
                ("attn_q", "Q4_K", s["hidden"], s["hidden"]), ("attn_k", "Q4_K", kv, s["hidden"]),
                ("attn_v", "Q6_K", kv, s["hidden"]),
                ("attn_output", "Q4_K", s["hidden"], s["hidden"]),
                ("ffn_gate", "Q4_K", s["intermediate"], s["hidden"]),
                ("ffn_up", "Q4_K", s["intermediate"], s["hidden"]),
                ("ffn_down", "Q6_K", s["hidden"], s["intermediate"])):
            add(f"blk.{i}.{leaf}.weight", kind, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(s["hidden"], dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    add("output.weight", "Q6_K", s["vocab"], s["hidden"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    from specserve.scheduler.config import EngineConfig
    from specserve.scheduler.engine import EngineCore
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/specserve-q4_k_m.gguf"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    if not args.out.exists():
        write(args.out)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB")
    print(f"{'round':>5} {'dtype':>8} {'MB a step':>10} "
          + " ".join(f"{f'c={c} tok/s':>12}" for c in args.concurrency))
    for rnd in range(args.rounds):
        for dtype in ("float32", "auto"):
            core = EngineCore(EngineConfig(model=str(args.out), dtype=dtype,
                                           kv_cache_memory_gb=1.0,
                                           max_num_seqs=max(args.concurrency)))
            run(core, max(args.concurrency), 32, 8)                       # warm-up
            rates = [run(core, c, 128, 64)["output_tokens_per_s"] for c in args.concurrency]
            print(f"{rnd + 1:>5} {dtype:>8} {core.worker.weight_bytes / 1e6:>10.1f} "
                  + " ".join(f"{r:>12.1f}" for r in rates), flush=True)
            del core


if __name__ == "__main__":
    main()
