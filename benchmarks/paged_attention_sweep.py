"""The Triton paged attention's launch settings on a GPU (a benchmark, not a test): each variant
changes module constants of `kernels/triton/paged_attention.py` (the dots' precision over the
bf16 cache, keys a program scores at a time, warps, pipeline stages, the splits' length), is
checked against the reference, and timed with
`triton.testing.do_bench` (median ms, one layer: the kernel, its merge and the host launches).

    python3 benchmarks/paged_attention_sweep.py --json out.json

Shapes: SmolLM2-135M's heads (9 query, 3 KV, head_dim 64), a bf16 cache of 16-token blocks
scattered at random; `--cases` are requests x context tokens; Q = query rows a request (1 =
decode, 9 = a verify pass of 8 drafts).
"""
from __future__ import annotations

import argparse
import json

import torch
from kernels import paged_inputs, rel_err

from specserve.kernels import dispatch
from specserve.kernels.triton import paged_attention as pa

# name -> {module constant: value}, applied on top of the defaults
VARIANTS = {
    "default": {},
    "ieee": {"NARROW_DOT": "ieee"},
    "split256": {"SPLIT_TOKENS": 256},
    "split1024": {"SPLIT_TOKENS": 1024},
    "split2048": {"SPLIT_TOKENS": 2048},
    "bn128": {"BN": 128},
    "warps8": {"NUM_WARPS": 8},
    "stages2": {"NUM_STAGES": 2},
}


def apply(settings: dict, defaults: dict) -> None:
    for name, value in {**defaults, **settings}.items():
        setattr(pa, name, value)


def main() -> None:
    import triton.testing
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["1x2816", "1x8192", "16x2816", "16x65536"])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--device", default="cuda",
                    help="cpu: a dry run under TRITON_INTERPRET=1 (timings meaningless)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = {n for v in VARIANTS.values() for n in v}
    defaults = {n: getattr(pa, n) for n in names}
    dev = args.device
    print(json.dumps({"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                      "torch": torch.__version__,
                      "triton": triton.__version__, "defaults": defaults}), flush=True)
    ref, rows = dispatch.reference("paged_attention"), []
    for case in args.cases:
        batch, t = map(int, case.split("x"))
        for q in args.queries:
            query, kc, vc, meta = paged_inputs(batch, q, t, 9, 3, 64, dev, torch.bfloat16)
            want = ref(query, kc, vc, meta(), 0.125)
            if dev == "cuda":
                m = meta()
                ms = triton.testing.do_bench(lambda: ref(query, kc, vc, m, 0.125), warmup=25,
                                             rep=100, return_mode="median")
                rows.append({"requests": batch, "T": t, "Q": q, "variant": "reference",
                             "ms": round(float(ms), 4), "rel_err": 0.0})
                print(json.dumps(rows[-1]), flush=True)
            for name in args.variants:
                apply(VARIANTS[name], defaults)
                m = meta()
                got = pa.paged_attention(query, kc, vc, m, 0.125)
                err = rel_err(got.float(), want.float())
                ms = float(triton.testing.do_bench(
                    lambda: pa.paged_attention(query, kc, vc, m, 0.125), warmup=25, rep=100,
                    return_mode="median")) if dev == "cuda" else 0.0
                row = {"requests": batch, "T": t, "Q": q, "variant": name, "ms": round(ms, 4),
                       "rel_err": float(f"{err:.2e}")}
                rows.append(row)
                print(json.dumps(row), flush=True)
                assert err < 2e-2, row
    apply({}, defaults)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
