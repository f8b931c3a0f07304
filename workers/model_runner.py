"""Turns a scheduler output into one forward pass over the paged cache, and samples."""
from __future__ import annotations

import torch

from workers.kv_cache import KVCache
from workers.model import AttentionMetadata, Llama, PrefillSpan
from workers.sampler import sample
from workers.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: Llama, cache: KVCache, max_model_len: int):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        model.set_max_len(max_model_len, self.device)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids, positions, slots = [], [], []
        for chunk in sched.chunks:                                # decodes first, then prefills
            req, start = chunk.request, chunk.request.num_computed_tokens
            for pos in range(start, start + chunk.num_tokens):
                ids.append(req.token_ids[pos])
                positions.append(pos)
                slots.append(req.block_ids[pos // bs] * bs + pos % bs)

        decode_tables = decode_mask = None
        if sched.decodes:
            max_blocks = max(len(c.request.block_ids) for c in sched.decodes)
            tables = [c.request.block_ids + [0] * (max_blocks - len(c.request.block_ids)) for c in sched.decodes]
            decode_tables = self._tensor(tables)                  # [Bd, max_blocks]
            ctx = self._tensor([c.request.num_computed_tokens + 1 for c in sched.decodes])
            decode_mask = (torch.arange(max_blocks * bs, device=self.device)[None, :] < ctx[:, None])
            decode_mask = decode_mask[:, None, None, :]           # [Bd, 1, 1, L]

        spans, row = [], len(sched.decodes)
        for chunk in sched.prefills:
            req, cached, n = chunk.request, chunk.request.num_computed_tokens, chunk.num_tokens
            mask = None
            if cached:
                q_pos = torch.arange(cached, cached + n, device=self.device)
                mask = torch.arange(cached + n, device=self.device)[None, :] <= q_pos[:, None]  # [n, ctx]
            n_blocks = -(-(cached + n) // bs)
            spans.append(PrefillSpan(row, n, cached, self._tensor(req.block_ids[:n_blocks]), mask))
            row += n

        meta = AttentionMetadata(positions=self._tensor(positions), slot_mapping=self._tensor(slots),
                                 num_decodes=len(sched.decodes), decode_block_tables=decode_tables,
                                 decode_mask=decode_mask, prefills=spans)
        return self._tensor(ids), meta

    def execute(self, sched: SchedulerOutput) -> list[int | None]:
        """Run the step; one entry per chunk (decodes, then prefills): its new token, or None
        for a prompt chunk that leaves the request short of its next token."""
        input_ids, meta = self.prepare(sched)
        hidden = self.model(input_ids, self.cache.pool, meta)
        rows, reqs, last = [], [], 0
        for chunk in sched.chunks:
            last += chunk.num_tokens
            if chunk.completes:
                rows.append(last - 1)
                reqs.append(chunk.request)
        tokens = sample(self.model.logits(hidden[rows]), reqs) if rows else []
        it = iter(tokens)
        return [next(it) if chunk.completes else None for chunk in sched.chunks]
