"""The deepep adapter against the REAL DeepEP on several GPUs: test_dispatchers.py's checks (there
against the emulation), here on CUDA/NCCL with bf16 and a hidden size DeepEP's low-latency kernels
are built for.

dispatch → local experts → combine equals one process holding all experts (float32 reference,
bf16 tolerance) for normal, low_latency and auto modes, over uneven token counts (an idle rank,
then every rank idle), with and without the per-rank counts, two dispatches in flight, plain and
overlapped (DeepEP's communication stream). Needs >= 2 GPUs and an importable `deep_ep`
(scripts/build_deepep.sh; `scripts/gpu_check.sh deepep` runs it); skipped otherwise.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from test_dispatchers import run_ranks

from moeserve.core import ForwardMode
from moeserve.ep.dispatcher import LOW_LATENCY, STANDARD, create_dispatcher
from moeserve.layers.moe import MoEExperts

E, H, I, K = 32, 2048, 128, 4  # H: one of DeepEP's low-latency hidden sizes
MAX_LL_TOKENS = 32  # per rank per step; (ranks * 32) % 4 == 0 as the TMA kernels want
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
MODES = ["normal", "low_latency", "auto"]


def _deep_ep_ready() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2+ CUDA devices"
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        return f"deep_ep does not import ({e}): scripts/build_deepep.sh"
    return None


pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(_deep_ep_ready() is not None,
                                                       reason=str(_deep_ep_ready()))]


def _tokens(world: int, step: int) -> list[int]:
    """Per-rank token counts: rank (1 + step) % world idle, step 2 all idle."""
    if step == 2:
        return [0] * world
    counts = [(5 + 7 * r + 3 * step) % (MAX_LL_TOKENS - 1) + 1 for r in range(world)]
    counts[(1 + step) % world] = 0
    return counts


def _full_experts(device: torch.device) -> MoEExperts:
    m = MoEExperts(E, H, I)
    g = torch.Generator().manual_seed(0)  # same weights on every rank, O(1) outputs
    m.w13.data = torch.randn(m.w13.shape, generator=g) / H ** 0.5
    m.w2.data = torch.randn(m.w2.shape, generator=g) / I ** 0.5
    return m.to(device)


def _shard(full: MoEExperts, rank: int, world: int) -> MoEExperts:
    n = E // world
    m = MoEExperts(E, H, I, first_expert=rank * n, num_local=n)
    own = slice(rank * n, (rank + 1) * n)
    m.w13.data = full.w13.data[own].to(torch.bfloat16)
    m.w2.data = full.w2.data[own].to(torch.bfloat16)
    return m


def _inputs(rank: int, step: int, t: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else \
        torch.empty(0, K, dtype=torch.int64)
    w = torch.rand(t, K, generator=g)
    return x.to(device, torch.bfloat16), ids.to(device), w.to(device)


def _moe(d, local, x, ids, w, mode, tokens_per_rank=None):
    out = d.dispatch(x, ids, w, mode, tokens_per_rank)
    return d.combine(d.experts_forward(local, out), out), out


def _close(got: torch.Tensor, full: MoEExperts, x, ids, w, what: str) -> None:
    want = full.forward_loop(x.float(), ids, w)  # float32 experts and input
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2,
                               msg=lambda m: f"{what}: {m}")


def _check(rank: int, world: int, mode: str) -> None:
    from moeserve.distributed import ParallelMesh

    device = torch.device("cuda", rank)
    g = torch.distributed.group.WORLD
    mesh = ParallelMesh(rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank,
                        ep_size=world, device=device, world_group=g, cpu_group=g, ep_group=g)
    full = _full_experts(device)
    local = _shard(full, rank, world)
    d = create_dispatcher("deepep", mesh, E, H, torch.bfloat16, deepep_mode=mode,
                          max_dispatch_tokens_per_rank=MAX_LL_TOKENS)
    modes = [EXTEND, DECODE, DECODE, EXTEND] if mode == "auto" else [EXTEND] * 4
    formats = []
    for step, fmode in enumerate(modes):
        counts = _tokens(world, step)
        x, ids, w = _inputs(rank, step, counts[rank], device)
        got, out = _moe(d, local, x, ids, w, fmode, counts if step % 2 else None)
        formats.append(out.format)
        per_expert = torch.zeros(E, dtype=torch.int64, device=device)
        n = E // world
        per_expert[rank * n:(rank + 1) * n] = out.tokens_per_expert.long()
        want = torch.bincount(ids.flatten(), minlength=E)
        torch.distributed.all_reduce(per_expert)
        torch.distributed.all_reduce(want)
        assert per_expert.tolist() == want.tolist(), (step, per_expert, want)
        _close(got, full, x, ids, w, f"{mode} step {step}")
    expected = {"low_latency": [LOW_LATENCY] * 4,
                "auto": [STANDARD, LOW_LATENCY, LOW_LATENCY, STANDARD]}
    assert formats == expected.get(mode, [STANDARD] * 4), formats
    for overlapped in (False, True):
        _two_in_flight(d, full, local, rank, world, modes[1], overlapped, device)
    torch.cuda.synchronize(device)
    torch.distributed.barrier()


def _two_in_flight(d, full, local, rank, world, mode, overlapped, device) -> None:
    """start A, start B, wait A, wait B; both combines in flight, waited in reverse order."""
    a = _inputs(rank, 10, _tokens(world, 0)[rank], device)
    b = _inputs(rank, 11, _tokens(world, 1)[rank], device)
    ha = d.dispatch_start(*a, mode, overlapped=overlapped)
    hb = d.dispatch_start(*b, mode, overlapped=overlapped)
    oa, ob = d.dispatch_wait(ha), d.dispatch_wait(hb)
    ca = d.combine_start(d.experts_forward(local, oa), oa)
    cb = d.combine_start(d.experts_forward(local, ob), ob)
    yb, ya = d.combine_wait(cb), d.combine_wait(ca)
    _close(ya, full, *a, f"two in flight A (overlapped={overlapped})")
    _close(yb, full, *b, f"two in flight B (overlapped={overlapped})")


def _worker(rank: int, world: int, port: int, mode: str, results) -> None:
    try:
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=rank, world_size=world,
                                             device_id=torch.device("cuda", rank))
        _check(rank, world, mode)
        results.put((rank, None))
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _world_sizes() -> list[int]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return sorted({2, n}) if n >= 2 else [2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", _world_sizes())
@pytest.mark.parametrize("mode", MODES)
def test_real_deepep_equals_all_experts(world, mode):
    run_ranks(world, mode, 240.0, worker=_worker, join_s=10.0)
