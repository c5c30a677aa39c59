#!/usr/bin/env bash
# Ran at a5a4f14.
# Device call 3 (H200, a fresh machine, after the fixes): carries
# .whl and .dev/a. The CUDA tests that failed in run1 (spherical with 8-token pages).
cp .dev/a/part00 /tmp/
. benchmarks/results/h200/2026-11-27-b/setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/spec_phases/test_kv_cache_dtype.py \
    tests/spec_phases/test_lossy_kv_batched.py -k "cuda" 2>&1 | tee $OUT/tests-cuda-2.log | tail -6
