"""VeriCache's drafting cache: per-request compressed copies of the full KV cache, and their bytes.

Two halves, as for full blocks (`BlockPool` bookkeeping beside `KVStorage` tensors):

- `DraftBudget` is the scheduler side's ledger, held by `KVCacheManager`: a device byte capacity
  and per-request reservations, so `allocate` answers for full blocks and draft bytes together,
  all or nothing. It knows sizes only through `bytes_at[n]`, the predicted bytes of one request's
  compressed cache at n tokens: plain data handed over once at start-up.
- `DraftPool` is the worker side: the compressed `SequenceState` of each request, synced from the
  full cache (prefill chunks, accepted drafts and bonus tokens all arrive by one path), released
  with the request, counted, and checked against the reservations.

The drafter (`spec_phases/proposers/lossy_kv.py`) only runs the model over the pool's states.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kv_cache.compress.base import Compressor, SequenceState
from specserve.kv_cache.host_pool import HostKVPool
from specserve.kv_cache.storage import KVStorage


class DraftBudget:
    def __init__(self, capacity: int, bytes_at: Sequence[int]):
        """capacity: device bytes for every request's compressed cache; bytes_at[n]: one request's
        bytes at n tokens, for n = 0 .. the longest context (not monotonic: a page forming
        replaces dense tokens with packed ones)."""
        self.capacity = capacity
        self.bytes_at = tuple(bytes_at)
        self.reserved: dict[str, int] = {}           # request id -> bytes reserved
        self.reserved_total = 0

    def max_tokens_alone(self) -> int:
        """The longest context whose cache fits the capacity on its own, counting the peak over
        every length up to it."""
        peak = 0
        for n, size in enumerate(self.bytes_at[1:], start=1):
            peak = max(peak, size)
            if peak > self.capacity:
                return n - 1
        return len(self.bytes_at) - 1

    def reserve(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> bool:
        """Cover whatever the request's cache holds now, during this step and after it commits:
        the maximum of the previous reservation and the predicted bytes at the current and the
        new length. False, changing nothing, when that does not fit beside the others."""
        old = self.reserved.get(request_id, 0)
        need = max(old, self.bytes_at[num_computed_tokens], self.bytes_at[num_tokens])
        if self.reserved_total - old + need > self.capacity:
            return False
        self.reserved[request_id] = need
        self.reserved_total += need - old
        return True

    def free(self, request_id: str) -> None:
        self.reserved_total -= self.reserved.pop(request_id, 0)

    def check_integrity(self, holders: set[str]) -> None:
        """Reservations are held exactly by the requests holding blocks, sum right, fit."""
        if set(self.reserved) != holders:
            raise AssertionError(f"reservations {sorted(self.reserved)[:5]} do not match the "
                                 f"requests holding blocks {sorted(holders)[:5]}")
        if self.reserved_total != sum(self.reserved.values()):
            raise AssertionError(f"reserved total {self.reserved_total} != "
                                 f"sum {sum(self.reserved.values())}")
        if self.reserved_total > self.capacity:
            raise AssertionError(f"reserved {self.reserved_total} bytes > capacity {self.capacity}")


@dataclass(frozen=True)
class DraftPoolUsage:
    """Bytes of the tokens the pool holds: compressed as packed, and what the full cache spends on
    the same tokens; per token (all layers): the measured compressed average, the steady-state
    rate of compressed pages, the dense rate of sinks and window, and the full cache's rate."""
    num_requests: int
    num_tokens: int
    compressed_bytes: int
    full_bytes: int
    compressed_bytes_per_token: float
    compressed_page_bytes_per_token: float
    dense_bytes_per_token: float
    full_bytes_per_token: float
    capacity_bytes: int | None


