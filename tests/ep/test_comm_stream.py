"""The CUDA side of two-batch overlap's communication, checked on CPU: the side-stream ordering of
`CommStream` through a recording stand-in for the CUDA stream operations, the loopback dispatcher
driven through it (overlapped results equal plain ones, every launch joined before its output is
used), and the p2p copy kernels with a bounded grid in Triton's interpreter against their torch
path. The dispatchers' overlapped path across gloo ranks is in test_dispatchers.py."""

from __future__ import annotations

import pytest
import torch
from recording_streams import RecordingOps

import moeserve.kernels.triton.peer_copy as peer_copy
from moeserve.distributed import single_rank_mesh
from moeserve.ep.loopback import LoopbackDispatcher
from moeserve.ep.streams import CommStream
from moeserve.layers.moe import MoEExperts


def test_cpu_comm_stream_is_a_no_op():
    comm = CommStream(torch.device("cpu"))
    assert not comm.use(True) and comm.done(False) is None
    with comm.launch(False), comm.finish(False):
        pass
    comm.join(None, (torch.ones(1),))


def test_launch_waits_for_compute_and_join_hands_over():
    ops = RecordingOps()
    comm = CommStream(torch.device("cpu"), ops)
    assert comm.use(True) and not comm.use(False)
    with comm.launch(True):
        assert ops.on_side
    event = comm.done(True)
    with comm.finish(True):
        out = torch.zeros(3)
    comm.join(comm.done(True), (out, None))
    assert [e[0] for e in ops.log] == ["side waits compute", "enter side", "leave side", "record",
                                       "enter side", "leave side", "record", "compute waits",
                                       "handed over"]
    assert ops.handed == [out] and event in ops.recorded


E, H, I, K = 8, 16, 12, 3


def _experts() -> MoEExperts:
    m = MoEExperts(E, H, I)
    g = torch.Generator().manual_seed(0)
    m.w13.data = torch.randn(m.w13.shape, generator=g) * 0.1
    m.w2.data = torch.randn(m.w2.shape, generator=g) * 0.1
    return m


@pytest.mark.parametrize("overlapped", [False, True])
def test_loopback_two_in_flight_equals_experts(overlapped):
    ops = RecordingOps()
    d = LoopbackDispatcher(single_rank_mesh(torch.device("cpu")), E, H, torch.float32)
    d.comm = CommStream(torch.device("cpu"), ops)
    experts, g = _experts(), torch.Generator().manual_seed(1)
    batches = [(torch.randn(t, H, generator=g), torch.randint(0, E, (t, K), generator=g),
                torch.rand(t, K, generator=g)) for t in (5, 0)]
    handles = [d.dispatch_start(*b, overlapped=overlapped) for b in batches]
    outs = [d.dispatch_wait(h) for h in handles]
    combines = [d.combine_start(d.experts_forward(experts, o), o) for o in outs]
    results = [d.combine_wait(c) for c in reversed(combines)][::-1]
    for b, y in zip(batches, results):
        torch.testing.assert_close(y, experts.forward_loop(*b), rtol=1e-6, atol=1e-6)
    if overlapped:  # 2 dispatches + 2 combines: each launched after compute, each joined
        assert sum(e[0] == "side waits compute" for e in ops.log) == 4
        assert ops.waited == ops.recorded and len(ops.recorded) == 4
        assert len(ops.handed) == 2 * 3 + 2  # the copies of x, ids, weights; the outputs
    else:
        assert ops.log == []


# ---- p2p copy kernels, bounded grid, in Triton's interpreter -------------------------------------
@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Run peer_copy's Triton kernels on CPU tensors (TRITON_INTERPRET=1, set by conftest)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; tests/gpu/test_peer_copy.py runs the kernels")
    monkeypatch.setattr(peer_copy, "_use_kernel", lambda t: True)


def _torch_path(fn, *args, **kwargs):
    saved = peer_copy._use_kernel
    peer_copy._use_kernel = lambda t: False
    try:
        return fn(*args, **kwargs)
    finally:
        peer_copy._use_kernel = saved


@pytest.mark.parametrize("ep,me,k", [(2, 0, 3), (4, 3, 2)])
@pytest.mark.parametrize("max_programs", [None, 1, 3])
def test_bounded_copy_kernels_match_torch(kernels_on_cpu, ep, me, k, max_programs):
    t, t_max, per_rank, h = 5, 7, 4, 40
    g = torch.Generator().manual_seed(ep)
    x = torch.randn(t, h, generator=g)
    ids = torch.rand(t, per_rank * ep, generator=g).topk(k, dim=1).indices
    ids[2] = -1  # a token routed nowhere
    w = torch.rand(t, k, generator=g)
    rows = ep * t_max

    def poisoned(cols, dtype):
        return [torch.full((rows, cols), -7, dtype=dtype) for _ in range(ep)]

    kx, km, cx, cm = poisoned(h, x.dtype), poisoned(2 * k, torch.int32), poisoned(
        h, x.dtype), poisoned(2 * k, torch.int32)
    peer_copy.dispatch_rows(x, ids, w, kx, km, me, t_max, per_rank, max_programs=max_programs)
    _torch_path(peer_copy.dispatch_rows, x, ids, w, cx, cm, me, t_max, per_rank)
    for a, b in zip(kx + km, cx + cm):
        assert torch.equal(a, b)
    y = torch.randn(rows, h, generator=g)
    ky, cy = poisoned(h, y.dtype), poisoned(h, y.dtype)
    peer_copy.combine_rows(y, cm[me], ky, me, t_max, me * per_rank, per_rank,
                           max_programs=max_programs)
    _torch_path(peer_copy.combine_rows, y, cm[me], cy, me, t_max, me * per_rank, per_rank)
    for a, b in zip(ky, cy):
        assert torch.equal(a, b)


def test_program_bound():
    assert peer_copy._programs(100, 1, None) == 100
    assert peer_copy._programs(100, 1, 33) == 33
    assert peer_copy._programs(100, 2, 33) == 16  # chunks per row share the bound
    assert peer_copy._programs(5, 1, 33) == 5 and peer_copy._programs(100, 4, 2) == 1
