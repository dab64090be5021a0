"""Two-batch overlap's CUDA path on one GPU (run by `scripts/gpu_check.sh tbo`): the side stream of
ep/streams.py really orders work (a long copy on the side stream is waited for by the compute
stream), the loopback dispatcher's overlapped calls give exact results with two in flight, the
p2p copy kernels with a bounded grid launched from a side stream equal their torch path, and a
forced TBO forward (Triton attention and MoE, loopback copies on the side stream) equals the plain
one. Multi-GPU dispatchers run in tests/ep on gloo; on NCCL through scripts/gpu_dp_check.py."""

from __future__ import annotations

import pytest
import torch
from parity import make_runner
from tbo_checks import check_forced_tbo_with_loopback

from moeserve.distributed import single_rank_mesh
from moeserve.ep.loopback import LoopbackDispatcher
from moeserve.ep.streams import CommStream
from moeserve.kernels.triton.peer_copy import combine_rows, dispatch_rows
from moeserve.layers.moe import MoEExperts

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.set_device(0)


def test_side_stream_orders_a_long_copy():
    dev = torch.device("cuda", 0)
    comm = CommStream(dev)
    assert comm.use(True) and not comm.use(False)
    src = torch.arange(1 << 24, device=dev, dtype=torch.float32)  # 64 MB, exact integers
    torch.cuda._sleep(50_000_000)  # the compute stream is busy: the side stream must wait for it
    src.add_(1)
    with comm.launch(True):
        dst = src.clone()
        dst.mul_(2)
    with comm.finish(True):
        total = dst.sum(dtype=torch.float64)
    comm.join(comm.done(True), (dst, total))
    n = src.numel()
    assert total.item() == 2 * (n * (n - 1) / 2 + n)
    assert torch.equal(dst[-3:], 2 * src[-3:])


def test_loopback_overlapped_two_in_flight():
    dev = torch.device("cuda", 0)
    e, h, inter, k = 16, 256, 128, 4
    experts = MoEExperts(e, h, inter).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    experts.w13.data.normal_(generator=g).mul_(0.05)
    experts.w2.data.normal_(generator=g).mul_(0.05)
    d = LoopbackDispatcher(single_rank_mesh(dev), e, h, torch.float32)
    batches = [(torch.randn(t, h, device=dev, generator=g),
                torch.randint(0, e, (t, k), device=dev, generator=g),
                torch.rand(t, k, device=dev, generator=g)) for t in (3000, 17)]
    handles = [d.dispatch_start(*b, overlapped=True) for b in batches]
    assert all(hd.on_side for hd in handles)
    outs = [d.dispatch_wait(hd) for hd in handles]
    combines = [d.combine_start(d.experts_forward(experts, o), o) for o in outs]
    got = [d.combine_wait(c) for c in reversed(combines)][::-1]
    for b, y in zip(batches, got):
        torch.testing.assert_close(y, experts(*b), rtol=1e-5, atol=1e-5)


def test_bounded_copy_kernels_on_a_side_stream():
    ep, me, k, h, t, t_max, per = 4, 2, 8, 7168, 300, 320, 8
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.rand(t, per * ep, generator=g).topk(k, dim=1).indices
    w = torch.rand(t, k, generator=g)
    ref_x = [torch.zeros(ep * t_max, h, dtype=torch.bfloat16) for _ in range(ep)]
    ref_m = [torch.zeros(ep * t_max, 2 * k, dtype=torch.int32) for _ in range(ep)]
    dispatch_rows(x, ids, w, ref_x, ref_m, me, t_max, per)
    gx = [b.cuda().zero_() for b in ref_x]
    gm = [b.cuda().zero_() for b in ref_m]
    comm = CommStream(torch.device("cuda", 0))
    xc, idc, wc = x.cuda(), ids.cuda(), w.cuda()
    with comm.launch(True):
        dispatch_rows(xc, idc, wc, gx, gm, me, t_max, per, max_programs=5)
    comm.join(comm.done(True))
    for a, b in zip(gx + gm, ref_x + ref_m):
        assert torch.equal(a.cpu(), b)
    y = torch.randn(ep * t_max, h, generator=g).bfloat16()
    ref_y = [torch.zeros(ep * t_max, h, dtype=torch.bfloat16) for _ in range(ep)]
    combine_rows(y, ref_m[me], ref_y, me, t_max, me * per, per)
    gy = [b.cuda().zero_() for b in ref_y]
    with comm.launch(True):
        combine_rows(y.cuda(), gm[me], gy, me, t_max, me * per, per, max_programs=5)
    comm.join(comm.done(True))
    for a, b in zip(gy, ref_y):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_forced_tbo_with_loopback_on_cuda(tiny_model, arch):
    runner = make_runner(tiny_model(arch), ["device=cuda", "cuda_graph.enabled=false",
                                            "attention.backend=triton", "moe.backend=triton"])
    check_forced_tbo_with_loopback(runner, tol=1e-3)
