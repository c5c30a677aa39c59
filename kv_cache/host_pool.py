"""VeriCache's host pool: the full KV cache in host memory, brought to the device layer by layer for
a verify pass (DESIGN §5.3).

- `HostKVPool` has `KVStorage`'s layout (`k[layer]`, `v[layer]`: `[num_slots, kv_heads, head_dim]`,
  slot = block * block_size + offset), so the existing block manager and block tables address it
  unchanged. Pinned memory where CUDA is present, so host->device copies can run asynchronously.
- `StagedKV` (one per verify step) gathers the blocks the step's requests reference into a compact
  device staging buffer, double-buffered by layer: while layer l attends, layer l+1's blocks are in
  flight (a side CUDA stream on GPU; on CPU the same code path with plain, synchronous copies).
  Block tables are remapped to staging-local block ids once per step.
- `StagedPagedAttention` is the per-step attention object the model calls: it takes layer l from the
  stager, starts layer l+1, writes the new tokens' K/V to the staging buffer (for this layer's
  attention) and back to the host pool (which stays the single source of truth), then runs the same
  paged-attention op as the device-resident path. Output is identical by construction.

Swap traffic is counted (`bytes_h2d`, `bytes_d2h`), so the scheduler can put it in the step cost.
"""
from __future__ import annotations

import torch
from specserve.kernels.dispatch import get_op
from specserve.kernels.metadata import LayerAttention, PagedAttentionMetadata
from specserve.kv_cache.storage import write_slots


class HostKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int,
                 dtype: torch.dtype, pin: bool | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        pin = torch.cuda.is_available() if pin is None else pin
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.bytes_h2d = self.bytes_d2h = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.k.shape[0] * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write-back of new tokens' K/V (few per request per step: synchronous)."""
        slots = slot_mapping.cpu()
        write_slots(self.k[layer], slots, k)
        write_slots(self.v[layer], slots, v)
        self.bytes_d2h += 2 * k.numel() * self.k.element_size()


class StagedKV:
    """The blocks of one step's block tables, staged on `device` one layer at a time (2 buffers)."""

    def __init__(self, pool: HostKVPool, block_tables: list[list[int]], device: str | torch.device):
        self.pool, self.device = pool, torch.device(device)
        bs = pool.block_size
        blocks = sorted({b for table in block_tables for b in table})
        local = {b: i for i, b in enumerate(blocks)}
        self.block_tables = [[local[b] for b in table] for table in block_tables]
        self.local_of = local
        src = (torch.tensor(blocks, dtype=torch.int64)[:, None] * bs + torch.arange(bs)).flatten()
        self.src_slots = src
        shape = (2, src.numel()) + tuple(pool.k.shape[2:])
        self.k = torch.empty(shape, dtype=pool.k.dtype, device=self.device)
        self.v = torch.empty(shape, dtype=pool.v.dtype, device=self.device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: list = [None, None]
        self.staged_layer = [-1, -1]
        pin = self.cuda
        self.host_buf = [(torch.empty(shape[1:], dtype=pool.k.dtype, pin_memory=pin),
                          torch.empty(shape[1:], dtype=pool.v.dtype,
                                      pin_memory=pin)) for _ in range(2)]

    def local_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        bs = self.pool.block_size
        blocks = (slot_mapping.cpu() // bs).tolist()
        local = torch.tensor([self.local_of[b] for b in blocks], dtype=torch.int64)
        return (local * bs + slot_mapping.cpu() % bs).to(self.device)

    def prefetch(self, layer: int) -> None:
        """Start bringing `layer` into buffer layer % 2 (no-op past the last layer or if staged)."""
        if layer >= self.pool.k.shape[0] or self.staged_layer[layer % 2] == layer:
            return
        buf = layer % 2
        hk, hv = self.host_buf[buf]
        torch.index_select(self.pool.k[layer], 0, self.src_slots, out=hk)     # host gather
        torch.index_select(self.pool.v[layer], 0, self.src_slots, out=hv)
        if self.cuda:
            # buffer's last reader is done
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.k[buf].copy_(hk, non_blocking=True)
                self.v[buf].copy_(hv, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.ready[buf] = event
        else:
            self.k[buf].copy_(hk)
            self.v[buf].copy_(hv)
        self.staged_layer[buf] = layer
        self.pool.bytes_h2d += 2 * hk.numel() * hk.element_size()

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.prefetch(layer)
        buf = layer % 2
        if self.cuda and self.ready[buf] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[buf])
        return self.k[buf], self.v[buf]


class StagedPagedAttention:
    """Drop-in for the runner's PagedAttention with the full cache in a HostKVPool."""

    def __init__(self, pool: HostKVPool, query_start: list[int], seq_lens: list[int],
                 block_tables: list[list[int]], slot_mapping: torch.Tensor,
                 layers: LayerAttention, device: str | torch.device):
        self.pool, self.layers = pool, layers
        self.staged = StagedKV(pool, block_tables, device)
        self.meta = PagedAttentionMetadata(query_start, seq_lens, self.staged.block_tables,
                                           pool.block_size,
                                           device)
        self.slot_mapping = slot_mapping
        self.local_slots = self.staged.local_slots(slot_mapping)
        self.op = get_op("paged_attention", str(device))
        self.staged.prefetch(0)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        sk, sv = self.staged.get(layer)
        self.staged.prefetch(layer + 1)                   # overlaps this layer's attention on GPU
        write_slots(sk, self.local_slots, k)
        write_slots(sv, self.local_slots, v)
        self.pool.write(layer, self.slot_mapping, k, v)
        return self.op(q, sk, sv, self.meta, **self.layers.options(layer))