class DraftPool:
    def __init__(self, compressor: Compressor, full: KVStorage | HostKVPool,
                 device: torch.device | str, capacity_bytes: int | None = None):
        """full: the full paged cache the states are synced from (on the device, or in host memory
        when VeriCache stages it). capacity_bytes: the device budget of the compressed caches
        (None: not budgeted, e.g. when the full cache is on the device too)."""
        self.comp, self.full, self.device = compressor, full, torch.device(device)
        self.capacity_bytes = capacity_bytes
        # float16 states beside a float32 or fp8 full cache, its own dtype otherwise
        self.state_dtype = (torch.float16 if full.k.dtype in (torch.float32, torch.float8_e4m3fn)
                            else full.k.dtype)
        self.states: dict[str, SequenceState] = {}
        self.num_encoded_tokens = self.num_rebuilds = 0      # monotonic counters
        self.encode_s = 0.0

    # -- sizes -------------------------------------------------------------------------------
    def bytes_at(self, num_tokens: int) -> int:
        """One request's compressed bytes at num_tokens tokens, all layers, known in advance."""
        return self.comp.predict_state_bytes(num_tokens)

    def budget(self, max_tokens: int) -> DraftBudget | None:
        """The scheduler side's ledger for contexts up to max_tokens (None when not budgeted)."""
        if self.capacity_bytes is None:
            return None
        return DraftBudget(self.capacity_bytes, [self.bytes_at(n) for n in range(max_tokens + 1)])

    # -- states ------------------------------------------------------------------------------
    def sync(self, request_id: str, num_computed_tokens: int,
             block_ids: Sequence[int]) -> SequenceState:
        """Bring the request's state to exactly the full cache's first num_computed_tokens tokens
        (after a preemption the cache was recomputed: the state is rebuilt)."""
        t0 = time.perf_counter()
        state = self.states.get(request_id)
        if state is not None and state.num_tokens > num_computed_tokens:
            state = None
            self.num_rebuilds += 1
        if state is None:
            state = self.comp.new_state(self.state_dtype, str(self.device))
            self.states[request_id] = state
        start = state.num_tokens
        if num_computed_tokens > start:
            bs = self.full.block_size
            pos = torch.arange(start, num_computed_tokens)
            blocks = torch.tensor(block_ids)[pos // bs]
            slots = (blocks * bs + pos % bs).to(self.full.k.device)
            for layer in range(len(state.layers)):
                k, v = self.full.k[layer][slots], self.full.v[layer][slots]
                if k.dtype == torch.float8_e4m3fn:           # compressors read it widened
                    k, v = k.float(), v.float()
                self.comp.encode(state, layer, k.to(self.device), v.to(self.device))
            self.num_encoded_tokens += num_computed_tokens - start
        self.encode_s += time.perf_counter() - t0
        return state

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def held_request_ids(self) -> set[str]:
        return set(self.states)

    # -- accounting --------------------------------------------------------------------------
    def usage(self) -> DraftPoolUsage:
        tokens = sum(s.num_tokens for s in self.states.values())
        compressed = sum(self.comp.state_bytes(s) for s in self.states.values())
        k = self.full.k                                   # [layers, slots, kv_heads, head_dim]
        full_per_token = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()
        layers = self.comp.config.num_layers
        return DraftPoolUsage(
            num_requests=len(self.states), num_tokens=tokens, compressed_bytes=compressed,
            full_bytes=tokens * full_per_token,
            compressed_bytes_per_token=compressed / tokens if tokens else 0.0,
            compressed_page_bytes_per_token=self.comp.bytes_per_token() * layers,
            dense_bytes_per_token=float(self.comp.config.dense_bytes_per_token() * layers),
            full_bytes_per_token=float(full_per_token), capacity_bytes=self.capacity_bytes)

    def check_integrity(self, live_ids: set[str], releasing: set[str],
                        reserved_bytes: int | None) -> None:
        """States only for live requests and those the next plan releases; with a budget, the live
        ones hold no more bytes than are reserved."""
        stale = set(self.states) - live_ids - releasing
        if stale:
            raise AssertionError(f"drafting caches held for finished requests: {sorted(stale)[:5]}")
        if reserved_bytes is not None:
            used = sum(self.comp.state_bytes(s) for r, s in self.states.items()
                       if r not in releasing)
            if used > reserved_bytes:
                raise AssertionError(f"drafting caches hold {used} compressed bytes, more than the "
                                     f"{reserved_bytes} reserved")
