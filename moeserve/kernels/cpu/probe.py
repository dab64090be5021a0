"""Run-time probe of a built CPU decode kernel library, in a child process of its own:
`python -m moeserve.kernels.cpu.probe LIB.so` runs every kernel once on small inputs and checks it
against plain torch math, printing `kernels ok`, then `bf16_head ok` (or `bf16_head absent`).

Why a child process: code built with -march=native (or flags naming an ISA extension) may hold an
instruction this CPU cannot run, and SIGILL cannot be caught in the process that runs it. The
parent (`build.load_cpu_kernels`) reads the lines and the exit status: no `kernels ok` → no
kernels (torch ops); `kernels ok` without `bf16_head ok` → the kernels without the greedy head.
"""

from __future__ import annotations

import ctypes
import sys

import torch

BF16, F32 = torch.bfloat16, torch.float32


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        err = (got.float() - want.float()).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err:.3g} over tolerance {tol}")


def check_kernels(k) -> None:
    """Each kernel of `k` (a CpuKernels) in float32 and bfloat16 against torch; raises on error."""
    g = torch.Generator().manual_seed(0)
    for dt, tol in ((F32, 1e-4), (BF16, 6e-2)):
        x = torch.randn(3, 40, generator=g).to(dt)
        w = torch.randn(40, generator=g).to(dt)
        xf = x.float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        _close(k.rms_norm(x, w, 1e-6), ref, f"rms_norm {dt}", tol)

        qkv = torch.randn(2, 4 * 16, generator=g).to(dt)  # 2 q + 1 k + 1 v heads of 16
        table = torch.cat([torch.ones(1, 16), torch.zeros(1, 16)], dim=1)  # position 0: identity
        out = qkv.clone()
        k.qk_norm_rope(out, 2, 1, 16, torch.zeros(2, dtype=torch.int64), table, 16, None, None,
                       0.0)
        _close(out, qkv, f"qk_norm_rope {dt}", tol)

        logits = torch.randn(5, 8, generator=g).to(dt)
        weights, ids = k.topk_softmax(logits, 2, True)
        top = logits.float().softmax(-1).topk(2, dim=-1)
        _close(weights, top.values / top.values.sum(-1, keepdim=True), f"topk {dt}", tol)

        _check_attention(k, dt, tol, g)
        _check_experts(k, dt, tol, g)
        _check_linear(k, dt, tol, g)


def _check_attention(k, dt: torch.dtype, tol: float, g: torch.Generator) -> None:
    b, h, hkv, d, n = 2, 4, 2, 16, 11
    table = torch.arange(1, 1 + b * n, dtype=torch.int64).view(b, n)
    k_buf = torch.randn(64, hkv, d, generator=g).to(dt)
    v_buf = torch.randn(64, hkv, d, generator=g).to(dt)
    q = torch.randn(b, h, d, generator=g).to(dt)
    kn, vn = torch.randn(b, hkv, d, generator=g).to(dt), torch.randn(b, hkv, d, generator=g).to(dt)
    rows, lens = torch.arange(b), torch.full((b,), n)
    loc = table[:, n - 1].contiguous()
    out = k.decode_attention(q, kn, vn, loc, k_buf, v_buf, table, rows, lens, d**-0.5)
    for i in range(b):
        kk = k_buf[table[i]].float().repeat_interleave(h // hkv, dim=1)  # [S, H, D]
        vv = v_buf[table[i]].float().repeat_interleave(h // hkv, dim=1)
        p = (torch.einsum("hd,shd->hs", q[i].float(), kk) * d**-0.5).softmax(-1)
        _close(out[i], torch.einsum("hs,shd->hd", p, vv), f"decode_attention {dt}", tol)


def _check_experts(k, dt: torch.dtype, tol: float, g: torch.Generator) -> None:
    t, hidden, inter, e = 3, 32, 16, 4
    x = torch.randn(t, hidden, generator=g).to(dt)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(dt)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(dt)
    ids = torch.tensor([[0, 3], [1, 2], [3, 1]])
    wts = torch.rand(t, 2, generator=g)
    out = k.moe_experts(x, ids, wts, w13, w2, 0)
    ref = torch.zeros(t, hidden)
    for i in range(t):
        for j in range(2):
            gu = w13[ids[i, j]].float() @ x[i].float()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            ref[i] += wts[i, j] * (w2[ids[i, j]].float() @ act)
    _close(out, ref, f"moe_experts {dt}", tol * 4)


def _check_linear(k, dt: torch.dtype, tol: float, g: torch.Generator) -> None:
    """Rows past a tile (13 = 6 + 6 + 1), outputs past a block (37 = 2 x 16 + 5), a bias, two
    threads (the OpenMP split; one runs where the build has no OpenMP)."""
    x = torch.randn(13, 24, generator=g).to(dt)
    w = (torch.randn(37, 24, generator=g) * 0.2).to(BF16)
    bias = torch.randn(37, generator=g).to(dt)
    ref = x.float() @ w.float().T + bias.float()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = k.linear(x, k.pack_linear(w), 37, bias)
    finally:
        torch.set_num_threads(threads)
    _close(out, ref, f"linear {dt}", tol)


def check_bf16_head(k) -> None:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(53, 32, generator=g) * 0.1).to(BF16)
    x = torch.randn(3, 32, generator=g).to(BF16)
    ids = k.greedy_head(x, k.pack_greedy_head(w), 53)
    if ids is None or not torch.equal(ids, torch.nn.functional.linear(x, w).argmax(-1)):
        raise AssertionError(f"greedy head gave {ids}")


def main(path: str) -> int:
    from moeserve.kernels.cpu.ops import CpuKernels

    torch.set_num_threads(1)
    k = CpuKernels(ctypes.CDLL(path), bf16_head=True)
    check_kernels(k)
    print("kernels ok", flush=True)
    if not k.has_bf16_dot:
        print("bf16_head absent", flush=True)
        return 0
    check_bf16_head(k)  # last: an illegal instruction here still leaves the kernels usable
    print("bf16_head ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
