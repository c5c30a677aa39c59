"""The lossy_kv drafter's batched attention equals the per-request algorithm it replaced: for every
compressor, `compressor.attend(state)` merged with dense attention over the round's scratch, one
request at a time. Checked per attention call (random states with and without pages, ragged rows)
and end to end (the drafts `propose` returns on the tiny model)."""
from dataclasses import replace

import pytest
import torch
from specserve.kernels.reference.attention import dense_attention, merge_attention
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases import loader
from specserve.spec_phases.model import ModelConfig
from specserve.kv_cache.draft_pool import DraftPool
from specserve.spec_phases.proposers.base import DraftRequest
from specserve.spec_phases.calibration import build_compressor
from specserve.spec_phases.proposers import lossy_kv
from specserve.spec_phases.proposers.lossy_kv import DraftAttention, LossyKVProposer

SMALL_PAGES = {"num_sink": 4, "window": 8, "page_size": 8}
COMPRESSORS = {                                   # name -> (kv_compressor, config, tiny head_dim)
    "window": ("window", SMALL_PAGES, 16),
    "quant": ("quant", {**SMALL_PAGES, "key_bits": 4, "value_bits": 2}, 16),
    "spherical": ("spherical",
                  {"num_sink": 4, "window": 8, "page_size": 16, "tier": 1, "value_bits": 4,
                                # Triton's spherical encode needs pages >= 16
                                "calib_tokens": 128}, 16),
    "mustafar": ("mustafar", {"num_sink": 4, "window": 8, "page_size": 64, "sparsity": 0.7}, 64),
}


def tiny_d64() -> ModelConfig:
    """The tiny model with head_dim 64 (Mustafar's tiles need head_dim % 64 == 0)."""
    return ModelConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_layers=2,
                       num_heads=2,
                       num_kv_heads=1, head_dim=64, max_position=4096, bos_token_id=1,
                       eos_token_ids=(2,))


class PerRequestAttention:
    """The drafter's attention before batching (kept here as the reference)."""

    def __init__(self, comp, states, max_len):
        self.comp, self.states = comp, states
        self.scratch = [[None] * len(s.layers) for s in states]
        self.step = 0

    def __call__(self, layer, q, k, v):
        outs = []
        for row in range(q.shape[0]):
            state, scratch = self.states[row], self.scratch[row]
            prev = scratch[layer]
            sk = k[row:row + 1] if prev is None else torch.cat([prev[0], k[row:row + 1]])
            sv = v[row:row + 1] if prev is None else torch.cat([prev[1], v[row:row + 1]])
            scratch[layer] = (sk, sv)
            qi = q[row:row + 1]
            parts = [self.comp.attend(state, layer, qi),
                     dense_attention(qi, sk, sv, self.comp.sm_scale)]
            outs.append(merge_attention(parts)[0])
        return torch.cat(outs).to(q.dtype)


def model_for(name):
    head_dim = COMPRESSORS[name][2]
    return (loader.build_random_model(tiny_d64()) if head_dim
            == 64 else loader.load_model("tiny-random"))


# the GPU path where there is one
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_request", [False, True], ids=["default", "per-request-pages"])
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_batched_attention_equals_the_per_request_reference(name, per_request, device):
    """per_request: pages attended request by request (the GPU path) instead of the CPU's pages
    decoded once per round; quant and window batch their own way either way."""
    torch.manual_seed(0)
    model = model_for(name).to(device)
    cfg = model.config
    comp = build_compressor(name, model, COMPRESSORS[name][1])
    if per_request:
        comp.draft_decode_limit_bytes = 0
    page = comp.config.page_size
    # one state deep into pages, one with a single page, one still all dense (no pages at all)
    lengths = [comp.config.num_sink + comp.config.window + 3 * page + 5,
               comp.config.num_sink + comp.config.window + page + 1, 7]
    states = []
    for n in lengths:
        state = comp.new_state(torch.float16, device)
        for layer in range(cfg.num_layers):
            comp.encode(state, layer, torch.randn(n, cfg.num_kv_heads, cfg.head_dim, device=device),
                        torch.randn(n, cfg.num_kv_heads, cfg.head_dim, device=device))
        states.append(state)
    assert [len(s.layers[0].pages) > 0 for s in states] == [True, True, False]
    # ragged: requests stop drafting one by one
    rows_per_step = [3, 3, 2, 1]
    new, ref = DraftAttention(comp, states, len(rows_per_step)), PerRequestAttention(comp, states,
                                                                                     4)
    for step, rows in enumerate(rows_per_step):
        new.step = ref.step = step
        for layer in range(cfg.num_layers):
            q = torch.randn(rows, cfg.num_heads, cfg.head_dim, device=device)
            k = torch.randn(rows, cfg.num_kv_heads, cfg.head_dim, device=device)
            v = torch.randn(rows, cfg.num_kv_heads, cfg.head_dim, device=device)
            got, want = new(layer, q, k, v), ref(layer, q, k, v)
            assert got.shape == want.shape == q.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kinds = {type(view[4]).__name__ for view in new.layers}
    decoded = device == "cpu" and not per_request
    expected = {"window": "NoneType", "quant": "QuantPagesBatch"}.get(
        name, "DecodedPagesBatch" if decoded else "PagesBatch")
    assert kinds == {expected}


