"""MLA prefill and extend in the MHA form: K/V decompressed from the latent cache by chunks.

Why (docs/mla.md): the absorbed form attends over the [R + r]-channel latent (576 on
DeepSeek-V3) with [R]-channel values per head, ~3.4x the FLOPs of the MHA form's [nope + r] keys
and [v] values (192 and 128) per (query, key) pair, and materializes [T, H, R + r] queries. For a
step of many new tokens the MHA form is cheaper, even counting the decompression of every
attended position through kv_b_proj; for decode it is not (one query per decompressed key).

How: the step's KV positions (every request's [0, seq_len), in request order) are cut into
pieces of at most `chunk_tokens` positions. For each piece the latent rows are gathered from the
pool, decompressed (k_nope, v = kv_b_proj(latent[:R]); k_pe = latent[R:], roped when stored),
and every query that sees part of the piece attends it; a query's partial results over the
pieces merge through their log-sum-exp. So no step holds more than one piece's K/V, whatever the
prompt length. Everything here is host-planned from the step's lengths: MHA steps run eager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moeserve.host_copy import to_device

# Decompress: latent main channels [n, R] → [n, H, nope + v] (kv_b_proj's output).
Decompress = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MlaShape:
    heads: int
    nope: int
    rope: int
    v: int
    rank: int  # kv_lora_rank R


@dataclass(frozen=True)
class MlaFormPolicy:
    """Which form a step runs in (attention.mla_form): see `use_mha`."""

    form: str  # auto | absorbed | mha
    min_tokens: int
    chunk_tokens: int
    shape: MlaShape

    def flops(self, extend_lens: list[int], prefix_lens: list[int]) -> tuple[float, float]:
        """(absorbed, MHA) multiply-add counts of a step's attention, with the absorption
        GEMMs (absorbed) or the decompression of every attended position (MHA)."""
        s = self.shape
        pairs = sum(e * (p + (e + 1) / 2) for e, p in zip(extend_lens, prefix_lens))
        tokens = sum(extend_lens)
        kv = sum(e + p for e, p in zip(extend_lens, prefix_lens))
        absorbed = pairs * s.heads * (2 * s.rank + s.rope) + tokens * s.heads * s.rank * (
            s.nope + s.v)
        mha = pairs * s.heads * (s.nope + s.rope + s.v) + kv * s.heads * s.rank * (s.nope + s.v)
        return absorbed, mha

    def use_mha(self, extend_lens: list[int], prefix_lens: list[int]) -> bool:
        """mha: every step with new tokens beyond one per request; absorbed: none; auto: steps
        of at least min_tokens new tokens whose MHA FLOP count is the lower (a MIXED step of
        long-context decodes decompresses too much for its few queries)."""
        if self.form == "absorbed" or all(e <= 1 for e in extend_lens):
            return False
        if self.form == "mha":
            return True
        if sum(extend_lens) < self.min_tokens:
            return False
        absorbed, mha = self.flops(extend_lens, prefix_lens)
        return mha < absorbed


@dataclass
class Piece:
    """One chunk of KV positions: rows [kv0, kv0 + n) of the step's flat slot list, made of
    segments (request, first position, length); its block table lists (segment, query block)
    for the query blocks that see any of it."""

    kv0: int
    n: int
    seg_req: list[int]
    seg_pos0: list[int]
    seg_kv0: list[int]  # within the piece
    seg_len: list[int]
    meta: torch.Tensor | None = None  # int32 on the device: seg fields | blk_seg | blk_m
    num_blocks: int = 0


@dataclass
class MhaPlan:
    """A step's pieces and index tensors, shared by every MLA layer of the step."""

    slots: torch.Tensor  # [N] KV slot of every attended position, request-major
    qo_start: torch.Tensor  # [B + 1] int32 (device)
    prefix_lens: torch.Tensor  # [B] int32 (device)
    pieces: list[Piece]
    qo_start_cpu: list[int]
    prefix_cpu: list[int]
    block_m: int


def plan_pieces(seq_lens: list[int], chunk_tokens: int) -> list[Piece]:
    """Cut the requests' positions [0, seq_len) (request-major) into pieces of <= chunk_tokens."""
    pieces: list[Piece] = []
    cur = Piece(0, 0, [], [], [], [])
    for i, s in enumerate(seq_lens):
        pos = 0
        while pos < s:
            if cur.n == chunk_tokens:
                pieces.append(cur)
                cur = Piece(cur.kv0 + cur.n, 0, [], [], [], [])
            take = min(s - pos, chunk_tokens - cur.n)
            cur.seg_req.append(i)
            cur.seg_pos0.append(pos)
            cur.seg_kv0.append(cur.n)
            cur.seg_len.append(take)
            cur.n += take
            pos += take
    if cur.n:
        pieces.append(cur)
    return pieces


