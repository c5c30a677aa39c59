"""KV compressor quality on the embedded model: bytes/token vs attention error vs next-token
agreement.

    HF_HUB_OFFLINE=1 python benchmarks/compress_quality.py [--context 2048] [--eval 256] \
        [--out docs]

Method (teacher-forced, VeriCache semantics). One full-cache forward over the context gives every
layer's exact post-RoPE K/V and the reference greedy tokens. Then, for each compressor, the last
`--eval` positions are re-run with a small functional Llama forward (HF's own modules: RMSNorm,
RoPE, GQA, SwiGLU) in chunks of `--chunk` queries, every layer attending over
    compressor state of the tokens before the chunk (sinks + compressed pages + dense window)
  + the exact K/V of earlier tokens in the chunk (just-verified tokens, dense)
  + the query token's own K/V (computed from its drafted hidden state)
merged by log-sum-exp. Cached tokens hold exact K/V (the verifier writes them), as in VeriCache;
only the query's own forward sees the lossy cache. Metrics per setting:
  bytes%      compressed pages after the prefix: page bytes / fp16 K+V bytes of those tokens
  cache%      whole cache after the prefix (sinks + window dense): state_bytes / fp16 bytes
  attn_err    mean over layers and positions of |o - o_full| / |o_full| (same query, full cache)
  agree       share of positions whose argmax equals the full-cache argmax
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specserve.kernels.reference.attention import dense_attention, merge_attention  # noqa: E402
from specserve.kv_cache.compress.base import CompressorConfig  # noqa: E402
from specserve.kv_cache.compress.mustafar import MustafarCompressor  # noqa: E402
from specserve.kv_cache.compress.quant import QuantCompressor  # noqa: E402
from specserve.kv_cache.compress.spherical import SphericalCompressor  # noqa: E402
from specserve.kv_cache.compress.spherical_calib import (  # noqa: E402
    collect_keys, load_or_calibrate, local_texts)
from specserve.kv_cache.compress.window import WindowCompressor  # noqa: E402


def load_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specserve.spec_phases.paths import embedded_model_path
    p = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return p, model, tok


def eval_text() -> str:
    """transformers' own README (its METADATA), which calibration never sees (`local_texts`
    excludes it)."""
    import importlib.metadata as md
    return md.distribution("transformers").read_text("METADATA").split("\n\n", 1)[-1]


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """Each query attends only to its own key: q [n, Hq, D], k, v [n, H, D] -> (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return v.float(), (q * k).sum(-1) * sm_scale


def run_chunk(model, comp, state, ids, start, kv_exact, errs):
    """Functional forward of tokens ids[start:start+n] over the compressed state -> logits
    [n, V]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    cfg = model.config
    n, d = ids.shape[0], cfg.head_dim
    pos = torch.arange(start, start + n)
    h = model.model.embed_tokens(ids)[None]                                    # [1, n, hidden]
    cos, sin = model.model.rotary_emb(h, pos[None])
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        x = block.input_layernorm(h)
        q = attn.q_proj(x).view(1, n, -1, d).transpose(1, 2)                   # [1, Hq, n, D]
        k = attn.k_proj(x).view(1, n, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(1, n, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)   # [n, heads, D]
        ek, ev = kv_exact[layer]                                               # [T, H, D] exact
        chunk = dense_attention(q, ek[start:start + n], ev[start:start + n], comp.sm_scale, pos,
                                pos + 1)
        own = self_attention(q, k, v, comp.sm_scale)
        out, _ = merge_attention([comp.attend(state, layer, q), chunk, own])
        # RDR: attention-mass feedback
        if getattr(comp, "budget_bits", None):
            comp.observe(state, layer, comp.page_attention_mass(state, layer, q))
        full, _ = merge_attention([dense_attention(q, ek[:start], ev[:start], comp.sm_scale),
                                   chunk, own])
        errs.append(((out - full).norm(dim=-1) / full.norm(dim=-1)).mean().item())
        h = h + attn.o_proj(out.reshape(1, n, -1))
        h = h + block.mlp(block.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))[0]


def observation_queries(model, hidden_states, start: int, end: int) -> list[torch.Tensor]:
    """Post-RoPE queries [end - start, Hq, D] of prefix positions [start, end) for every layer,
    from the full run's layer inputs: the prefill attention-mass prior RDR uses (an observation
    window)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    pos = torch.arange(start, end)[None]
    queries = []
    for layer, block in enumerate(model.model.layers):
        x = block.input_layernorm(hidden_states[layer][:, start:end])
        q = block.self_attn.q_proj(x).view(1, end - start, -1,
                                           model.config.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, pos)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        queries.append(q[0].transpose(0, 1))
    return queries


