# device run: FASER old/new A/B on the GPU, graphs regression, e2e float32
# (.dev/old/faser.py: 7f36048's scheduler/faser.py, in an ignored folder carried to the machine)
. benchmarks/results/h200/setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
cp scheduler/faser.py /tmp/new.py; cp .dev/old/faser.py /tmp/old.py
for v in new old new old; do
  cp /tmp/$v.py scheduler/faser.py
  echo "== speculation $v $(date +%T)"
  timeout 150 python3 benchmarks/speculation.py --device cuda --batch 1 8 --max-tokens 48 \
    --methods ngram ngram-adaptive --json $OUT/spec-$v-$SECONDS.json 2>&1 | tail -14
done
cp /tmp/new.py scheduler/faser.py
echo "== graphs $(date +%T)"
timeout 120 python3 benchmarks/cuda_graphs.py --concurrency 1 16 64 --rounds 1 \
  --json $OUT/cuda-graphs.json 2>&1 | tail -8
echo "== e2e $(date +%T)"
SPECSERVE_TEST_DTYPE=float32 timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/e2e/test_greedy_vs_hf.py tests/e2e/test_speculation_real.py 2>&1 | tail -5
echo "== end $(date +%T)"