def piece_blocks(piece: Piece, extend_lens: list[int], prefix_lens: list[int],
                 block_m: int) -> tuple[list[int], list[int]]:
    """(segment, query block) of the query blocks that see the piece: a block's last query sits
    at prefix + its last row, and sees a segment starting at pos0 when that is <= it."""
    segs, blocks = [], []
    for j, i in enumerate(piece.seg_req):
        e, p = extend_lens[i], prefix_lens[i]
        for m in range(-(-e // block_m)):
            if p + min((m + 1) * block_m, e) - 1 >= piece.seg_pos0[j]:
                segs.append(j)
                blocks.append(m)
    return segs, blocks


def build_plan(fb, chunk_tokens: int, block_m: int) -> MhaPlan:
    """The step's plan from fb's host-side lengths: one host→device copy of every index."""
    ext, pre = list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu)
    seq = [e + p for e, p in zip(ext, pre)]
    pieces = plan_pieces(seq, chunk_tokens)
    starts = [0]
    for e in ext:
        starts.append(starts[-1] + e)
    ints = starts + pre
    offsets = []
    for pc in pieces:
        segs, blocks = piece_blocks(pc, ext, pre, block_m)
        offsets.append(len(ints))
        pc.num_blocks = len(segs)
        ints += pc.seg_req + pc.seg_pos0 + pc.seg_kv0 + pc.seg_len + segs + blocks
    dev = fb.req_pool_indices.device
    meta = to_device(torch.tensor(ints, dtype=torch.int32), dev)
    for pc, off in zip(pieces, offsets):
        pc.meta = meta[off: off + 4 * len(pc.seg_req) + 2 * pc.num_blocks]
    b = len(ext)
    # every attended position's slot: request-major (row of request i, positions [0, seq_i))
    lens = torch.tensor(seq, dtype=torch.int64)
    first = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), dtype=torch.int64) - torch.repeat_interleave(first, lens)
    req = torch.repeat_interleave(torch.arange(b, dtype=torch.int64), lens)
    idx = to_device(torch.stack([req, pos]), dev)
    rows = fb.req_pool_indices[idx[0]]
    slots = fb.req_to_token_pool.req_to_token[rows, idx[1]].long()
    return MhaPlan(slots, meta[: b + 1], meta[b + 1: 2 * b + 1], pieces, starts, pre, block_m)


def decompress_piece(latent_buf: torch.Tensor, slots: torch.Tensor, rank: int, dtype: torch.dtype,
                     decompress: Decompress) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv [n, H, nope + v], k_pe [n, r]) of the latent rows at `slots` (latent_buf:
    [slots + 1, 1, R + r], the pool's layer buffer)."""
    lat = latent_buf.index_select(0, slots)[:, 0].to(dtype)  # [n, R + r]
    return decompress(lat[:, :rank].contiguous()), lat[:, rank:]


def run_pieces(q: torch.Tensor, latent_buf: torch.Tensor, decompress: Decompress, shape: MlaShape,
               scale: float, plan: MhaPlan, attend) -> torch.Tensor:
    """q: [T, H, nope + r] (roped) → [T, H, v]. `attend(q, kv, k_pe, piece, plan, out, lse,
    first, last)` accumulates one piece into (out, lse); `first`/`last`: the step has one
    piece (then `out` is the result in q's dtype and lse is unused)."""
    t = q.shape[0]
    single = len(plan.pieces) == 1
    out = q.new_empty((t, shape.heads, shape.v)) if single else torch.zeros(
        (t, shape.heads, shape.v), dtype=torch.float32, device=q.device)
    lse = torch.full((t, shape.heads), float("-inf"), dtype=torch.float32, device=q.device)
    for pc in plan.pieces:
        kv, k_pe = decompress_piece(latent_buf, plan.slots[pc.kv0: pc.kv0 + pc.n], shape.rank,
                                    q.dtype, decompress)
        kv = kv.view(pc.n, shape.heads, shape.nope + shape.v)
        attend(q, kv, k_pe, pc, plan, out, lse, scale, single)
    return out if single else out.to(q.dtype)


def attend_piece_torch(q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, piece: Piece,
                       plan: MhaPlan, out: torch.Tensor, lse: torch.Tensor, scale: float,
                       single: bool) -> None:
    """Reference: per segment, float32 scores with the causal mask, merged into (out, lse)
    (natural log)."""
    nope = q.shape[-1] - k_pe.shape[-1]
    for j, i in enumerate(piece.seg_req):
        q0, e = plan.qo_start_cpu[i], plan.qo_start_cpu[i + 1] - plan.qo_start_cpu[i]
        p, pos0, kv0, n = plan.prefix_cpu[i], piece.seg_pos0[j], piece.seg_kv0[j], piece.seg_len[j]
        qi = q[q0: q0 + e].float()  # [E, H, nope + r]
        seg = kv[kv0: kv0 + n].float()  # [n, H, nope + v]
        s = (torch.einsum("ehd,nhd->hen", qi[..., :nope], seg[..., :nope])
             + torch.einsum("ehd,nd->hen", qi[..., nope:], k_pe[kv0: kv0 + n].float())) * scale
        q_pos = torch.arange(p, p + e, device=q.device)
        k_pos = torch.arange(pos0, pos0 + n, device=q.device)
        s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        m = s.amax(-1)  # [H, E]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(s - m_safe[..., None])
        den = w.sum(-1)  # [H, E]; 0 where the segment is all in the future
        o = torch.einsum("hen,nhv->ehv", w, seg[..., nope:]) / den.clamp_min(1e-30).t()[..., None]
        new_lse = torch.where(den > 0, m_safe + torch.log(den.clamp_min(1e-30)),
                              torch.full_like(den, float("-inf"))).t()  # [E, H]
        if single:
            out[q0: q0 + e] = o.to(out.dtype)
            continue
        old = lse[q0: q0 + e]
        top = torch.maximum(old, new_lse)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        wa, wb = torch.exp(old - top), torch.exp(new_lse - top)
        tot = wa + wb
        merged = (out[q0: q0 + e] * wa[..., None] + o * wb[..., None]) / tot.clamp_min(
            1e-30)[..., None]
        out[q0: q0 + e] = torch.where((tot > 0)[..., None], merged, out[q0: q0 + e])
        lse[q0: q0 + e] = torch.where(tot > 0, top + torch.log(tot.clamp_min(1e-30)), old)
