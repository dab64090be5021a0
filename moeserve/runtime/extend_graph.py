"""CUDA graphs for extend steps (prefill chunks and MIXED steps), one per token-count bucket.

Why: an eager extend step of a 48-layer MoE model launches ~1000 kernels from Python, and on the
H200 host each costs more than its device time at serving sizes (a MIXED step of ~1200 prefill
tokens plus ~240 decodes took ~110 ms eager against ~30 ms of device work). Replayed from a graph
the launches cost nothing on the host.

How: a step of T tokens over B requests replays the graph of the smallest bucket >= T, reading
static buffers (`StaticExtendInputs`) that `load` fills. Padding tokens [T, bucket) have input id
0, position 0 and KV slot 0 (the sink); the attention block table zero-fills their rows, so every
later op sees finite values, and the EPLB recorder skips them through its row mask. A bucket of
T tokens holds at most min(T, max_reqs) requests. The graph ends at the final hidden states
[bucket, H]; the runner picks each request's last token and runs the LM head outside, so no
bucket keeps a [B, V] logits buffer. The graphs share one memory pool with the decode graphs and
are captured before them, largest first.

Without CUDA (`capture=False`) `run` executes the same padded forward eagerly: CPU tests check
the padding and the static metadata under Triton's interpreter.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from moeserve.attention.triton_backend import ExtendMetadata
from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.host_copy import to_device
from moeserve.kernels.triton.attention_extend import NO_BLOCK, PAD_BLOCK, extend_blocks
from moeserve.runtime.cuda_graph import GraphHost, capture_buckets

logger = logging.getLogger(__name__)

EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)
MIN_BUCKET = 16


def extend_buckets(max_tokens: int) -> list[int]:
    """16, 32, ... powers of two, with the 1.5x steps from 256 on (at most a third of a bucket
    is padding there), then max_tokens itself."""
    out, b = [], MIN_BUCKET
    while b < max_tokens:
        out.append(b)
        if b >= 256 and b * 3 // 2 < max_tokens:
            out.append(b * 3 // 2)
        b *= 2
    return out + [max_tokens]


def blocks_in_bucket(tokens: int, reqs: int, block_m: int) -> int:
    """Block-table entries a bucket provides: every request's partial block, the padding's."""
    return -(-tokens // block_m) + reqs + 1


@dataclass
class StaticExtendInputs:
    """The device tensors a captured extend forward reads; buckets use leading slices."""

    tokens: torch.Tensor  # [3, max_tokens] int64: input ids, positions, KV slots
    row_mask: torch.Tensor  # [max_tokens] int64: 1 for real tokens (EPLB counts only those)
    arange: torch.Tensor  # [max_tokens]
    req_pool_indices: torch.Tensor  # [max_reqs] int64
    seq_lens: torch.Tensor  # [max_reqs] int64
    meta: torch.Tensor  # int32: qo_start [R + 1] | prefix_lens [R] | blk_req [NB] | blk_m [NB]
    max_reqs: int
    max_blocks: int

    @classmethod
    def allocate(cls, max_tokens: int, max_reqs: int, max_blocks: int,
                 device: torch.device) -> StaticExtendInputs:
        meta = torch.zeros(2 * max_reqs + 1 + 2 * max_blocks, dtype=torch.int32, device=device)
        return cls(torch.zeros(3, max_tokens, dtype=torch.int64, device=device),
                   torch.zeros(max_tokens, dtype=torch.int64, device=device),
                   torch.arange(max_tokens, dtype=torch.int64, device=device),
                   torch.zeros(max_reqs, dtype=torch.int64, device=device),
                   torch.ones(max_reqs, dtype=torch.int64, device=device), meta, max_reqs,
                   max_blocks)

    def metadata(self, reqs: int, blocks: int) -> ExtendMetadata:
        """Views of `meta` for a bucket of `reqs` requests and `blocks` block-table entries."""
        r, m = self.max_reqs, self.meta
        nb0 = 2 * r + 1
        return ExtendMetadata(m[: reqs + 1], m[r + 1: r + 1 + reqs], m[nb0: nb0 + blocks],
                              m[nb0 + self.max_blocks: nb0 + self.max_blocks + blocks])

    def load(self, fb: ForwardBatch, tokens: int, reqs: int, blocks: int, block_m: int) -> None:
        """Copy fb's T tokens and B requests in, padding to `tokens`; the block table lists fb's
        blocks, then zero-fill blocks over the padding rows, then empty entries."""
        t, b = fb.num_tokens, fb.batch_size
        tok = self.tokens
        tok[0, :t].copy_(fb.input_ids)
        tok[1, :t].copy_(fb.positions)
        tok[2, :t].copy_(fb.out_cache_loc)
        if t < tokens:
            tok[:, t:tokens].zero_()
        self.req_pool_indices[:b].copy_(fb.req_pool_indices)
        self.seq_lens[:b].copy_(fb.seq_lens)
        torch.lt(self.arange, t, out=self.row_mask)
        starts = [0]
        for n in fb.extend_seq_lens_cpu:
            starts.append(starts[-1] + n)
        starts += [t] * (reqs - b)  # padding requests own no rows
        prefix = list(fb.extend_prefix_lens_cpu) + [0] * (reqs - b)
        blk_req, blk_m = extend_blocks(fb.extend_seq_lens_cpu, block_m)
        pad = list(range(t, tokens, block_m))
        blk_req += [PAD_BLOCK] * len(pad)
        blk_m += pad
        rest = blocks - len(blk_req)
        assert rest >= 0, f"{len(blk_req)} blocks exceed the bucket's {blocks}"
        blk_req += [NO_BLOCK] * rest
        blk_m += [0] * rest
        # one copy that does not wait for the stream (host_copy), then device-side placement
        dev = to_device(torch.tensor(starts + prefix + blk_req + blk_m, dtype=torch.int32),
                        self.meta.device)
        r, nb0, n = self.max_reqs, 2 * self.max_reqs + 1, 2 * reqs + 1
        self.meta[: reqs + 1].copy_(dev[: reqs + 1])  # qo_start
        self.meta[r + 1: r + 1 + reqs].copy_(dev[reqs + 1: n])
        self.meta[nb0: nb0 + blocks].copy_(dev[n: n + blocks])
        self.meta[nb0 + self.max_blocks: nb0 + self.max_blocks + blocks].copy_(dev[n + blocks:])


class ExtendGraphRunner:
    """Captured extend forwards by token bucket; `run` returns the step's final hidden states
    [T, H] (a view of the graph's output, valid until the next replay)."""

    def __init__(self, runner: GraphHost, max_tokens: int, max_reqs: int, capture: bool = True):
        self.runner = runner
        self.max_tokens = max_tokens
        self.buckets = extend_buckets(max_tokens)
        self.block_m = runner.attn_backend.extend_block_m(runner.memory.pool)
        self.max_reqs = min(max_reqs, max_tokens)
        max_blocks = blocks_in_bucket(max_tokens, self.max_reqs, self.block_m)
        self.static = StaticExtendInputs.allocate(max_tokens, self.max_reqs, max_blocks,
                                                  runner.device)
        self.use_graphs = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def shape_of(self, tokens: int) -> tuple[int, int]:
        """(requests, block-table entries) of a bucket."""
        reqs = min(tokens, self.max_reqs)
        return reqs, blocks_in_bucket(tokens, reqs, self.block_m)

    def bucket_of_step(self, fb: ForwardBatch) -> int | None:
        """The bucket an EXTEND/MIXED step replays, None to run it eager (other modes, a TBO
        split, too many tokens or requests, a DP/EP step whose collectives size on the host)."""
        if (fb.forward_mode not in EXTEND_MODES or fb.tbo or fb.micro_batch
                or (fb.global_num_tokens is not None and len(fb.global_num_tokens) > 1)):
            return None
        t = fb.num_tokens
        if t == 0 or t > self.max_tokens or fb.batch_size > self.max_reqs:
            return None
        bucket = self.buckets[bisect.bisect_left(self.buckets, t)]
        return bucket if fb.batch_size <= self.shape_of(bucket)[0] else None

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into `pool` (shared with the decode graphs)."""
        self.pool = pool
        capture_buckets(self.runner, self.buckets, self._capture_one, "extend token counts")

    def _capture_one(self, tokens: int, stream: torch.cuda.Stream, rec) -> None:
        fb = self._static_batch(tokens)
        self._load_padding(tokens)
        if rec is not None:
            rec.capture_rows = self.static.row_mask[:tokens]
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture: Triton compiles, cuBLAS picks kernels
                self.runner.model(fb)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.outputs[tokens] = self.runner.model(fb)  # [tokens, H]
        self.pool = graph.pool()
        self.graphs[tokens] = graph

    def _load_padding(self, tokens: int) -> None:
        """An all-padding step (capture): no requests, every row a zero-filled padding row."""
        r = self.runner
        empty = r.make_batch(ForwardMode.EXTEND, [], [], torch.empty(0, dtype=torch.int64), [],
                             [], [])
        self.static.load(empty, tokens, *self.shape_of(tokens), self.block_m)

    def _static_batch(self, tokens: int) -> ForwardBatch:
        s, r = self.static, self.runner
        reqs, blocks = self.shape_of(tokens)
        ids, pos, loc = s.tokens[:, :tokens]
        # NOTE: the *_cpu lists are placeholders: nothing in a captured forward may read them
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=ids, positions=pos, out_cache_loc=loc,
            req_pool_indices=s.req_pool_indices[:reqs], seq_lens=s.seq_lens[:reqs],
            seq_lens_cpu=[1] * reqs, extend_prefix_lens_cpu=[0] * reqs,
            extend_seq_lens_cpu=[1] * reqs, req_to_token_pool=r.memory.req_to_token,
            kv_pool=r.memory.pool, attn_backend=r.attn_backend,
            attn_metadata=s.metadata(reqs, blocks))

    def run(self, fb: ForwardBatch, tokens: int) -> torch.Tensor:
        """The step's final hidden states [T, H] from the bucket's graph (or, without graphs,
        from the same padded forward run eagerly)."""
        self.static.load(fb, tokens, *self.shape_of(tokens), self.block_m)
        if not self.use_graphs:
            rec = self.runner.recorder
            if rec is not None:
                rec.capture_rows = self.static.row_mask[:tokens]
            try:
                return self.runner.model(self._static_batch(tokens))[: fb.num_tokens]
            finally:
                if rec is not None:
                    rec.capture_rows = None
        self.graphs[tokens].replay()
        return self.outputs[tokens][: fb.num_tokens]
