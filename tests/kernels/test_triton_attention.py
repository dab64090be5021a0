"""The triton attention backend (kernels in Triton's interpreter on CPU, float32; compiled in bf16
on CUDA) against attention written out per request in float64 and against the torch backend:
MHA/GQA groups 1-8 and absorbed MLA with a split key dim, extend on a cached prefix, decode with
sequences shorter than the number of KV splits, odd lengths, padded rows and empty batches."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moeserve.attention.base import AttentionSpec
from moeserve.attention.registry import create_attention_backend
from moeserve.attention.torch_backend import TorchAttentionBackend
from moeserve.attention.triton_backend import TritonAttentionBackend
from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.kernels.triton.attention import decode_attention, split_counters, store_kv
from moeserve.kernels.triton.attention_extend import extend_attention
from moeserve.kvcache.pool import MHAKVPool, MLAKVPool
from moeserve.kvcache.table import ReqToTokenPool

# The cpu cases run the kernels in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py
# only without CUDA); on a GPU machine the cuda cases run instead.
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter case; GPU: cuda cases")
DEVICES = [pytest.param("cpu", torch.float32, 1e-5, marks=CPU_ONLY),
           pytest.param("cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu)]
# (H, Hkv, D, Dv, rope): rope > 0 is absorbed MLA (Hkv 1, key = D main + rope, value = D main)
SHAPES = {
    "mha": (2, 2, 16, 16, 0), "gqa2": (4, 2, 32, 16, 0), "gqa4": (8, 2, 16, 16, 0),
    "gqa8": (8, 1, 16, 16, 0), "mla": (4, 1, 32, 32, 16), "mla_odd": (20, 1, 24, 24, 8),
    # 40 heads on one latent wider than 128: blocks of 32 rows, one-token programs of 20 heads
    "mla_wide": (40, 1, 160, 160, 16),
}
LAYER = 1  # of 2: the backend must address the right layer's buffers


@contextlib.contextmanager
def _no_host_sync(on: bool):
    """Errors on any device→host sync inside (CUDA only)."""
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _World:
    """A pool, a request table and scattered slots; `step` runs one forward through backends."""

    def __init__(self, shape: str, device: str, dtype: torch.dtype, seed: int = 0):
        self.h, self.hkv, self.d, self.dv, self.rope = SHAPES[shape]
        self.dtype, self.device = dtype, device
        self.gen = torch.Generator().manual_seed(seed)
        size = 1024
        if self.rope:
            self.pool = MLAKVPool(size, 2, self.d, self.rope, dtype, device)
        else:
            self.pool = MHAKVPool(size, 2, self.hkv, self.d, self.dv, dtype, device)
        for buf in self._buffers():  # unwritten slots hold garbage, not zeros
            buf.copy_(torch.randn(buf.shape, generator=self.gen))
        self.table = ReqToTokenPool(8, 160, device)
        self.free = (torch.randperm(size, generator=self.gen) + 1).tolist()  # slot 0 is the sink
        self.lens: dict[int, int] = {}
        dq = self.d + self.rope
        self.spec = AttentionSpec(LAYER, self.h, self.hkv, dq, self.dv, dq**-0.5)

    def _buffers(self):
        return self.pool.kv if self.rope else self.pool.k + self.pool.v

    def _randn(self, *shape):
        return torch.randn(shape, generator=self.gen).to(self.device, self.dtype)

    def batch(self, rows: list[int], new: list[int], decode: bool, backend) -> ForwardBatch:
        prefix = [self.lens.get(r, 0) for r in rows]
        slots = torch.tensor([self.free.pop() for _ in range(sum(new))], dtype=torch.int64)
        i = 0
        for r, p, n in zip(rows, prefix, new):
            self.table.write(r, p, slots[i : i + n])
            self.lens[r], i = p + n, i + n
        dev = self.device
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.zeros(sum(new), dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)]
                                + [torch.zeros(0, dtype=torch.int64)]).to(dev),
            out_cache_loc=slots.to(dev), req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=torch.tensor([p + n for p, n in zip(prefix, new)], device=dev),
            seq_lens_cpu=[p + n for p, n in zip(prefix, new)], extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=new, req_to_token_pool=self.table, kv_pool=self.pool,
            attn_backend=backend)

    def step(self, rows: list[int], new: list[int] | None = None, tol: float = 1e-5,
             splits: int = 4, extend_rows: int | None = None) -> torch.Tensor:
        """One forward (decode when `new` is None): checks the stored K/V and the output against
        the oracle and the torch backend; returns the triton output. `extend_rows`: the
        backend's attention.extend_block_m."""
        decode = new is None
        new = [1] * len(rows) if decode else new
        triton_be = TritonAttentionBackend(num_kv_splits=splits, extend_block_m=extend_rows)
        fb = self.batch(rows, new, decode, triton_be)
        t = sum(new)
        q = self._randn(t, self.h, self.spec.head_dim)
        k = self._randn(t, self.hkv, self.spec.head_dim)
        v = None if self.rope else self._randn(t, self.hkv, self.dv)
        lists = fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        if decode:  # stale at CUDA-graph replay: decode must not read them
            fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = (
                [-7] * len(rows) for _ in range(3))
        with _no_host_sync(decode and self.device == "cuda"):
            triton_be.init_forward_metadata(fb)
            out = triton_be.forward(q, k, v, self.spec, fb)
        fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = lists
        assert out.shape == (t, self.h, self.dv) and out.dtype == q.dtype
        pool = self.pool
        if self.rope:
            assert torch.equal(pool.kv[LAYER][fb.out_cache_loc], k)
        else:
            assert torch.equal(pool.k[LAYER][fb.out_cache_loc], k)
            assert torch.equal(pool.v[LAYER][fb.out_cache_loc], v)
        ref = self._oracle(q, rows, fb.extend_prefix_lens_cpu, new)
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
        torch_be = TorchAttentionBackend()
        fb.attn_backend = torch_be
        torch_be.init_forward_metadata(fb)
        torch.testing.assert_close(out, torch_be.forward(q, k, v, self.spec, fb), rtol=tol,
                                   atol=tol)
        return out

    def _oracle(self, q, rows, prefix, new) -> torch.Tensor:
        k_buf = self.pool.key_buffer(LAYER)
        v_buf = self.pool.value_buffer(LAYER)
        g = self.h // self.hkv
        outs, i = [q.new_zeros((0, self.h, self.dv), dtype=torch.float32)], 0
        for r, p, n in zip(rows, prefix, new):
            idx = self.table.req_to_token[r, : p + n]
            k = k_buf[idx].double().repeat_interleave(g, dim=1)  # [S, H, Dq]
            v = v_buf[idx].double().repeat_interleave(g, dim=1)  # [S, H, Dv]
            for j in range(n):
                w = torch.einsum("hd,shd->hs", q[i + j].double(), k[: p + j + 1])
                w = (w * self.spec.scaling).softmax(-1)
                outs.append(torch.einsum("hs,shd->hd", w, v[: p + j + 1])[None].float())
            i += n
        return torch.cat(outs)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_extend_then_decode(shape, device, dtype, tol):
    """Prompts of odd lengths, a decode step (one sequence shorter than the KV splits), a second
    extend on the cached prefixes (prefix hit; one request with no new tokens), decode again."""
    w = _World(shape, device, dtype)
    w.step([0, 3, 5], [1, 37, 70], tol=tol)
    w.step([0, 3, 5], tol=tol)  # seq_len 2 < 4 splits, 71: two splits of 64 and 7, two empty
    w.step([3, 0, 5], [9, 0, 1], tol=tol)
    w.step([5, 3], tol=tol, splits=8)
    w.step([0, 3], tol=tol, splits=16)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("shape", ["gqa4", "gqa8", "mla_odd", "mla_wide"])
