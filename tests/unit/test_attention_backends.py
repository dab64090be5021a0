"""The torch and cpu attention backends against attention written out per request in float64, over
decode steps that extend the last one (kept K/V), change the batch, cross a length bucket, and
re-admit a row through an extend step."""

from __future__ import annotations

import pytest
import torch

from moeserve.attention.base import AttentionSpec
from moeserve.attention.cpu_backend import CpuAttentionBackend
from moeserve.attention.torch_backend import TorchAttentionBackend
from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.kvcache.pool import MHAKVPool
from moeserve.kvcache.table import ReqToTokenPool
from moeserve.kernels.cpu.build import load_cpu_kernels

H, HKV, D, LAYERS = 4, 2, 8, 2
SPECS = [AttentionSpec(i, H, HKV, D, D, D**-0.5) for i in range(LAYERS)]


def _backend(name: str, kernel_cache: str | None = None):
    if name == "torch":
        return TorchAttentionBackend()
    kernels = load_cpu_kernels(kernel_cache)
    if kernels is None:
        pytest.skip("no C compiler: the cpu backend's kernels cannot be built")
    return CpuAttentionBackend(kernels)


class _World:
    def __init__(self, dtype: torch.dtype = torch.float32):
        self.table = ReqToTokenPool(8, 256, "cpu")
        self.pool = MHAKVPool(2048, LAYERS, HKV, D, D, dtype, "cpu")
        self.next_slot = 1
        self.lens = {}  # row → tokens in the cache
        self.gen = torch.Generator().manual_seed(0)

    def step(self, backend, rows: list[int], extend: dict[int, int] | None = None):
        """One forward over `rows` (each gains extend.get(row, 1) tokens): → (backend out, oracle)
        per layer."""
        extend = extend or {}
        new = [extend.get(r, 1) for r in rows]
        prefix = [self.lens.get(r, 0) for r in rows]
        slots = torch.arange(self.next_slot, self.next_slot + sum(new))
        self.next_slot += sum(new)
        i = 0
        for r, p, n in zip(rows, prefix, new):
            self.table.write(r, p, slots[i : i + n])
            self.lens[r] = p + n
            i += n
        decode = not extend
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.zeros(sum(new), dtype=torch.int64),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)]),
            out_cache_loc=slots, req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor([p + n for p, n in zip(prefix, new)]),
            seq_lens_cpu=[p + n for p, n in zip(prefix, new)], extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=new, req_to_token_pool=self.table, kv_pool=self.pool,
            attn_backend=backend)
        backend.init_forward_metadata(fb)
        results = []
        for spec in SPECS:
            t = sum(new)
            q, k, v = (torch.randn(t, h, D, generator=self.gen).to(self.pool.dtype)
                       for h in (H, HKV, HKV))
            out = backend.forward(q, k, v, spec, fb)
            # the new tokens' K/V were stored at their slots, exactly
            assert torch.equal(self.pool.k[spec.layer_id][slots], k)
            assert torch.equal(self.pool.v[spec.layer_id][slots], v)
            results.append((out, self._oracle(q, spec, rows, prefix, new)))
        return results

    def _oracle(self, q, spec, rows, prefix, new):
        outs, i = [], 0
        for r, p, n in zip(rows, prefix, new):
            idx = self.table.req_to_token[r, : p + n]
            k = self.pool.k[spec.layer_id][idx].double()  # [S, Hkv, D]
            v = self.pool.v[spec.layer_id][idx].double()
            for j in range(n):
                qh = q[i + j].double()  # [H, D]
                kh = k[: p + j + 1].repeat_interleave(H // HKV, dim=1)  # [S, H, D]
                vh = v[: p + j + 1].repeat_interleave(H // HKV, dim=1)
                w = torch.einsum("hd,shd->hs", qh, kh) * spec.scaling
                outs.append(torch.einsum("hs,shd->hd", w.softmax(-1), vh))
            i += n
        return torch.stack(outs).float()


@pytest.mark.parametrize("name,dtype,tol", [("torch", torch.float32, 1e-5),
                                            ("cpu", torch.float32, 1e-5),
                                            ("cpu", torch.bfloat16, 2e-2)])
def test_decode_steps_match_per_request_attention(name, dtype, tol, kernel_cache):
    world, backend = _World(dtype), _backend(name, kernel_cache)
    world.step(backend, [1, 2, 3], extend={1: 5, 2: 9, 3: 60})
    plan = [[1, 2, 3]] * 6  # kept K/V extended; request 3 crosses the 64-token bucket
    plan += [[1, 3]] * 2  # request 2 left: gathered afresh, then kept again
    for rows in plan:
        for out, ref in world.step(backend, rows):
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    # row 2 re-admitted with a new prompt one token shorter than it had: an extend step in between
    world.lens[2] = 0
    world.step(backend, [2], extend={2: world.lens[1] - 1})
    for rows in [[1, 2, 3]] * 3:
        for out, ref in world.step(backend, rows):
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_kept_decode_kv_equals_fresh_gather():
    """Extending the kept K/V gives bit-identical outputs to gathering it afresh every step."""
    (w_kept, w_fresh), kept = (_World(), _World()), TorchAttentionBackend()
    w_kept.step(kept, [1, 2], extend={1: 3, 2: 7})
    w_fresh.step(TorchAttentionBackend(), [1, 2], extend={1: 3, 2: 7})
    for _ in range(5):
        a = w_kept.step(kept, [1, 2])
        b = w_fresh.step(TorchAttentionBackend(), [1, 2])
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
        assert sorted(kept._kept) == [0, 1]  # every layer kept its K/V for the next step
        assert kept._kept_bytes == sum(e.k.nbytes + e.v.nbytes for e in kept._kept.values())
