# device run 2: FASER host cost after 5778af4 (new) against 7f36048's faser.py (old), chat batch 8
# (.dev/old/ was an ignored folder carried to the machine: gpu_probe.py is host_probe.py beside
# this file, faser.py 7f36048's scheduler/faser.py)
. benchmarks/results/h200/setup.sh > /dev/null
cp scheduler/faser.py /tmp/new.py; cp .dev/old/faser.py /tmp/old.py
echo "== probe new $(date +%T)"
timeout 120 python3 .dev/old/gpu_probe.py off ngram-adaptive ngram off ngram-adaptive ngram 2>&1 \
  | grep '^{'
cp /tmp/old.py scheduler/faser.py
echo "== probe old $(date +%T)"
timeout 60 python3 .dev/old/gpu_probe.py ngram-adaptive ngram-adaptive 2>&1 | grep '^{'
for v in new old new old; do
  cp /tmp/$v.py scheduler/faser.py; echo "== chat8 $v $(date +%T)"
  timeout 60 python3 benchmarks/speculation.py --device cuda --batch 8 --max-tokens 160 \
    --workloads chat --methods ngram ngram-adaptive 2>&1 | grep '^| chat'
done
cp /tmp/new.py scheduler/faser.py; echo "== end $(date +%T)"
