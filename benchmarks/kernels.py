"""Compressed-KV attention and encode kernels: Triton vs the PyTorch reference vs dense attention
(a benchmark, not a test; every timed variant is first checked against the reference).

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64) unless flags say otherwise. Per
context length T and queries per sequence Q (1 = decode, 9 = a verify pass of 8 drafts):
- `dense`: F.scaled_dot_product_attention over the full fp16/bf16 K and V (what the compressed
  cache competes with),
- `ref`: the PyTorch reference of the op, `kernel`: the Triton kernel (CUDA), or for paged
  attention on CPU the C kernel (`kernels/cpu/paged_attention.c`, float32),
plus the bytes each variant must read and the achieved bandwidth. Times are medians of CUDA-event
timings (`triton.testing.do_bench`) on GPU, of perf_counter loops on CPU.

    python benchmarks/kernels.py --contexts 1024 4096 16384 --queries 1 9 --json out.json
    python benchmarks/kernels.py --device cpu --ops paged --contexts 160 400 --queries 1 5 \
        --layers 30 --reps 20          # the C kernel over caches in DRAM, as in a decode step
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from specserve.kernels import dispatch
from specserve.kernels.reference.mustafar_encode import mustafar_encode as ref_mustafar_encode


def bench(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn()."""
    if device.startswith("cuda"):
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def spherical_inputs(heads: int, kv_heads: int, q: int, t: int, d: int, group: int, bits: int,
                     page: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(t * 31 + q)
    num_groups, codes = d // group, 2 ** bits
    cb = F.normalize(torch.randn(kv_heads, num_groups, codes, group, generator=g), dim=-1)
    keys = torch.randn(kv_heads, t, d, generator=g) * (1 + torch.rand(kv_heads, t, 1, generator=g))
    theta, radius, scale = dispatch.reference("spherical_encode")(keys, cb, page)
    v = torch.randn(kv_heads, t, d, generator=g)
    query = torch.randn(q, heads, d, generator=g)
    to = dict(device=device)
    return (query.to(**to), theta.to(**to), radius.to(**to), scale.to(**to), cb.to(**to),
            v.to(device=device, dtype=dtype)), keys


def bitmap_inputs(heads: int, kv_heads: int, q: int, t: int, d: int, sparsity: float, device: str):
    g = torch.Generator(device="cpu").manual_seed(t * 17 + q)
    nb = t // 64
    keys, vals = torch.randn(kv_heads, t, d, generator=g), torch.randn(kv_heads, t, d, generator=g)
    for x in (keys, vals):                     # per-token magnitude pruning, as Mustafar does
        thresh = x.abs().quantile(sparsity, dim=-1, keepdim=True)
        x[x.abs() < thresh] = 0
    kb, ko, kv = ref_mustafar_encode(
        keys.reshape(kv_heads, nb, 64, d).transpose(2, 3).reshape(-1, 64))
    vb, vo, vv = ref_mustafar_encode(vals.reshape(-1, 64))
    args = (kb.view(kv_heads, nb, d), ko.view(kv_heads, nb, d), kv,
            vb.view(kv_heads, t, d // 64), vo.view(kv_heads, t, d // 64), vv)
    query = torch.randn(q, heads, d, generator=g)
    return (query.to(device), *(a.to(device) for a in args)), keys, vals


def dense_fn(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """query [Q, Hq, D]; k, v [H, T, D]: one sequence's decode/verify attention over dense KV."""
    qb = query.transpose(0, 1)[None].to(k.dtype)
    kb, vb = k[None], v[None]
    return lambda: F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=True)


def paged_inputs(batch: int, q: int, t: int, heads: int, kv_heads: int, d: int, device: str,
                 dtype: torch.dtype):
    """A batch of `batch` requests with `t` tokens of context each, `q` new query rows each, in a
    paged cache of 16-token blocks scattered at random."""
    from specserve.kernels.metadata import PagedAttentionMetadata
    g = torch.Generator(device="cpu").manual_seed(batch * t + q)
    bs, per = 16, -(-t // 16)
    perm = torch.randperm(batch * per, generator=g).tolist()
    tables = [perm[b * per:(b + 1) * per] for b in range(batch)]
    k = torch.randn(batch * per * bs, kv_heads, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch * per * bs, kv_heads, d, generator=g).to(device=device, dtype=dtype)
    query = torch.randn(batch * q, heads, d, generator=g).to(device=device, dtype=dtype)
    meta = lambda: PagedAttentionMetadata(  # noqa: E731
        [b * q for b in range(batch + 1)], [t] * batch, tables, bs, device)
    return query, k, v, meta


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.7)
    ap.add_argument("--batch", type=int, default=16, help="requests in the paged-attention rows")
    ap.add_argument("--reps", type=int, default=5, help="CPU repetitions per timing")
    ap.add_argument("--layers", type=int, default=1,
                    help="CPU paged attention: caches of this many layers, timed per layer")
    ap.add_argument("--ops", nargs="+", default=["compressed", "paged", "encode"],
                    choices=["compressed", "paged", "encode"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    d, scale = args.head_dim, 1 / math.sqrt(args.head_dim)
    rows = []
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}  torch {torch.__version__}")
    for t in args.contexts:
        for q in args.queries if "compressed" in args.ops else []:
            # ---- Spherical-KV tier T1 (group 16, 6-bit codes) ----
            sph, keys = spherical_inputs(args.heads, args.kv_heads, q, t, d, 16, 6, 128, dev, dtype)
            ref = dispatch.reference("spherical_attention")
            out_ref, _ = ref(*sph, scale, 128)
            k_dense = keys.to(device=dev, dtype=dtype)
            v_dense = sph[5]
            dense = dense_fn(sph[0], k_dense, v_dense, scale)
            row = {"op": "spherical_attention", "T": t, "Q": q,
                   "dense_ms": bench(dense, dev, args.reps),
                   "ref_ms": bench(lambda: ref(*sph, scale, 128), dev, args.reps),
                   "dense_bytes": nbytes(k_dense, v_dense), "bytes": nbytes(*sph[1:4], v_dense)}
            if cuda:
                fast = dispatch.triton_kernel("spherical_attention")
                out, _ = fast(*sph, scale, 128)
                row["triton_rel_err"] = rel_err(out, out_ref)
                row["triton_ms"] = bench(lambda: fast(*sph, scale, 128), dev, args.reps)
            rows.append(row)
            # ---- Mustafar bitmap sparsity ----
            bm, keys, vals = bitmap_inputs(args.heads, args.kv_heads, q, t, d, args.sparsity, dev)
            ref = dispatch.reference("mustafar_attention")
            out_ref, _ = ref(*bm, scale)
            k_dense, v_dense = keys.to(device=dev, dtype=dtype), vals.to(device=dev, dtype=dtype)
            dense = dense_fn(bm[0], k_dense, v_dense, scale)
            row = {"op": "mustafar_attention", "T": t, "Q": q,
                   "dense_ms": bench(dense, dev, args.reps),
                   "ref_ms": bench(lambda: ref(*bm, scale), dev, args.reps),
                   "dense_bytes": nbytes(k_dense, v_dense), "bytes": nbytes(*bm[1:])}
            if cuda:
                fast = dispatch.triton_kernel("mustafar_attention")
                out, _ = fast(*bm, scale)
                row["triton_rel_err"] = rel_err(out, out_ref)
                row["triton_ms"] = bench(lambda: fast(*bm, scale), dev, args.reps)
            rows.append(row)
        # ---- paged attention over a batch of requests (one layer) ----
        for q in args.queries if "paged" in args.ops else []:
            query, kc, vc, meta = paged_inputs(args.batch, q, t, args.heads, args.kv_heads, d, dev,
                                               dtype)
            ref = dispatch.reference("paged_attention")
            out_ref = ref(query, kc, vc, meta(), scale)
            m_ref = meta()
            row = {"op": f"paged_attention_b{args.batch}", "T": t, "Q": q,
                   "ref_ms": bench(lambda: ref(query, kc, vc, m_ref, scale), dev, args.reps),
                   "bytes": nbytes(kc, vc)}
            if cuda:
                fast = dispatch.triton_kernel("paged_attention")
                row["triton_rel_err"] = rel_err(fast(query, kc, vc, meta(), scale), out_ref)
                m_fast = meta()
                row["triton_ms"] = bench(lambda: fast(query, kc, vc, m_fast, scale), dev, args.reps)
            else:                                  # the C kernel (kernels/cpu/paged_attention.c)
                fast = dispatch.cpu_kernel("paged_attention")
                row["cpu_rel_err"] = rel_err(fast(query, kc, vc, meta(), scale), out_ref)
                m_fast = meta()
                # one copy of the cache per layer, each call over all of them in turn: with
                # --layers 30 the caches outgrow the last-level cache, as in a model's step
                caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(args.layers - 1)]
                step = lambda: [fast(query, k, v, m_fast, scale) for k, v in caches]  # noqa: E731
                row["cpu_ms"] = bench(step, dev, args.reps) / args.layers
            rows.append(row)
        # ---- encoders: one layer's new pages for all KV heads ----
        if "encode" not in args.ops:
            continue
        g = torch.Generator(device="cpu").manual_seed(t)
        keys = torch.randn(args.kv_heads, t, d, generator=g).to(dev)
        cb = F.normalize(torch.randn(args.kv_heads, d // 16, 64, 16, generator=g), dim=-1).to(dev)
        ref = dispatch.reference("spherical_encode")
        row = {"op": "spherical_encode", "T": t, "Q": 0,
               "ref_ms": bench(lambda: ref(keys, cb, 128), dev, args.reps),
               "bytes": nbytes(keys)}
        if cuda:
            fast = dispatch.triton_kernel("spherical_encode")
            a, b = ref(keys, cb, 128), fast(keys, cb, 128)
            row["triton_theta_match"] = float((a[0] == b[0]).float().mean())
            row["triton_ms"] = bench(lambda: fast(keys, cb, 128), dev, args.reps)
        rows.append(row)
        tiles = torch.randn(args.kv_heads * t * d // 64, 64, generator=g)
        tiles[tiles.abs() < tiles.abs().quantile(args.sparsity, dim=-1, keepdim=True)] = 0
        tiles = tiles.half().to(dev)
        ref = dispatch.reference("mustafar_encode")
        row = {"op": "mustafar_encode", "T": t, "Q": 0,
               "ref_ms": bench(lambda: ref(tiles), dev, args.reps),
               "bytes": nbytes(tiles)}
        if cuda:
            fast = dispatch.triton_kernel("mustafar_encode")
            row["triton_exact"] = all(torch.equal(x, y) for x, y in zip(ref(tiles), fast(tiles)))
            row["triton_ms"] = bench(lambda: fast(tiles), dev, args.reps)
        rows.append(row)

    print(f"{'op':20} {'T':>6} {'Q':>2} {'dense ms':>9} {'ref ms':>9} {'kernel ms':>9} "
          f"{'ker/dense':>9} {'ref/ker':>8} {'bytes/dense':>11} {'ker GB/s':>8} {'check':>10}")
    for r in rows:
        tri = r.get("triton_ms", r.get("cpu_ms"))               # the kernel: Triton, or C on CPU
        check = r.get("triton_rel_err", r.get("triton_theta_match",
                                             r.get("triton_exact", r.get("cpu_rel_err", ""))))
        shown = format(check, ".2e") if isinstance(check, float) else str(check)[:10]
        fmt = lambda x, f="9.3f": (format(x, f) if isinstance(x, (int, float))  # noqa: E731
                                   else format("-", ">9"))
        print(f"{r['op']:20} {r['T']:>6} {r['Q']:>2} {fmt(r.get('dense_ms'))} {fmt(r['ref_ms'])} "
              f"{fmt(tri)} {fmt(tri / r['dense_ms'] if tri and r.get('dense_ms') else None)} "
              f"{fmt(r['ref_ms'] / tri if tri else None, '8.2f')} "
              f"{fmt(r['bytes'] / r['dense_bytes'] if r.get('dense_bytes') else None, '11.3f')} "
              f"{fmt(r['bytes'] / tri / 1e6 if tri else None, '8.1f')} {shown:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