def test_mixed_step_one_token_requests(shape, device, dtype, tol):
    """A MIXED-shaped extend: one-token requests (decodes riding along, their heads packed into
    one program per KV head) between prompt chunks, on cached prefixes of odd lengths."""
    w = _World(shape, device, dtype, seed=6)
    w.step([0, 1, 2, 3], [3, 70, 1, 33], tol=tol)
    w.step([0, 1, 4, 2, 3], [1, 1, 40, 1, 1], tol=tol)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("shape", ["gqa2", "gqa8", "mla_odd", "mla_wide"])
def test_extend_in_128_row_blocks(shape, device, dtype, tol):
    """attention.extend_block_m=128 (two warpgroups a program): a prompt of two blocks, then a
    MIXED-shaped step whose chunk of two blocks starts on a prefix that is not a block multiple,
    with one-token requests packed by heads; a latent wider than 128 keeps its 32-row blocks."""
    w = _World(shape, device, dtype, seed=7)
    be = TritonAttentionBackend(extend_block_m=128)
    assert be.extend_block_m(w.pool) == (32 if w.d > 128 else 128)
    w.step([0, 3], [150, 7], tol=tol, extend_rows=128)
    w.step([0, 3, 5], [1, 140, 2], tol=tol, extend_rows=128)
    w.step([0, 3], tol=tol, extend_rows=128)  # decode is untouched by the setting


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("shape", ["gqa2", "mla", "mla_odd"])
def test_extend_long_prefix_short_suffix(shape, device, dtype, tol):
    """A new chunk whose query block spans KV blocks of the prefix and of itself."""
    w = _World(shape, device, dtype, seed=1)
    w.step([2], [65], tol=tol)
    w.step([2, 4], [66, 3], tol=tol)


