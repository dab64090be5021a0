"""Live rebalance moves FP8 experts with their block scales: on 2 gloo ranks, after `rebalance`
every local slot holds exactly (bit for bit) the e4m3 weights and scales of the logical expert
the new placement gives it, some of them received from the other rank."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback

import pytest
import torch

from moeserve.kernels.fp8_format import quantize_fp8_blocks

E, H, I, LAYERS, REDUNDANT = 6, 200, 72, 2, 2  # 8 slots, 4 per rank; partial 128 blocks


def _expert_tensors(layer: int, e: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of logical expert e (FP8 + scales), the same on every rank."""
    g = torch.Generator().manual_seed(100 * layer + e)
    out = {}
    for shard, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
        out[shard], out[shard + "_scale"] = quantize_fp8_blocks(torch.randn(shape, generator=g))
    return out


def _load(m, layer: int) -> None:
    for e in sorted(set(m.slot_logical)):
        t = _expert_tensors(layer, e)
        for shard in ("gate", "up", "down"):
            w, s = (m.w2, m.w2_scale_inv) if shard == "down" else (m.w13, m.w13_scale_inv)
            m.weight_loader(w, t[shard], e, shard)
            m.weight_loader(s, t[shard + "_scale"], e, shard)


def _check_slots(m, layer: int) -> None:
    for local, e in enumerate(m.slot_logical):
        t = _expert_tensors(layer, e)
        want13 = torch.cat([t["gate"], t["up"]]).view(torch.uint8)
        assert torch.equal(m.w13[local].view(torch.uint8), want13), (layer, local, e)
        assert torch.equal(m.w2[local].view(torch.uint8), t["down"].view(torch.uint8))
        assert torch.equal(m.w13_scale_inv[local], torch.cat([t["gate_scale"], t["up_scale"]]))
        assert torch.equal(m.w2_scale_inv[local], t["down_scale"])


def _run(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from moeserve.distributed import ParallelMesh
    from moeserve.eplb.location import ExpertLocation
    from moeserve.eplb.rebalancer import rebalance
    from moeserve.layers.moe_parallel import MoEParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.group.WORLD
    mesh = ParallelMesh(rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank,
                        ep_size=world, device=torch.device("cpu"), world_group=group,
                        cpu_group=dist.new_group(backend="gloo"), ep_group=group)
    loc = ExpertLocation.trivial(LAYERS, E, world, REDUNDANT, ep_rank=rank)
    par = MoEParallel(ep_rank=rank, ep_size=world, location=loc, fp8_block=(128, 128))
    experts = {layer: par.make_experts(E, H, I, layer) for layer in range(LAYERS)}
    before = {layer: list(m.slot_logical) for layer, m in experts.items()}
    for layer, m in experts.items():
        _load(m, layer)
        _check_slots(m, layer)
    counts = torch.zeros(LAYERS, E + REDUNDANT, dtype=torch.int64)
    counts[:, 0], counts[:, 1], counts[:, 5] = 900, 700, 400  # hot experts: replicate, spread
    result = rebalance(experts, loc, counts, mesh)
    for layer, m in experts.items():
        _check_slots(m, layer)
    arrived = torch.tensor([sum(e not in before[layer] for layer, m in experts.items()
                                for e in m.slot_logical)])
    dist.all_reduce(arrived)  # experts some rank did not hold before: they came over the wire
    assert result.moved_slots > 0 and int(arrived) > 0, (before, result)
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, results) -> None:
    try:
        _run(rank, world, port)
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_rebalance_moves_fp8_experts_with_their_scales():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    errors = {}
    try:
        for _ in procs:
            rank, err = results.get(timeout=100)
            if err:
                errors[rank] = err
                break
    except queue.Empty:
        errors[-1] = "a rank gave no result within 100 s"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
