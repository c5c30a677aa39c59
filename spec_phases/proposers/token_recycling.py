"""Token Recycling (training-free): a [vocab, top_k] table holding, per token id, the target's most
recent top-k next-token candidates, refreshed from every verified row; drafts follow the table.

We walk the rank-0 chain (a one-path tree): d_1 = table[last][0], d_2 = table[d_1][0], ... so the
ragged verify pass needs no tree attention. The table is shared by all requests, as in the paper.
"""
from __future__ import annotations

import torch

from specserve.spec_phases.proposers.base import DraftRequest, Drafts, Proposer


class TokenRecyclingProposer(Proposer):          # the table is shared, not per request
    name = "token_recycling"
    learns_from_target = True

    def __init__(self, vocab_size: int, top_k: int = 8, device: str | torch.device = "cpu"):
        self.table = torch.full((vocab_size, top_k), -1, dtype=torch.long, device=device)
        self.top_k = top_k

    def propose(self, requests: list[DraftRequest], max_lens: list[int]) -> Drafts:
        k_max = max(max_lens, default=0)
        if k_max == 0:
            return Drafts([[] for _ in requests])
        current = torch.tensor([r.token_ids[-1] for r in requests], device=self.table.device)
        chain = []
        for _ in range(k_max):                                 # all requests step together
            current = self.table[current.clamp_min(0), 0].where(current >= 0, current)
            chain.append(current)
        paths = torch.stack(chain, dim=1).tolist()             # [num_requests, k_max]
        drafts = []
        for path, k in zip(paths, max_lens):
            path = path[:k]
            drafts.append(path[:path.index(-1)] if -1 in path else path)
        return Drafts(drafts)

    def observe(self, input_token_ids: torch.Tensor, logits: torch.Tensor) -> None:
        top = logits.topk(self.top_k, dim=-1).indices          # [rows, top_k]
        self.table[input_token_ids.to(self.table.device)] = top.to(self.table.device)
