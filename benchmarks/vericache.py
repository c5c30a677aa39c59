"""VeriCache on the embedded model: capacity, throughput and swap cost, side by side in one run.

    HF_HUB_OFFLINE=1 nice -n 19 python benchmarks/vericache.py --context 1024 --concurrency 4 \
        --new-tokens 32 --k 16 --compressors window,quant,mustafar,spherical \
        --out docs/img/vericache.json
    # throughput only, compressor settings of your own, the FASER controller choosing k:
    python benchmarks/vericache.py --context 8100 --concurrency 8 --k 8 --skip-capacity-swap \
        --adaptive --variant window-1024 window '{"window": 1024}'

(a) capacity: at a fixed device KV budget, how many `--capacity-context`-token sequences fit with
    full fp16 KV vs with the compressed drafting cache only (measured `state_bytes` of a real
    sequence's K/V, sinks and dense window included). The full cache then lives in the host pool.
(b) throughput: output tokens/s of `--concurrency` requests at `--context` tokens, plain decoding vs
    lossy_kv per compressor; acceptance rate and mean accepted tokens per verify round. Every prompt
    is prefilled in the first step; tokens/s counts the decode-only steps (their tokens and time;
    the drafting cache's encode of the prompts falls in the first of them). `full_batch_*` counts
    only the decode steps that began with every request running: with speculation requests finish at
    different steps, and the last few then run rounds nearly as costly as a full batch's (a draft
    step reads all the weights for 1 row or for 16), a tail a server with a queue refills.
(c) swap: one verify forward with the full cache in a HostKVPool staged layer by layer vs the
    device-resident cache (on CPU both are host memory: this measures the copy path's overhead;
    the GPU overlap with a side stream is unmeasured here).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from specserve.kv_cache.compress.spherical_calib import local_texts
from specserve.kv_cache.host_pool import HostKVPool, StagedPagedAttention
from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.engine import EngineCore
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.calibration import DenseCache, build_compressor

SETTINGS = {"window": {"window": 192}, "quant": {"key_bits": 4, "value_bits": 4},
            "mustafar": {"sparsity": 0.7}, "spherical": {"tier": 1, "value_bits": 8}}


def prompts_of(tok, num: int, length: int) -> list[list[int]]:
    ids = tok.encode(local_texts(8 * num * length))
    if len(ids) < num * length:
        raise SystemExit(f"only {len(ids)} local text tokens for {num} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(num)]


def run(prompts, new_tokens: int, spec, threads: int, device: str = "auto", dtype: str = "auto",
        kv_gb: float = 1.0) -> dict:
    # every prompt is prefilled in the first step, so every later step decodes all requests
    # together: with staggered prefills, requests admitted early would decode (and finish) beside
    # later prefills
    budget = max(4096, sum(len(p) for p in prompts) + len(prompts))
    core = EngineCore(EngineConfig(kv_cache_memory_gb=kv_gb, max_num_batched_tokens=budget,
                                   num_threads=threads, device=device, dtype=dtype,
                                   speculative=spec))
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"b{i}", ids, SamplingParams(max_tokens=new_tokens,
                                                                    temperature=0,
                                                                    ignore_eos=True)))
    outs = {f"b{i}": [] for i in range(len(prompts))}
    drafted = accepted = rounds = 0
    decode_s, decode_tokens, full_s, full_tokens = 0.0, 0, 0.0, 0
    while core.has_unfinished():
        full = len(core.scheduler.running) == len(prompts)
        start = time.perf_counter()
        new = 0
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
            new += len(out.new_token_ids)
        st = step.stats
        if st.num_prompt_tokens == 0:               # decode-only steps: the throughput we compare
            decode_s += time.perf_counter() - start
            decode_tokens += new
            if full:                                # ... of which those with every request running
                full_s += time.perf_counter() - start
                full_tokens += new
        drafted, accepted = drafted + st.num_draft_tokens, accepted + st.num_accepted_tokens
        rounds += len(st.draft_lens)
    core.check_integrity()
    prop = core.worker.proposer
    return {"outputs": [outs[f"b{i}"] for i in range(len(prompts))], "decode_s": decode_s,
            "decode_tokens": decode_tokens,
            "tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
            "full_batch_s": full_s, "full_batch_tokens": full_tokens,
            "full_batch_tokens_per_s": full_tokens / full_s if full_s else 0.0,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "mean_accepted_per_round": accepted / rounds if rounds else 0.0,
            "proposer": prop.stats() if prop is not None else None, "core": core}


def repeated_ngram_share(outputs: list[list[int]], n: int = 4) -> float:
    """Share of the outputs' n-grams that repeat an earlier one of the same output: greedy text of a
    small model turns repetitive over long outputs, which a drafter predicts easily (acceptance
    rises)."""
    grams = repeats = 0
    for ids in outputs:
        seen: set[tuple[int, ...]] = set()
        for j in range(len(ids) - n + 1):
            g = tuple(ids[j:j + n])
            repeats += g in seen
            seen.add(g)
            grams += 1
    return repeats / grams if grams else 0.0


@torch.inference_mode()
def capacity(model, ids: list[int], budget_gb: float, variants: list[tuple[str, str, dict]],
             chunk: int = 512) -> list[dict]:
    """Encode one real sequence's K/V (a chunked dense forward) into each (label, compressor,
    settings) variant; sequences that fit in `budget_gb` of device memory with full fp16 KV vs with
    the compressed drafting cache."""
    cfg, dev = model.config, model.embed_tokens.weight.device
    cache = DenseCache(cfg.attention())
    for start in range(0, len(ids), chunk):
        part = torch.tensor(ids[start:start + chunk], device=dev)
        model(part, torch.arange(start, start + len(part), device=dev), cache)
    full = cfg.kv_bytes_per_token(torch.float16) * len(ids)
    rows = [{"name": "full-fp16", "bytes_per_seq": full, "seqs": int(budget_gb * 2**30 // full)}]
    for label, name, settings in variants:
        comp = build_compressor(name, model, settings)
        state = comp.new_state(torch.float16, str(dev))
        for layer in range(cfg.num_layers):
            comp.encode(state, layer, torch.cat(cache.k[layer]), torch.cat(cache.v[layer]))
        b = comp.state_bytes(state)
        rows.append({"name": label, "bytes_per_seq": b, "seqs": int(budget_gb * 2**30 // b),
                     "vs_full": full / b})
    return rows


@torch.inference_mode()
def swap_cost(core: EngineCore, num_reqs: int, context: int, k: int, repeats: int = 3) -> dict:
    """Verify forward ([last + k drafts] per request) on the device-resident cache vs staged from a
    host pool. The cache content is random: only timing and bytes matter here."""
    w = core.worker
    cfg, runner, bs = w.config, w.runner, w.block_size
    per_req = -(-(context + k + 1) // bs)
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(num_reqs)]
    if per_req * num_reqs > w.num_blocks:
        return {"skipped": "not enough blocks"}
    pool = HostKVPool(cfg.num_layers, w.num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, w.dtype)
    tokens = [[5] * (k + 1) for _ in range(num_reqs)]
    ids, positions, paged = runner._inputs(tokens, [context] * num_reqs, tables)
    times = {"resident_s": [], "staged_s": []}
    for _ in range(repeats):
        start = time.perf_counter()
        w.model(ids, positions, paged)
        times["resident_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        staged = StagedPagedAttention(pool, paged.meta.query_start, paged.meta.seq_lens, tables,
                                      paged.slot_mapping, runner.layers, w.device)
        w.model(ids, positions, staged)
        times["staged_s"].append(time.perf_counter() - start)
    return {"resident_s": min(times["resident_s"]), "staged_s": min(times["staged_s"]),
            "h2d_bytes_per_verify": pool.bytes_h2d // repeats,
            "d2h_bytes_per_verify": pool.bytes_d2h // repeats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--compressors", default="window,quant,mustafar,spherical")
    ap.add_argument("--capacity-context", type=int, default=4096)
    ap.add_argument("--budget-gb", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.0,
                    help="the engine's paged cache (0: sized for every request's context + new "
                         "tokens + k)")
    ap.add_argument("--variant", nargs=3, action="append", default=[],
                    metavar=("LABEL", "COMPRESSOR", "JSON"),
                    help="a lossy_kv configuration of its own, e.g. window-1024 window "
                         "'{\"window\": 1024}' (repeatable; replaces --compressors)")
    ap.add_argument("--adaptive", action="store_true",
                    help="the FASER controller picks each request's k per step (k_max = --k)")
    ap.add_argument("--fixed-and-adaptive", action="store_true",
                    help="run every variant twice, fixed k and then the controller "
                         "(label + '+faser')")
    ap.add_argument("--skip-capacity-swap", action="store_true", help="throughput (b) only")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    report = {"args": vars(args)}
    prompts = prompts_of(tok, args.concurrency, args.context)
    per_token = load_model(None).config.kv_bytes_per_token(torch.float32)  # the widest cache dtype
    kv_gb = args.kv_cache_memory_gb or max(
        1.0,
        1.25 * args.concurrency * (args.context + args.new_tokens + args.k + 1) * per_token / 2**30)
    plain = run(prompts, args.new_tokens, None, args.threads, args.device, args.dtype, kv_gb)
    report["plain"] = {k: v for k, v in plain.items() if k not in ("outputs", "core")}
    report["plain"]["repeated_4gram_share"] = repeated_ngram_share(plain["outputs"])
    report["plain"]["repeated_4gram_share_first_32"] = repeated_ngram_share(
        [o[:32] for o in plain["outputs"]])
    print("plain", json.dumps(report["plain"]), flush=True)
    variants = [(label, name, json.loads(cfg)) for label, name, cfg in args.variant] or \
        [(name, name, SETTINGS[name]) for name in args.compressors.split(",")]
    if not args.skip_capacity_swap:
        cap_ids = prompts_of(tok, 1, args.capacity_context)[0]
        report["capacity"] = capacity(plain["core"].worker.model, cap_ids, args.budget_gb, variants)
        print("capacity", json.dumps(report["capacity"]), flush=True)
        report["swap"] = swap_cost(plain["core"], args.concurrency, args.context, args.k)
        print("swap", json.dumps(report["swap"]), flush=True)
    report["lossy_kv"] = {}
    modes = [False, True] if args.fixed_and_adaptive else [args.adaptive]
    for (label, name, settings), adaptive in ((v, m) for v in variants for m in modes):
        label += "+faser" if adaptive and args.fixed_and_adaptive else ""
        spec = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=args.k,
                                 kv_compressor=name,
                                 kv_compressor_config=settings, adaptive=adaptive)
        r = run(prompts, args.new_tokens, spec, args.threads, args.device, args.dtype, kv_gb)
        row = {k: v for k, v in r.items() if k not in ("outputs", "core")}
        row["compressor"], row["settings"] = name, settings
        row["identical"] = r["outputs"] == plain["outputs"]
        row["speedup"] = row["tokens_per_s"] / report["plain"]["tokens_per_s"]
        row["full_batch_speedup"] = (row["full_batch_tokens_per_s"]
                                     / report["plain"]["full_batch_tokens_per_s"])
        report["lossy_kv"][label] = row
        print(label, json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
