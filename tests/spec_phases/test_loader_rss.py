"""Peak host memory while a real-sized safetensors checkpoint loads: a test writes ~0.5 GB of random
bfloat16 weights (a Llama of 12 layers, hidden 1024, vocab 32,000, untied head), and a fresh
subprocess loads it and reports its peak resident memory above what it held once torch,
transformers and specserve were imported: VmHWM, reset there through /proc/self/clear_refs.
(ru_maxrss is the same peak but keeps what the process held before exec, i.e. the forking
parent's resident memory, which a large pytest process would then stand for.)

- CPU, served in float32 (the CPU default) and in bfloat16: the peak is at most 1.1 x the weights
  in the dtype they are served in (the loader reads one tensor at a time in the checkpoint's dtype
  and casts it; no float32 copy of the whole model, no memory map held resident).
- A CUDA target, mocked with the meta device (a tensor sent there leaves no host memory, as one
  copied to a GPU): the peak is about the largest tensor, far below the weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.timeout(900)

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS = 1024, 4096, 12, 32000, 16, 4
MB = 2**20


def shapes() -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    out = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
           "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
                    p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
                    p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                    p + "mlp.up_proj.weight": (INTER, HIDDEN),
                    p + "mlp.down_proj.weight": (HIDDEN, INTER),
                    p + "input_layernorm.weight": (HIDDEN,),
                    p + "post_attention_layernorm.weight": (HIDDEN,)})
    return out


def write_checkpoint(folder) -> int:
    """config.json + model.safetensors (bfloat16), written one tensor at a time so that this
    process never holds the model; returns the number of parameters."""
    table, offset = {}, 0
    for name, shape in shapes().items():
        nbytes = 2 * int(torch.tensor(shape).prod())
        table[name] = {"dtype": "BF16", "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(table).encode()
    header += b" " * (-len(header) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for name, shape in shapes().items():
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            f.write(t.view(torch.uint8).numpy().tobytes())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
    return offset // 2


PROBE = r"""
import json, sys
import torch, transformers  # noqa: F401  (imported before the baseline: the server has them)
from specserve.spec_phases.loader import load_model, hf_model_config
hf_model_config(sys.argv[1])                    # transformers' config machinery, also baseline
if sys.argv[3].startswith("cuda"):
    torch.zeros(1, device=sys.argv[3])         # the CUDA context: baseline too
if sys.argv[3] == "meta":
    # ops on meta tensors import torch._dynamo (~100 MB) where a GPU's would not: baseline
    import torch._dynamo  # noqa: F401

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts here
    f.write("5")
before = status("VmRSS:")
assert status("VmHWM:") < before + 64 * 2**20, "clear_refs did not reset the peak"
model = load_model(sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3])
peak = status("VmHWM:")
held = sum(p.numel() * p.element_size() for p in model.parameters())
out = {"before": before, "peak": peak, "weights": held,
       "dtype": str(next(model.parameters()).dtype)}
if sys.argv[3].startswith("cuda"):              # what --gpu-memory-utilization 0.9 leaves for KV
    from specserve.spec_phases.worker import utilization_kv_budget
    free, total = torch.cuda.mem_get_info()
    out.update(free=free, total=total, kv_budget_0_9=utilization_kv_budget(0.9, free, total))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    params = write_checkpoint(folder)
    assert params * 2 > 450 * MB                 # ~0.5 GB in bfloat16, ~1 GB in float32
    return folder, params


def probe(folder, dtype: str, device: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), dtype, device],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype, width", [("float32", 4), ("bfloat16", 2)])
def test_cpu_peak_is_the_served_weights_and_little_more(checkpoint, dtype, width):
    folder, params = checkpoint
    got = probe(folder, dtype, "cpu")
    served = params * width
    assert got["weights"] == served and got["dtype"] == f"torch.{dtype}", got
    above = got["peak"] - got["before"]
    print(f"cpu {dtype}: weights {served / MB:.0f} MiB, peak above baseline "
          f"{above / MB:.0f} MiB ({above / served:.3f} x)")
    assert above <= 1.1 * served, (above / MB, served / MB)


def test_a_device_target_holds_about_one_tensor_on_the_host(checkpoint):
    """meta stands in for CUDA: what reaches the device leaves no host memory behind."""
    folder, params = checkpoint
    got = probe(folder, "bfloat16", "meta")
    largest = VOCAB * HIDDEN * 2                  # the embedding / LM head in bfloat16, 62.5 MiB
    above = got["peak"] - got["before"]
    print(f"device (meta) bfloat16: weights {params * 2 / MB:.0f} MiB, largest tensor "
          f"{largest / MB:.1f} MiB, peak above baseline {above / MB:.0f} MiB")
    assert above <= 2 * largest + 64 * MB, (above / MB, largest / MB)
