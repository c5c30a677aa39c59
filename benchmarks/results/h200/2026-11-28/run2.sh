#!/usr/bin/env bash
# Device call 2 of 2, right after run1.sh on the same warm machine: carries .whl and .dev/b (the
# GGUF's second half); the embedded model in bf16. HF parity and speculation on == off, a 2.8K
# prompt's TTFT and TPOT, and lossy_kv window and quant at 2.8K (k = 8 and FASER's adaptive).
# From the repository root: bash benchmarks/results/h200/2026-11-28/run2.sh
# Also carries .cache/ws: the pinned commit's files the long-context prompts come from
# (loadtests/workloads.py `pinned_sources`; the device's copy has no git history).
. benchmarks/results/h200/2026-11-27-b/setup.sh
ws=~/.cache/specserve/workload-sources
mkdir -p $ws && cp -r .cache/ws/* $ws/
SPECSERVE_TEST_DTYPE=float32 timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/e2e/test_greedy_vs_hf.py tests/e2e/test_speculation_real.py 2>&1 \
    | tee $OUT/e2e.log | tail -5
timeout 90 python3 benchmarks/kv_cache_dtype.py --device cuda --kv-cache-dtype auto \
    --prompt-len 2800 --output-len 64 --concurrency 1 4 --rounds 2 --kv-cache-memory-gb 4 \
    --json $OUT/kv-cache-dtype.json 2>&1 | tail -6
timeout 150 python3 benchmarks/adaptive_long_context.py --device cuda --context 2800 \
    --compressors window,quant --new-tokens 64 2>&1 \
    | tee $OUT/adaptive-long-context.log | tail -10
