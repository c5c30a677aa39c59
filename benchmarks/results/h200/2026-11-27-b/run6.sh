#!/usr/bin/env bash
# Ran at 23e35bf.
# Device call 6 (H200, a fresh machine): carries .whl. The paged attention with fixed-length splits
# merged in order (batch-invariant), tf32 dots over the bf16 cache: its settings and the reference.
. benchmarks/results/h200/2026-11-27-b/setup.sh
timeout 150 python3 benchmarks/paged_attention_sweep.py --json $OUT/paged-attention-fixed.json \
    2>&1 | tee $OUT/paged-attention-fixed.log | tail -3
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/spec_phases/test_kv_cache_dtype.py \
    -k cuda 2>&1 | tee $OUT/tests-cuda-3.log | tail -2
