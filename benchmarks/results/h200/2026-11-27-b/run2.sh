#!/usr/bin/env bash
# Ran at c25d7e4.
# Device call 2 of 2 (H200), right after run1.sh on the same warm machine: carries .whl and .dev/b
# (the GGUF's second half); the embedded model in bf16. HF parity and spec on == off, the full
# cache in bf16 (auto) against fp8 at 2.8K context, and lossy_kv per compressor at 2.8K.
# From the repository root: bash benchmarks/results/h200/2026-11-27-b/run2.sh
. benchmarks/results/h200/2026-11-27-b/setup.sh
SPECSERVE_TEST_DTYPE=float32 timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/e2e/test_greedy_vs_hf.py tests/e2e/test_speculation_real.py 2>&1 \
    | tee $OUT/e2e.log | tail -5
timeout 120 python3 benchmarks/kv_cache_dtype.py --device cuda --kv-cache-dtype auto fp8 \
    --prompt-len 2800 --output-len 64 --concurrency 1 --rounds 2 --kv-cache-memory-gb 4 \
    --json $OUT/kv-cache-dtype-c1.json 2>&1 | tail -8
timeout 60 python3 benchmarks/kv_cache_dtype.py --device cuda --kv-cache-dtype auto fp8 \
    --prompt-len 2800 --output-len 64 --kv-cache-memory-gb 4 --accuracy \
    --json $OUT/kv-cache-dtype-accuracy.json 2>&1 | tail -4
timeout 200 python3 benchmarks/adaptive_long_context.py --device cuda --context 2800 \
    --compressors window,quant,spherical,mustafar --new-tokens 64 2>&1 \
    | tee $OUT/adaptive-long-context.log | tail -12