def encode_prefix(comp, state, kv_exact, first, obs_queries) -> None:
    """Encode the prefix; an RDR compressor first sees every page at T1, gets the observation
    window's attention mass per page, and only then applies its budget."""
    budget = getattr(comp, "budget_bits", None)
    if budget:
        comp.set_retention(budget_bits=None)
    for layer, (ek, ev) in enumerate(kv_exact):
        comp.encode(state, layer, ek[:first], ev[:first])
    if budget:
        for layer, q in enumerate(obs_queries):
            comp.observe(state, layer, comp.page_attention_mass(state, layer, q), decay=0.0)
        comp.set_retention(budget_bits=budget, state=state)


def evaluate(model, comp, ids, kv_exact, ref_tokens, context, num_eval, chunk, obs_queries):
    state = comp.new_state(dtype=torch.float16)
    first = context - num_eval
    with torch.no_grad():
        encode_prefix(comp, state, kv_exact, first, obs_queries)
    dense = comp.config.dense_bytes_per_token()
    cache_ratio = comp.state_bytes(state) / (first * len(kv_exact) * dense)
    pages = [p for ls in state.layers for p in ls.pages]             # measured, so RDR counts
    page_ratio = sum(comp.page_bytes(p) for p in pages) / max(
        1, len(pages) * comp.config.page_size * dense)
    errs, agree = [], 0
    with torch.no_grad():
        for start in range(first, context, chunk):
            n = min(chunk, context - start)
            logits = run_chunk(model, comp, state, ids[start:start + n], start, kv_exact, errs)
            agree += int((logits.argmax(-1) == ref_tokens[start - first:start - first + n]).sum())
            for layer, (ek, ev) in enumerate(kv_exact):
                comp.encode(state, layer, ek[start:start + n], ev[start:start + n])
    return {"name": comp.name, "bytes": page_ratio,
            "cache": cache_ratio, "attn_err": sum(errs) / len(errs), "agree": agree / num_eval}


def settings(cfg: CompressorConfig, books):
    # nothing compressed
    full = WindowCompressor(CompressorConfig(**{**cfg.__dict__, "window": 1 << 20}))
    full.name = "full-fp16"                                                           # (sanity row)
    yield full
    for window in (128, 192, 448):
        w = WindowCompressor(CompressorConfig(**{**cfg.__dict__, "window": window}))
        w.name = f"window-sink4-recent{window}"
        yield w
    for kb, vb in ((8, 8), (4, 4), (4, 2), (2, 2)):
        yield QuantCompressor(cfg, kb, vb)
    for tier, vbits in ((1, 16), (1, 8), (1, 4), (2, 4), (3, 4)):
        yield SphericalCompressor(cfg, books, tier=tier, value_bits=vbits)
    dense_bits = cfg.dense_bytes_per_token() * 8
    for vbits, share in ((8, 0.20), (4, 0.12)):              # RDR budget as a share of fp16
        rdr = SphericalCompressor(cfg, books, tier=1, value_bits=vbits,
                                  budget_bits=share * dense_bits)
        rdr.name = f"spherical-T1-v{vbits}-rdr{round(100 * share)}"
        yield rdr
    for ks, vs in ((0.5, 0.5), (0.7, 0.7), (0.8, 0.8), (0.85, 0.85)):
        yield MustafarCompressor(cfg, ks, vs)


