"""The scheduler's side of speculative decoding: when a decode batch verifies, and how an accepted
block lands in a request (its KV slots past the accepted tokens go back to the allocator).

A verify step gives each request its verify width of new positions (its last token and the
drafts: num_steps of a chain, every node of a tree);
`settle` keeps the KV of the positions whose tokens were accepted, as plain decoding would have
computed them, so only those ever reach the prefix cache.
"""

from __future__ import annotations

from moeserve.config import SpecConfig
from moeserve.core import Req
from moeserve.kvcache.allocator import TokenToKVPoolAllocator

import torch


class SpecPolicy:
    def __init__(self, cfg: SpecConfig, device: str):
        """`device`: the rank's device type, which picks spec.max_batch_size's default."""
        self.cfg, self.device = cfg, device
        self.verify_steps = 0  # rank totals for the server's interval log and /metrics
        self.accepted_tokens = 0
        self.draft_tokens = 0

    def width(self, reqs: list[Req]) -> int:
        """New positions per request this decode step: num_steps + 1 to verify, or 1 (a plain
        step) for batches above spec.max_batch_size (its device default when null) or below
        spec.min_batch_size, and for requests whose logits are edited (penalties, logit_bias:
        their verification is not built). Grammars verify: each draft position is masked as plain decoding would mask it
        (runtime/grammar_steps.verify_mask)."""
        if not self.cfg.speculates(len(reqs), self.device):
            return 1
        if any(r.sampling.edits_logits for r in reqs):
            return 1
        if self.cfg.topk > 1 and any(r.grammar is not None for r in reqs):
            return 1  # a grammar's walk over a draft tree is not built
        return self.cfg.verify_width

    def settle(self, req: Req, kv_end: int, emitted: int, allocator: TokenToKVPoolAllocator,
               path: list[int] | None = None) -> None:
        """After a verify step appended `emitted` tokens (fewer if a stop condition cut the
        block): keep KV for the positions whose tokens are known and computed, free the rest.
        `path`: a draft tree's accepted nodes (heap indices), whose slots follow the root's."""
        start = kv_end - self.cfg.verify_width
        if path:
            new = req.kv_slots[start:kv_end]
            order = [0, *path] + [i for i in range(1, len(new)) if i not in set(path)]
            req.kv_slots[start:kv_end] = [new[i] for i in order]
        keep = min(start + emitted, len(req.fill_ids) - 1)
        surplus = req.kv_slots[keep:]
        if surplus:
            allocator.free(torch.tensor(surplus, dtype=torch.int64))
        del req.kv_slots[keep:]
        req.kv_len = keep
        req.device_len = len(req.fill_ids)

    def totals(self) -> dict[str, int]:
        return {"spec_verify_steps": self.verify_steps, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens}

    def count(self, req: Req, produced: int) -> None:
        req.spec_verify_steps += 1
        req.spec_accepted_tokens += produced
        self.verify_steps += 1
        self.accepted_tokens += produced
        self.draft_tokens += self.cfg.draft_nodes
