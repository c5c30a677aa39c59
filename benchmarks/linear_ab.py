"""Two builds of the CPU linear layer (`kernels/cpu/linear.c` from two source folders, e.g. a
worktree of an older commit and this checkout) alternated in one process on the embedded model's
own weights as a step streams them: every layer's qkv, o, gate-up and down projections (30
layers, 66 MB of GGUF blocks in the int8-activation layouts the server packs) one call after
another, then the LM head (30 MB), so the weights come from memory as in a decode step, not
from cache as in `linear_i8.py`'s one-weight loop. A benchmark, not a test. Prints each build's
median time of the layers and of the head by rows, their ratio, and whether the two computed
the same bits. The times include a ctypes call per weight (a few microseconds each).

    git worktree add /tmp/old HEAD~1
    python benchmarks/linear_ab.py /tmp/old/kernels/cpu kernels/cpu --rows 1 4 9
"""
from __future__ import annotations

import time

import torch

from kernel_ab import alternate, builds, parser
from specserve.kernels.cpu import linear as cpu_linear
from specserve.spec_phases.loader import load_model


def main() -> None:
    ap = parser(__doc__.split("\n")[0], "linear.c", alternations=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9])
    args = ap.parse_args()
    fns = {tag: cpu_linear.bind(lib).linear_forward
           for tag, lib in builds(args.a, args.b, "linear.c").items()}
    torch.set_num_threads(args.threads)
    model = load_model(None)
    model.pack_for_cpu(int8=True)
    parts = {"layers": [lin.packed for layer in model.layers
                        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                    layer.down_proj)],
             "head": [model._lm_head_packed]}
    for name, weights in parts.items():
        size = sum(w.data.numel() * w.data.element_size() for w in weights) / 1e6
        print(f"{name}: {len(weights)} weights, {size:.1f} MB, layout {weights[0].layout}")
    for rows in args.rows:
        for name, weights in parts.items():
            calls = [(torch.randn(rows, w.in_features), w, torch.empty(rows, w.out_features))
                     for w in weights]

            def run(tag: str) -> float:
                fn, start = fns[tag], time.perf_counter()
                for x, w, out in calls:
                    if fn(x.data_ptr(), rows, w.in_features, w.data.data_ptr(),
                          cpu_linear.LAYOUTS[w.layout], w.out_features, None, out.data_ptr(),
                          args.threads):
                        raise MemoryError("linear_forward: no memory")
                return (time.perf_counter() - start) * 1e3

            run("A")
            want = [out.clone() for _, _, out in calls]
            run("B")
            same = all(torch.equal(w, out) for w, (_, _, out) in zip(want, calls))
            a, b = alternate(run, args.alternations)
            print(f"rows {rows} {name}: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f}, "
                  f"same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