def plot(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family, marker in (("window", "s"), ("int", "^"), ("spherical", "o"), ("mustafar", "D")):
        pts = [r for r in rows if r["name"].startswith(family)]
        ax.scatter([100 * r["cache"] for r in pts], [100 * r["agree"] for r in pts], marker=marker,
                   label=family)
    ax.axvline(25, color="grey", ls=":", lw=1)
    ax.axhline(90, color="grey", ls=":", lw=1)
    ax.set_xlabel("whole KV cache after the 1,792-token prefix, % of fp16 "
                  "(sinks + window included)")
    ax.set_ylabel("next-token agreement with full cache, %")
    ax.set_title("SmolLM2-135M, 256 teacher-forced positions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows) -> str:
    lines = ["| setting | compressed pages, % of fp16 | whole cache after the prefix, % of fp16 "
             "| attn-output rel. error | next-token agreement |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["cache"]):
        lines.append(f"| {r['name']} | {100 * r['bytes']:.1f} | {100 * r['cache']:.1f} "
                     f"| {r['attn_err']:.4f} | {100 * r['agree']:.1f}% |")
    return "\n".join(lines)


def render(json_files: list[str], out_dir: Path) -> None:
    """Merge result files of several (parallel) runs into one JSON, a Markdown table and the
    plot."""
    rows = [r for f in json_files for r in json.loads(Path(f).read_text())]
    (out_dir / "img").mkdir(parents=True, exist_ok=True)
    (out_dir / "img" / "compress_quality.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out_dir / "img" / "compress_quality.png")
    print(table(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--eval", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=6144)
    ap.add_argument("--out", default="docs")
    ap.add_argument("--only", default="",
                    help="comma-separated setting names to run (default: all)")
    ap.add_argument("--render", nargs="*", help="only merge these result JSON files into --out")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.render:
        return render(args.render, Path(args.out))
    torch.manual_seed(0)
    t0 = time.time()
    path, model, tok = load_model()
    cfg_m = model.config
    cfg = CompressorConfig(num_layers=cfg_m.num_hidden_layers,
                           num_kv_heads=cfg_m.num_key_value_heads,
                           head_dim=cfg_m.head_dim, num_sink=4, window=64, page_size=64)

    def calib_keys():
        ids = torch.tensor(
            tok(local_texts(60 * args.calib_tokens))["input_ids"][: args.calib_tokens])
        return collect_keys(model, list(ids.split(2048)))

    from specserve.spec_phases.paths import cache_dir
    books = load_or_calibrate(path, calib_keys, f"tokens={args.calib_tokens}", cache_dir())
    ids = torch.tensor(tok(eval_text())["input_ids"][: args.context])
    assert ids.numel() == args.context, f"eval text has only {ids.numel()} tokens"
    with torch.no_grad():
        out = model(ids[None], use_cache=True, output_hidden_states=True)
        first = args.context - args.eval
        obs_queries = observation_queries(model, out.hidden_states, first - 64, first)
        out.hidden_states = None
    ref_tokens = out.logits[0, args.context - args.eval:].argmax(-1)
    kv_exact = [(layer.keys[0].transpose(0, 1).contiguous(),
                 layer.values[0].transpose(0, 1).contiguous())
                for layer in out.past_key_values.layers]                      # [T, H, D] per layer
    print(f"setup {time.time() - t0:.0f}s", flush=True)
    rows = []
    for comp in settings(cfg, books):
        if args.only and not any(part == comp.name for part in args.only.split(",")):
            continue
        t = time.time()
        row = evaluate(model, comp, ids, kv_exact, ref_tokens, args.context, args.eval, args.chunk,
                       obs_queries)
        rows.append(row)
        print(json.dumps(row), f"{time.time() - t:.0f}s", flush=True)
    out_dir = Path(args.out)
    (out_dir / "img").mkdir(parents=True, exist_ok=True)
    (out_dir / "img" / "compress_quality.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out_dir / "img" / "compress_quality.png")
    print(table(rows))


if __name__ == "__main__":
    main()
