"""Typed entry points of the CPU decode kernels (decode.c, linear.c) over ctypes: each method
checks shapes and dtypes, allocates the outputs and calls one C function.

Why C and ctypes: each kernel replaces a chain of small torch ops whose dispatch dominated the CPU
decode step of small models; plain C compiles in about a second with no torch headers and no ABI
ties to the installed torch. Building the library, and trying it before use, is build.py's job;
this module only wraps a loaded one.
"""

from __future__ import annotations

import ctypes

import torch

_DT = {torch.float32: 0, torch.bfloat16: 1}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "ms_rms_norm": [_P, _P, _P, _I, _P, _P, _I, _I, _F, ctypes.c_int],
    "ms_qk_norm_rope": [_P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _F, ctypes.c_int],
    "ms_decode_attention": [_P, _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I,
                            _I, _I, _F, _P, _I, ctypes.c_int],
    "ms_topk_softmax": [_P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int],
    "ms_moe_experts": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int],
    "ms_has_bf16_dot": [],
    "ms_lm_head_argmax": [_P, _P, _P, _I, _I, _I],
    "ms_linear_w16": [_P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "ms_linear_w16_fma": [],
}

_RESTYPES = {"ms_qk_norm_rope": _I, "ms_has_bf16_dot": _I, "ms_lm_head_argmax": _I,
             "ms_linear_w16": _I, "ms_linear_w16_fma": _I}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DT


