"""First-start calibration time (Spherical-KV codebooks, layer_skip's skip set) on an empty cache.

Runs each calibration as the engine does at first start (the embedded model unless MODEL is given),
with SPECSERVE_CACHE_DIR pointed at a fresh temporary directory, then once more from the cache.
CPU-heavy for a few seconds to a minute: run it alone.

    python benchmarks/first_start.py [MODEL] [--only spherical|layer_skip]
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--only", choices=["spherical", "layer_skip"], default=None)
    args = ap.parse_args()
    os.environ["SPECSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="specserve-first-start-")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    from specserve.spec_phases.calibration import build_compressor
    from specserve.spec_phases.loader import load_model
    from specserve.spec_phases.proposers.layer_skip import default_skip_layers
    model = load_model(args.model)
    model.pack_for_cpu()                                # as the engine does on CPU
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    if args.only in (None, "spherical"):
        for when in ("first start", "cached"):
            start = time.perf_counter()
            comp = build_compressor("spherical", model, {})
            print(f"spherical ({comp.name}) {when}: {time.perf_counter() - start:.1f}s", flush=True)
    if args.only in (None, "layer_skip"):
        for when in ("first start", "cached"):
            start = time.perf_counter()
            skip = default_skip_layers(args.model, model, 4)
            print(f"layer_skip {when}: {time.perf_counter() - start:.1f}s, skip {list(skip)}",
                  flush=True)


if __name__ == "__main__":
    main()
