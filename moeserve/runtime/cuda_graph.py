"""CUDA graphs for decode: capture the model's decode forward once per batch-size bucket, replay it.

Why: a decode step of a 48-layer MoE model is ~1000 small kernels; launched from Python each costs
more host time than its device time. A replayed graph launches them all at once.

How: the graphs read their inputs from static buffers (`StaticDecodeInputs`) that `replay` fills
with the step's tensors; rows past the real batch are padding (KV slot 0, the sink; seq_len 1) and
their outputs are dropped. All graphs share one memory pool and are captured largest first. The
decode path inside must not sync with the host: the attention backend declares `graph_safe`, the
MoE layers keep routing counts on the device, and the EPLB recorder counts through a device switch
and a row mask (`ExpertDistributionRecorder.capture_rows`). Under DP attention every rank replays
the same bucket: the largest batch of any rank, from the step's DP sync (`global_num_tokens`); an
IDLE rank replays it with only padding.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from moeserve.distributed import ParallelMesh
    from moeserve.runtime.kv_memory import KVMemory

logger = logging.getLogger(__name__)


class GraphHost(Protocol):
    """What a graph runner reads from the runner that owns it (runtime/model_runner.py's
    ModelRunner; the graphs never import it): the model and attention backend it captures, the
    KV memory and mesh its static batches point at, the EPLB recorder it masks."""

    model: Any  # the CausalLM: model(fb) → hidden [T, H], compute_logits
    attn_backend: Any
    memory: KVMemory
    mesh: ParallelMesh
    device: torch.device
    dtype: torch.dtype
    hf_config: Any
    recorder: Any  # eplb ExpertDistributionRecorder (`capture_rows`), or None

    def make_batch(self, mode: ForwardMode, input_ids: torch.Tensor | list[int],
                   positions: torch.Tensor | list[int], out_cache_loc: torch.Tensor,
                   req_pool_indices: list[int], prefix_lens: list[int],
                   extend_lens: list[int]) -> ForwardBatch: ...


def decode_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (and max_bs itself): at most 7 padded rows wasted
    beyond 8, which costs little next to the weights every step reads."""
    small = [b for b in (1, 2, 4) if b < max_bs]
    return small + list(range(8, max_bs, 8)) + [max_bs]


@dataclass
class StaticDecodeInputs:
    """The device tensors a captured decode forward reads, [max_bs] each (int64)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    row_mask: torch.Tensor  # 1 for real rows, 0 for padding (EPLB counts only real rows)
    arange: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> StaticDecodeInputs:
        def zeros() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        s = cls(zeros(), zeros(), zeros(), zeros(), zeros(), zeros(),
                torch.arange(max_bs, dtype=torch.int64, device=device))
        s.seq_lens.fill_(1)
        return s

    def load(self, fb: ForwardBatch | None, bs: int) -> None:
        """Copy fb's n real rows in (None: none, all padding); reset the padding rows' KV slot to
        the sink (a stale slot would overwrite a live request's KV)."""
        n = fb.batch_size if fb is not None else 0
        if n:
            self.input_ids[:n].copy_(fb.input_ids[:n])
            self.positions[:n].copy_(fb.positions[:n])
            self.out_cache_loc[:n].copy_(fb.out_cache_loc[:n])
            self.req_pool_indices[:n].copy_(fb.req_pool_indices)
            self.seq_lens[:n].copy_(fb.seq_lens)
        if n < bs:
            self.out_cache_loc[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)  # a stale length may exceed the row's written slots
        torch.lt(self.arange, n, out=self.row_mask)


def capture_buckets(runner: GraphHost, buckets: list[int], capture_one, what: str) -> None:
    """capture_one(size, side stream, EPLB recorder) for every bucket, largest first (smaller
    graphs then reuse the pool's blocks), with a progress bar; the recorder's capture mask is
    cleared afterwards even when a capture fails."""
    from tqdm import tqdm

    rec = runner.recorder
    stream = torch.cuda.Stream(runner.device)
    try:
        for size in tqdm(sorted(buckets, reverse=True), desc=f"capturing CUDA graphs ({what})",
                         unit="graph", leave=False):
            capture_one(size, stream, rec)
    finally:
        if rec is not None:
            rec.capture_rows = None
    torch.cuda.synchronize(runner.device)
    logger.info("CUDA graphs captured for %s %s", what, buckets)


class CudaGraphRunner:
    """Captured decode forwards (hidden → logits) by bucket; `replay` returns the real rows'
    logits [n, V] in the model dtype."""

    label = "decode"  # what the graphs run (logged)

    def __init__(self, runner: GraphHost, max_bs: int):
        self.runner = runner
        self.max_bs = max_bs
        self.buckets = decode_buckets(max_bs)
        self.static = StaticDecodeInputs.allocate(max_bs, runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # the final hidden states (speculation reads)
        self.pool = None

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n, None past max_bs."""
        i = bisect.bisect_left(self.buckets, max(n, 1))
        return self.buckets[i] if i < len(self.buckets) else None

    def bucket_of_step(self, fb: ForwardBatch) -> int | None:
        """The bucket this step replays, None to run eager: decode (or IDLE while every rank
        decodes) up to max_bs; DP ranks take the largest batch of any rank."""
        mode = fb.global_forward_mode or fb.forward_mode
        if fb.forward_mode not in (ForwardMode.DECODE, ForwardMode.IDLE) or mode not in (
                ForwardMode.DECODE, ForwardMode.IDLE) or fb.return_all_logits and fb.batch_size:
            return None
        n = max(fb.global_num_tokens) if fb.global_num_tokens else fb.batch_size
        return self.bucket_for(n) if n > 0 else None

    @torch.inference_mode()
    def capture(self) -> None:
        capture_buckets(self.runner, self.buckets, self._capture_one, f"{self.label} batch sizes")

    def _capture_one(self, bs: int, stream: torch.cuda.Stream, rec) -> None:
        fb = self._static_batch(bs)
        if rec is not None:
            rec.capture_rows = self.static.row_mask[:bs]
        self.static.load(None, bs)  # all padding: the row mask is 0, so nothing is recorded
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks kernels, outside capture
                self._forward(fb)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.hidden[bs], self.outputs[bs] = self._forward(fb)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        r = self.runner
        r.attn_backend.init_forward_metadata(fb)
        hidden = r.model(fb)[: fb.batch_size]
        return hidden, r.model.compute_logits(hidden)  # [bs, H], [bs, V]

    def _static_batch(self, bs: int) -> ForwardBatch:
        s, r = self.static, self.runner
        world = r.mesh.world_size if r.mesh.distributed else 1
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, input_ids=s.input_ids[:bs],
            positions=s.positions[:bs], out_cache_loc=s.out_cache_loc[:bs],
            req_pool_indices=s.req_pool_indices[:bs], seq_lens=s.seq_lens[:bs],
            seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=r.memory.req_to_token, kv_pool=r.memory.pool,
            attn_backend=r.attn_backend, global_forward_mode=ForwardMode.DECODE,
            global_num_tokens=[bs] * world)

    def replay(self, fb: ForwardBatch, bs: int, with_hidden: bool = False):
        """→ logits [fb.batch_size, V] of the step (a view of the graph's output buffer, valid
        until the next replay), and with_hidden the final hidden states [fb.batch_size, H]."""
        self.static.load(fb, bs)
        self.graphs[bs].replay()
        logits = self.outputs[bs][: fb.batch_size]
        return (logits, self.hidden[bs][: fb.batch_size]) if with_hidden else logits