@CPU_ONLY
@pytest.mark.parametrize("shape", ["gqa2", "mla_odd"])
@pytest.mark.parametrize("fuse_reduce", [True, False])
def test_decode_writes_every_element_and_padded_rows_are_safe(shape, fuse_reduce):
    """Poisoned out/scratch: every split (empty ones too) and every output element is written; a
    padded graph row (seq_len 1 on a stale table row) gives a finite output. Both reductions: the
    fused one (the last split of a group combines) leaves its arrival counters at zero."""
    w = _World(shape, "cpu", torch.float32, seed=2)
    w.step([1, 2], [3, 40])
    spec, splits = w.spec, 4
    seq_lens = torch.tensor([3, 40, 1])
    rows = torch.tensor([1, 2, 7])  # row 7: never written (all zeros → slot 0, the sink)
    q = w._randn(3, w.h, spec.head_dim)
    out = torch.full((3, w.h, w.dv), float("nan"))
    part_out = torch.full((3, w.h, splits, w.dv), float("nan"))
    part_lse = torch.full((3, w.h, splits), float("nan"))
    k_buf = w.pool.key_buffer(LAYER)
    v_buf = None if w.rope else w.pool.value_buffer(LAYER)
    decode_attention(q, k_buf, v_buf, w.table.req_to_token, rows, seq_lens, spec.scaling, w.d,
                     w.dv, out, part_out, part_lse, fuse_reduce=fuse_reduce)
    assert not split_counters(q.device).any()
    assert not part_out.isnan().any() and not part_lse.isnan().any()
    assert part_lse[2, :, 1:].eq(float("-inf")).all()  # seq_len 1: only split 0 has keys
    assert out.isfinite().all()
    torch.testing.assert_close(out[:2], w._oracle(q[:2], [1, 2], [2, 39], [1, 1]))
    v_sink = w.pool.value_buffer(LAYER)[0].double().repeat_interleave(w.h // w.hkv, 0)
    torch.testing.assert_close(out[2], v_sink.float())  # one key: the output is its value


@CPU_ONLY
@pytest.mark.parametrize("split_causal", [True, False])
@pytest.mark.parametrize("shape", ["gqa8", "mla_odd"])
def test_extend_writes_every_element(shape, split_causal):
    """Poisoned out: every new token's row is written, none past them; a request with no new
    tokens between two that have some. Both loops: unmasked whole key blocks then the diagonal
    (split_causal), or every block masked (the default)."""
    w = _World(shape, "cpu", torch.float32, seed=5)
    w.step([1, 2], [70, 3])  # 70: a whole key block below the new rows
    fb = w.batch([1, 4, 2], [7, 0, 30], False, None)  # row 4: nothing cached, nothing new
    q = w._randn(37, w.h, w.spec.head_dim)
    k = w._randn(37, w.hkv, w.spec.head_dim)
    out = torch.full((38, w.h, w.dv), float("nan"))  # one spare row must stay untouched
    be = TritonAttentionBackend()
    be.init_forward_metadata(fb)
    store_kv(k, None if w.rope else w._randn(37, w.hkv, w.dv), fb.out_cache_loc,
             w.pool.key_buffer(LAYER), None if w.rope else w.pool.value_buffer(LAYER))
    meta = fb.attn_metadata
    extend_attention(q, w.pool.key_buffer(LAYER),
                     None if w.rope else w.pool.value_buffer(LAYER), w.table.req_to_token,
                     fb.req_pool_indices, meta.qo_start, meta.prefix_lens, meta.blk_req,
                     meta.blk_m, w.spec.scaling, w.d, w.dv, out, split_causal=split_causal)
    assert out[37].isnan().all() and not out[:37].isnan().any()
    torch.testing.assert_close(out[:37], w._oracle(q, [1, 4, 2], [70, 0, 3], [7, 0, 30]))


@CPU_ONLY
@pytest.mark.parametrize("shape", ["gqa4", "mla"])
def test_store_kv_touches_only_its_slots(shape):
    w = _World(shape, "cpu", torch.float32, seed=3)
    before = [b.clone() for b in w._buffers()]
    loc = torch.tensor([5, 17, 900])
    k = w._randn(3, w.hkv, w.spec.head_dim)
    v = None if w.rope else w._randn(3, w.hkv, w.dv)
    k_buf = w.pool.key_buffer(LAYER)
    v_buf = None if w.rope else w.pool.value_buffer(LAYER)
    store_kv(k[:, :, :], v, loc, k_buf, v_buf)
    expect = [b.clone() for b in before]
    layers = len(expect) // (1 if w.rope else 2)
    expect[LAYER][loc] = k
    if v is not None:
        expect[layers + LAYER][loc] = v
    assert all(torch.equal(a, b) for a, b in zip(w._buffers(), expect))


@CPU_ONLY
def test_store_kv_strided_inputs_and_dtype_cast():
    """k/v as column slices of one fused qkv projection, float32 into a bf16 pool."""
    pool = torch.zeros(10, 2, 16, dtype=torch.bfloat16)
    vpool = torch.zeros(10, 2, 8, dtype=torch.bfloat16)
    qkv = torch.randn(4, 2 * 16 + 2 * 8 + 8)
    k, v = qkv[:, 8:40].view(4, 2, 16), qkv[:, 40:].view(4, 2, 8)
    loc = torch.tensor([1, 3, 4, 9])
    store_kv(k, v, loc, pool, vpool)
    assert torch.equal(pool[loc], k.to(torch.bfloat16))
    assert torch.equal(vpool[loc], v.to(torch.bfloat16))
    assert pool[[0, 2, 5, 6, 7, 8]].eq(0).all()


@CPU_ONLY
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("shape", ["gqa2", "mla"])
def test_empty_batch(mode, shape):
    w = _World(shape, "cpu", torch.float32)
    be = create_attention_backend("triton")
    assert isinstance(be, TritonAttentionBackend) and be.graph_safe
    fb = w.batch([], [], mode == ForwardMode.DECODE, be)
    be.init_forward_metadata(fb)
    q = w._randn(0, w.h, w.spec.head_dim)
    k = w._randn(0, w.hkv, w.spec.head_dim)
    v = None if w.rope else w._randn(0, w.hkv, w.dv)
    assert be.forward(q, k, v, w.spec, fb).shape == (0, w.h, w.dv)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gqa4", "mla"])
def test_decode_replays_in_a_cuda_graph(shape):
    """A decode step captured once and replayed with the next step's contents in the same
    tensors (longer sequences, new slots, new q/k/v) gives that step's attention."""
    w = _World(shape, "cuda", torch.bfloat16, seed=4)
    rows = [1, 2, 6]
    w.step(rows, [5, 33, 1], tol=3e-2)
    be = TritonAttentionBackend()
    fb = w.batch(rows, [1, 1, 1], True, be)
    q = w._randn(3, w.h, w.spec.head_dim)
    k = w._randn(3, w.hkv, w.spec.head_dim)
    v = None if w.rope else w._randn(3, w.hkv, w.dv)
    be.init_forward_metadata(fb)
    be.forward(q, k, v, w.spec, fb)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.init_forward_metadata(fb)
        out = be.forward(q, k, v, w.spec, fb)
    for _ in range(2):
        nxt = w.batch(rows, [1, 1, 1], True, be)
        for dst, src in ((fb.out_cache_loc, nxt.out_cache_loc), (fb.seq_lens, nxt.seq_lens)):
            dst.copy_(src)
        for x in (q, k) if v is None else (q, k, v):
            x.copy_(torch.randn(x.shape, generator=w.gen).to(x))
        graph.replay()
        torch.cuda.synchronize()
        prefix = [n - 1 for n in nxt.seq_lens_cpu]
        ref = w._oracle(q, rows, prefix, [1, 1, 1])
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
