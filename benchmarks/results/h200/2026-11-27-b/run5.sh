#!/usr/bin/env bash
# Device call 5 (H200, a fresh machine): carries .whl. The Triton paged attention's settings.
# Ran at 133a55c, whose sweep varied the old split plan (floor, target) and the dot precision:
# `git show 133a55c:benchmarks/paged_attention_sweep.py` for that script.
. benchmarks/results/h200/2026-11-27-b/setup.sh
timeout 220 python3 benchmarks/paged_attention_sweep.py --json $OUT/paged-attention-sweep.json \
    2>&1 | tee $OUT/paged-attention-sweep.log | tail -3
