#!/usr/bin/env bash
# Device call 1 of 2: carries .whl and .dev/a (the embedded GGUF's first half, kept in /tmp for
# call 2; setup as on 2026-11-27: ../2026-11-27-b/setup.sh). The tiny random models: the CUDA
# tests (the tf32-for-16-bit-queries rule of 3fcd187, prompt rows in the Triton kernel's tiles),
# then the paged attention on prompt chunks, the kernel's tiles against the reference's SDPA.
# From the repository root: bash benchmarks/results/h200/2026-11-28/run1.sh
cp .dev/a/part00 /tmp/
. benchmarks/results/h200/2026-11-27-b/setup.sh
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
git log -1 --format=%h 2>/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/spec_phases/test_kv_cache_dtype.py \
    tests/spec_phases/test_lossy_kv_batched.py tests/spec_phases/test_cuda_graphs.py \
    tests/kernels/test_paged_attention_triton.py -k "cuda or graph" 2>&1 \
    | tee $OUT/tests-cuda.log | tail -12
timeout 100 python3 benchmarks/paged_attention_sweep.py --cases 1x2816 1x8192 4x2816 \
    --queries 1 9 512 2048 --variants default --json $OUT/prompt-chunks.json 2>&1 \
    | tee $OUT/prompt-chunks.log | tail -14
