#!/usr/bin/env bash
# Ran at a5a4f14.
# Device call 4 (H200), right after run3.sh: carries .whl and .dev/b. lossy_kv per compressor at
# 2.8K with the full cache resident (the default since the host pool became opt-in).
. benchmarks/results/h200/2026-11-27-b/setup.sh
timeout 200 python3 benchmarks/adaptive_long_context.py --device cuda --context 2800 \
    --compressors window,quant,spherical --new-tokens 64 2>&1 \
    | tee $OUT/adaptive-long-context-resident.log | tail -12