class ReferenceProposer(LossyKVProposer):
    def _attention(self, states, max_len):
        return PerRequestAttention(self.pool.comp, states, max_len)


@pytest.mark.parametrize("name", ["window", "quant", "mustafar"])
def test_propose_drafts_the_same_tokens_as_the_per_request_path(name):
    torch.manual_seed(0)
    model = model_for(name)
    cfg = model.config
    bs, num_blocks = 16, 64
    storage = KVStorage(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim,
                        torch.float32)
    storage.k.normal_()
    storage.v.normal_()
    sizes = [150, 97, 60, 131]
    reqs, first = [], 0
    for i, n in enumerate(sizes):
        blocks = list(range(first, first + -(-(n + 8) // bs)))[::-1]     # scattered order
        first += len(blocks)
        tokens = [(11 * j + 7 * i) % 500 + 3 for j in range(n + 1)]
        reqs.append(DraftRequest(f"r{i}", tuple(tokens), n, tuple(blocks)))
    max_lens = [3, 6, 0, 6]                                # ragged, one request not drafting
    settings = COMPRESSORS[name][1]
    def pool():
        return DraftPool(build_compressor(name, model, dict(settings)), storage, "cpu")
    new, ref = LossyKVProposer(model, pool()), ReferenceProposer(model, pool())
    got, want = new.propose(reqs, max_lens).token_ids, ref.propose(reqs, max_lens).token_ids
    assert [len(d) for d in got] == max_lens
    assert got == want
    assert new.num_draft_steps == ref.num_draft_steps == 6


def test_draft_rounds_feed_attention_mass_that_changes_spherical_tier_choices():
    """Serving's path: a draft round with `observe_mass` records each page's share of attention
    (Spherical-KV's retention signal, DESIGN 5.4), and the budgeted rebalance then keeps the
    attended page where the unobserved state, weighing every page alike, drops it."""
    from specserve.kv_cache.compress.base import CompressorConfig
    from specserve.kv_cache.compress.spherical import DROP, SphericalCompressor
    from specserve.kv_cache.compress.spherical_calib import calibrate

    torch.manual_seed(0)
    h, d, page, num_layers = 1, 64, 8, 1
    cfg = CompressorConfig(num_layers=num_layers, num_kv_heads=h, head_dim=d, num_sink=0,
                           window=0, page_size=page)
    books = calibrate(torch.randn(num_layers, h, 256, d), iters=5)
    comp = SphericalCompressor(cfg, books, tier=1, value_bits=4)
    k, v = torch.randn(64, h, d), torch.randn(64, h, d)
    hot = 5                                                  # queries point at page 5's keys
    q = k[hot * page:(hot + 1) * page].mean(0, keepdim=True).expand(1, 2, d) * 8

    def state():
        s = comp.new_state(torch.float32)
        comp.encode(s, 0, k, v)
        return s
    observed, plain = state(), state()
    attn = DraftAttention(comp, [observed], 1, observe_mass=True)
    attn(0, q, torch.randn(1, h, d), torch.randn(1, h, d))
    mass = observed.layers[0].attn_mass
    assert max(mass) == mass[hot] and mass != plain.layers[0].attn_mass
    DraftAttention(comp, [plain], 1)(0, q, torch.randn(1, h, d), torch.randn(1, h, d))
    assert plain.layers[0].attn_mass == [1.0] * 8          # not refreshed: untouched
    full = comp.bytes_per_token() * 8
    comp.set_retention(budget_bits=0.3 * full, state=observed)
    comp.set_retention(budget_bits=0.3 * full, state=plain)
    kept = [p.tier for p in observed.layers[0].pages]
    unweighted = [p.tier for p in plain.layers[0].pages]
    assert kept[hot] != DROP and unweighted[hot] == DROP
    assert sum(t != DROP for t in kept) == sum(t != DROP for t in unweighted)   # same budget


def c_decoder_case(model):
    """The model packed for the C decoder, its runner over a random full cache, and three
    requests (150, 97 and 131 tokens computed) to draft for."""
    from specserve.spec_phases.runner import ModelRunner
    assert model.pack_for_cpu()
    cfg = model.config
    bs = 16
    storage = KVStorage(cfg.num_layers, 64, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    storage.k.normal_()
    storage.v.normal_()
    reqs, first = [], 0
    for i, n in enumerate([150, 97, 131]):
        blocks = list(range(first, first + -(-(n + 8) // bs)))
        first += len(blocks)
        tokens = [(11 * j + 7 * i) % 500 + 3 for j in range(n + 1)]
        reqs.append(DraftRequest(f"r{i}", tuple(tokens), n, tuple(blocks)))
    return ModelRunner(model, storage), storage, reqs


@pytest.mark.parametrize("name,dense", [("window", True), ("quant", False)])
def test_dense_states_draft_on_the_one_call_c_decoder(name, dense):
    """Where no state holds pages (the window compressor) each draft step is one call of the C
    decoder over the states' dense tokens: the same drafts as the modules' batched path (within
    float rounding of the attention, which the tiny model's margins absorb); states with pages
    keep the modules' path."""
    torch.manual_seed(0)
    model = model_for(name)
    runner, storage, reqs = c_decoder_case(model)
    assert runner.cpu_decoder is not None
    max_lens = [5, 2, 5]
    settings = COMPRESSORS[name][1]

    def pool():
        return DraftPool(build_compressor(name, model, dict(settings)), storage, "cpu")
    fast, modules = LossyKVProposer(model, pool(), runner), LossyKVProposer(model, pool())
    got, want = fast.propose(reqs, max_lens).token_ids, modules.propose(reqs, max_lens).token_ids
    assert [len(d) for d in got] == max_lens
    assert got == want
    assert fast.stats()["num_c_rounds"] == int(dense)
    assert modules.stats()["num_c_rounds"] == 0


PAGE_CASES = [("quant", {**SMALL_PAGES, "page_size": page, "key_bits": k, "value_bits": v})
              for (k, v), page in [((4, 4), 8), ((8, 2), 8), ((2, 8), 8), ((4, 4), 64),
                                   ((2, 4), 64), ((8, 8), 64)]]
PAGE_CASES += [("mustafar", {"num_sink": 4, "window": 8, "page_size": 64, **sparsity})
               for sparsity in ({"sparsity": 0.7}, {"key_sparsity": 0.2, "value_sparsity": 0.9},
                                {"key_sparsity": 0.95, "value_sparsity": 0.0})]
PAGE_CASES += [("spherical", {"num_sink": 4, "window": 8, "page_size": page, "tier": tier,
                              "calib_tokens": 128}) for tier, page in ((1, 16), (2, 32), (3, 64))]


@pytest.mark.parametrize("name,settings", PAGE_CASES)
def test_compressed_pages_draft_on_the_one_call_c_decoder(name, settings):
    """States holding `quant`, Mustafar or Spherical-KV pages draft on the C decoder too,
    attending the pages as they are stored (`draft_attention.c`: quant's codes, Mustafar's
    bitmap-sparse tiles, Spherical-KV's radii and codeword indices), every draft step, LM head
    and argmax in one call (no Python per step: the model's `compute_logits` is never called):
    the same drafts as the modules' batched path."""
    torch.manual_seed(0)
    model = model_for("mustafar")                                   # head_dim 64
    runner, storage, reqs = c_decoder_case(model)
    max_lens = [5, 2, 5]
    page = settings["page_size"]

    def pool():
        return DraftPool(build_compressor(name, model, dict(settings)), storage, "cpu")
    fast, modules = LossyKVProposer(model, pool(), runner), LossyKVProposer(model, pool())
    heads = {"fast": 0, "modules": 0}
    logits = model.compute_logits
    drafts = {}
    for name, proposer in (("fast", fast), ("modules", modules)):
        def counted(h, name=name):
            heads[name] += 1
            return logits(h)
        model.compute_logits = counted
        try:
            drafts[name] = proposer.propose(reqs, max_lens).token_ids
        finally:
            model.compute_logits = logits
    assert all(len(s.layers[0].pages) >= 64 // page for s in fast.pool.states.values())
    assert fast.stats()["num_c_rounds"] == 1 and modules.stats()["num_c_rounds"] == 0
    assert heads == {"fast": 0, "modules": 5}
    assert drafts["fast"] == drafts["modules"]
    assert [len(d) for d in drafts["fast"]] == max_lens


@pytest.mark.parametrize("family", ["llama", "gemma-untied"])
def test_one_call_draft_steps_are_the_step_by_step_forwards(family):
    """`CpuDecoder.draft` (a round's draft steps, LM head, argmax and the next step's embedding in
    one C call) drafts exactly what one-step `CpuDecoder.forward` calls, the LM head and torch's
    argmax draft over the same drafting cache, rows dropping out as their drafts end, each row's
    K/V written at its own slots; the embedding read back from a tied head's rows, or from an
    untied float32 table times Gemma's scale."""
    from specserve.kernels.metadata import PagedAttentionMetadata
    from specserve.spec_phases.families import _GEMMA
    from specserve.spec_phases.runner import ModelRunner
    cfg = replace(loader.tiny_config(vocab_size=300), num_layers=3)
    if family == "gemma-untied":
        cfg = replace(cfg, tie_word_embeddings=False, family=_GEMMA)
    model = loader.build_random_model(cfg, seed=5)
    assert model.pack_for_cpu()
    assert model._embedding_in_head == (family == "llama")
    fast = ModelRunner(model, KVStorage(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim,
                                        torch.float32)).cpu_decoder
    lens, rows_at, bs = [20, 9, 14], [3, 3, 2, 1], 16      # drafts of 4, 3 and 2 steps
    per = -(-(max(lens) + len(rows_at)) // bs)
    bases = [r * per * bs for r in range(3)]
    tables = [tuple(range(r * per, (r + 1) * per)) for r in range(3)]
    cache = KVStorage(cfg.num_layers, 3 * per, bs, cfg.num_kv_heads, cfg.head_dim,
                      torch.float32)
    cache.k.normal_(generator=torch.Generator().manual_seed(1))
    cache.v.normal_(generator=torch.Generator().manual_seed(2))
    stepped = KVStorage(cfg.num_layers, 3 * per, bs, cfg.num_kv_heads, cfg.head_dim,
                        torch.float32)
    stepped.k.copy_(cache.k), stepped.v.copy_(cache.v)
    tokens, positions = torch.tensor([5, 117, 33]), torch.tensor([150, 97, 131])
    layers = cfg.attention()
    got, seconds = fast.draft(tokens, positions, rows_at, cache, bases, lens, tables, bs, layers)
    current, want = tokens, []
    for step, rows in enumerate(rows_at):
        meta = PagedAttentionMetadata(list(range(rows + 1)),
                                      [n + step + 1 for n in lens[:rows]], tables[:rows], bs)
        slots = torch.tensor([b + n + step for b, n in zip(bases[:rows], lens[:rows])])
        hidden = fast.forward(current[:rows], positions[:rows] + step, stepped, meta, slots,
                              layers)
        current = model.compute_logits(hidden).argmax(-1)
        want.append(current.tolist())
    assert [got[step, :rows].tolist() for step, rows in enumerate(rows_at)] == want
    assert len({t for row in want for t in row}) > 3                  # not one token throughout
    assert torch.equal(cache.k, stepped.k) and torch.equal(cache.v, stepped.v)
    assert len(seconds) == len(rows_at) and all(t > 0 for t in seconds)


@pytest.mark.parametrize("name,settings", [
    ("spherical", {"num_sink": 4, "window": 8, "page_size": 16, "tier": 1, "value_bits": 4,
                   "calib_tokens": 128}),
    ("spherical", {"num_sink": 4, "window": 8, "page_size": 16, "tier": 1, "budget_bits": 200,
                   "calib_tokens": 128})])
def test_pages_without_a_c_form_draft_through_the_modules(name, settings):
    """Spherical-KV with quantized values or a retention budget (varying tiers, fed by the
    modules' attention mass) has no C form: its drafts run through the modules, beside the C
    decoder, and are the drafts of a drafter that has none."""
    torch.manual_seed(0)
    model = model_for("mustafar")                                   # head_dim 64
    runner, storage, reqs = c_decoder_case(model)

    def pool():
        return DraftPool(build_compressor(name, model, dict(settings)), storage, "cpu")
    beside, alone = LossyKVProposer(model, pool(), runner), LossyKVProposer(model, pool())
    assert beside.pool.comp.draft_kernel() is None
    got = beside.propose(reqs, [3, 2, 3]).token_ids
    assert got == alone.propose(reqs, [3, 2, 3]).token_ids
    assert all(s.layers[0].pages for s in beside.pool.states.values())
    assert beside.stats()["num_c_rounds"] == 0


def test_a_request_s_first_round_reports_building_its_state_apart():
    """`Drafts.state_s`: the seconds a round spent encoding the whole context of requests
    drafting for the first time (FASER prices that once, not as every drafting step's cost);
    a later round, which encodes only the newly verified tokens, reports none."""
    torch.manual_seed(0)
    model = model_for("quant")
    cfg = model.config
    storage = KVStorage(cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    storage.k.normal_()
    storage.v.normal_()
    pool = DraftPool(build_compressor("quant", model, dict(COMPRESSORS["quant"][1])), storage,
                     "cpu")
    proposer = LossyKVProposer(model, pool)
    tokens = tuple((11 * j) % 500 + 3 for j in range(140))
    first = proposer.propose([DraftRequest("r", tokens[:121], 120, tuple(range(9)))], [2])
    assert first.state_s > 0 and pool.states["r"].num_tokens == 120
    later = proposer.propose([DraftRequest("r", tokens[:124], 123, tuple(range(9)))], [2])
    assert later.state_s == 0.0 and pool.states["r"].num_tokens == 123


def test_drafts_choose_among_the_first_ids_and_the_contexts_tokens(monkeypatch):
    """The drafts' vocabulary (`DraftVocabulary`): the vocabulary's first ids and the drafting
    requests' context tokens. On the C decoder the LM head scores those rows alone (the contexts'
    gathered from the packed head, `linear.select_outputs`); on the modules the other logits are
    masked: both draft the same tokens, every one inside the vocabulary. With 16 first ids, most
    of the contexts' tokens are the gathered rows'."""
    monkeypatch.setattr(lossy_kv, "DRAFT_VOCAB_PREFIX", 16)
    torch.manual_seed(0)
    model = model_for("window")
    runner, storage, reqs = c_decoder_case(model)
    max_lens = [5, 2, 5]

    def pool():
        return DraftPool(build_compressor("window", model, dict(COMPRESSORS["window"][1])),
                         storage, "cpu")
    fast, modules = LossyKVProposer(model, pool(), runner), LossyKVProposer(model, pool())
    got, want = fast.propose(reqs, max_lens).token_ids, modules.propose(reqs, max_lens).token_ids
    assert fast.stats()["num_c_rounds"] == 1
    assert got == want
    vocabulary = set(range(16)) | {t for r in reqs for t in r.token_ids}
    assert all(t in vocabulary for d in got for t in d)
    assert len(fast.vocab.ids) == len({t for r in reqs for t in r.token_ids if t >= 16})
    assert any(t >= 16 for d in got for t in d)
    # a token new to the contexts joins the next round's vocabulary (its head row gathered anew)
    r = reqs[0]
    grown = [DraftRequest(r.request_id, r.token_ids + (700,), r.num_computed_tokens + 1,
                          r.block_ids), *reqs[1:]]
    got, want = fast.propose(grown, max_lens).token_ids, modules.propose(grown, max_lens).token_ids
    assert 700 in fast.vocab.ids.tolist() and got == want