class CpuKernels:
    """Typed entry points of the compiled library. Every tensor argument is a CPU tensor of the
    call's dtype (float32 or bfloat16) whose rows are contiguous; callers check `supports`."""

    def __init__(self, lib: ctypes.CDLL, bf16_head: bool = False):
        """`bf16_head`: the greedy head passed its probe (it is built only with AVX512-BF16)."""
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
        self._lib = lib
        self.has_bf16_dot = bf16_head and bool(lib.ms_has_bf16_dot())  # the greedy LM head
        # `linear` built for AVX2 + FMA (elsewhere it runs, slower, on generic vectors)
        self.fast_linear = bool(lib.ms_linear_w16_fma())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm of x [T, N] (rows may be strided) as `layers.norm.RMSNorm` computes it; with a
        residual, (norm(x + residual), x + residual)."""
        t, n = x.shape
        assert x.stride(1) == 1 and weight.dtype == x.dtype and weight.is_contiguous()
        out = torch.empty((t, n), dtype=x.dtype)
        res_out = None
        if residual is not None:
            assert residual.is_contiguous() and residual.dtype == x.dtype
            res_out = torch.empty((t, n), dtype=x.dtype)
        self._lib.ms_rms_norm(out.data_ptr(), _ptr(res_out), x.data_ptr(), x.stride(0),
                              _ptr(residual), weight.data_ptr(), t, n, eps, _DT[x.dtype])
        return out if residual is None else (out, res_out)

    def qk_norm_rope(self, qkv: torch.Tensor, num_q: int, num_k: int, head_dim: int,
                     positions: torch.Tensor, table: torch.Tensor, rotary_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> None:
        """In place on qkv [T, >= (num_q + num_k) * head_dim]: per-head RMSNorm of the q and k
        heads (when weights are given), then neox rope with `table` [P, 2 * rotary_dim] float32
        (cos | cos | -sin | sin) at each token's position."""
        t = qkv.shape[0]
        assert qkv.stride(1) == 1 and table.dtype == torch.float32 and table.is_contiguous()
        assert positions.dtype == torch.int64 and positions.is_contiguous()
        bad = self._lib.ms_qk_norm_rope(qkv.data_ptr(), t, qkv.stride(0), num_q + num_k, num_q,
                                        head_dim, rotary_dim, positions.data_ptr(),
                                        table.data_ptr(), table.shape[0], _ptr(q_weight),
                                        _ptr(k_weight), eps, _DT[qkv.dtype])
        if bad:
            raise IndexError(f"position {int(positions[bad - 1])} is beyond the rope table "
                             f"({table.shape[0]} positions)")

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         loc: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                         scaling: float, share: torch.Tensor | None = None) -> torch.Tensor:
        """Stores k/v [B, Hkv, D|Dv] at slots `loc` of k_buf/v_buf [slots, Hkv, D|Dv], then
        attends q [B, H, D] over each request's positions [0, seq_lens[b]) (slots from row
        rows[b] of `table`) → [B, H, Dv], split over torch's intra-op thread count. `share`
        [B] int64: how many leading positions each row shares with the first row of its run (0
        starts a run; a verify pass's rows of one request), read once per run."""
        b, h, d = q.shape
        hkv, dv = v.shape[1], v.shape[2]
        for x in (q, k, v):
            assert x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.dtype == q.dtype
        for x in (k_buf, v_buf):
            assert x.is_contiguous() and x.dtype == q.dtype
        loc, rows, seq_lens = loc.contiguous(), rows.contiguous(), seq_lens.contiguous()
        if share is not None:
            share = share.contiguous()
            assert share.dtype == torch.int64 and share.shape == (b,)
        for x in (loc, table, rows, seq_lens):
            assert x.dtype == torch.int64 and (x.stride(-1) == 1 or x.shape[-1] == 1)
        out = torch.empty((b, h, dv), dtype=q.dtype)
        self._lib.ms_decode_attention(
            out.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
            v.stride(0), loc.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(),
            table.stride(0), rows.data_ptr(), seq_lens.data_ptr(), b, h, hkv, d, dv, scaling,
            _ptr(share), torch.get_num_threads(), _DT[q.dtype])
        return out

    def topk_softmax(self, logits: torch.Tensor, k: int, renormalize: bool):
        """logits [T, E] → (weights [T, k] float32, ids [T, k] int64) of the softmax top-k."""
        t, e = logits.shape
        assert logits.is_contiguous()
        weights = torch.empty((t, k), dtype=torch.float32)
        ids = torch.empty((t, k), dtype=torch.int64)
        self._lib.ms_topk_softmax(weights.data_ptr(), ids.data_ptr(), logits.data_ptr(), t, e, k,
                                  int(renormalize), _DT[logits.dtype])
        return weights, ids

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, first_expert: int) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the experts stacked in w13
        [E, 2I, H] ([gate | up]) and w2 [E, H, I], which hold ids [first_expert, first_expert +
        E); other ids contribute nothing. x [T, H] → [T, H]."""
        t, h = x.shape
        e, two_i, _ = w13.shape
        x, ids = x.contiguous(), ids.contiguous()
        weights = weights.to(torch.float32).contiguous()
        assert w13.is_contiguous() and w2.is_contiguous() and w13.dtype == w2.dtype == x.dtype
        assert ids.dtype == torch.int64 and w2.shape == (e, h, two_i // 2)
        out = torch.empty((t, h), dtype=x.dtype)
        self._lib.ms_moe_experts(out.data_ptr(), x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                                 w13.data_ptr(), w2.data_ptr(), t, ids.shape[1], h, two_i // 2,
                                 first_expert, e, _DT[x.dtype])
        return out

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear weight [N, K] as `linear` reads it: bf16 [ceil(N / 16), K, 16], zero rows
        past N (rounded to bf16 when it is not)."""
        n, k = weight.shape
        padded = torch.zeros((-(-n // 16) * 16, k), dtype=torch.bfloat16)
        padded[:n] = weight
        return padded.view(-1, 16, k).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (float32 or bf16) · W^T (+ bias) → [..., n] in x's dtype, from `packed`
        (pack_linear) in float32 arithmetic on torch's intra-op thread count."""
        k = x.shape[-1]
        assert packed.shape[1:] == (k, 16) and packed.dtype == torch.bfloat16
        x2 = x.reshape(-1, k).contiguous()
        if bias is not None:
            assert bias.dtype == x.dtype and bias.is_contiguous()
        out = torch.empty((x2.shape[0], n), dtype=x.dtype)
        if self._lib.ms_linear_w16(out.data_ptr(), x2.data_ptr(), packed.data_ptr(), _ptr(bias),
                                   x2.shape[0], n, k, torch.get_num_threads(), _DT[x.dtype]):
            raise MemoryError(f"ms_linear_w16: no memory for {x2.shape[0]} x {k} activations")
        return out.view(*x.shape[:-1], n)

    def pack_greedy_head(self, weight: torch.Tensor) -> torch.Tensor:
        """An LM head weight [V, H] bf16 in the layout of `greedy_head`: [ceil(V / 16), H / 2,
        16, 2], zero rows past V."""
        v, h = weight.shape
        assert weight.dtype == torch.bfloat16 and h % 2 == 0
        padded = torch.zeros((-(-v // 16) * 16, h), dtype=weight.dtype)
        padded[:v] = weight
        return padded.view(-1, 16, h // 2, 2).transpose(1, 2).contiguous()

    def greedy_head(self, x: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """argmax_v of the bf16 logits x · W[v] ([T, H] → [T] int64, first id on ties) without
        writing the logits; None when some logit is NaN (then compute them and take argmax)."""
        t, h = x.shape
        assert self.has_bf16_dot and x.dtype == torch.bfloat16
        assert packed.shape[1:] == (h // 2, 16, 2)
        x = x.contiguous()
        out = torch.empty(t, dtype=torch.int64)
        status = self._lib.ms_lm_head_argmax(out.data_ptr(), x.data_ptr(), packed.data_ptr(),
                                             vocab, h, t)
        return out if status == 0 else None


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()
