"""dispatch → local experts → combine equals one process holding all experts, for every backend.

On 2 and 4 gloo ranks with uneven token counts (one rank idle, then all idle), with and without the
per-rank counts given, and with two dispatches in flight, plain and overlapped (the TBO path: the
CUDA side-stream calls run through a recording stand-in, DeepEP gets its stream options). p2p runs
over shared-memory files. deepep runs against the in-repo emulation in fake_deep_ep.py. The
cases of a world size run in one pool of rank processes (RankPool).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback

import pytest
import torch
from recording_streams import RecordingOps

from moeserve.core import ForwardMode
from moeserve.ep.dispatcher import LOW_LATENCY, STANDARD, create_dispatcher, expert_owner
from moeserve.ep.streams import CommStream
from moeserve.layers.moe import MoEExperts

E, H, I, K = 8, 32, 24, 3
MAX_LL_TOKENS = 16  # DeepEP low-latency: max tokens any rank dispatches in one step
TOKENS = {2: [0, 11], 4: [5, 0, 13, 7]}  # per rank, step 0; later steps rotate it
BACKENDS = ["a2a", "allgather", "p2p", "deepep-normal", "deepep-low_latency", "deepep-auto"]
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


def _full_experts() -> MoEExperts:
    m = MoEExperts(E, H, I)
    g = torch.Generator().manual_seed(0)  # same weights on every rank
    m.w13.data = torch.randn(m.w13.shape, generator=g) * 0.1
    m.w2.data = torch.randn(m.w2.shape, generator=g) * 0.1
    return m


def _shard(full: MoEExperts, rank: int, world: int) -> MoEExperts:
    n = E // world
    m = MoEExperts(E, H, I, first_expert=rank * n, num_local=n)
    own = slice(rank * n, (rank + 1) * n)
    m.w13.data, m.w2.data = full.w13.data[own], full.w2.data[own]
    return m


def _inputs(rank: int, step: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else \
        torch.empty(0, K, dtype=torch.int64)
    return x, ids, torch.rand(t, K, generator=g)


def _steps(world: int, backend: str) -> list[tuple[list[int], ForwardMode]]:
    """(tokens per rank, global forward mode) for each step: rotate the idle rank, then all idle."""
    base = TOKENS[world]
    counts = [base, base[1:] + base[:1], [0] * world, base[::-1]]
    modes = [EXTEND, DECODE, DECODE, EXTEND] if backend == "deepep-auto" else [EXTEND] * 4
    return list(zip(counts, modes))


def _make(backend: str, mesh):
    if not backend.startswith("deepep"):
        return create_dispatcher(backend, mesh, E, H, torch.float32)
    import fake_deep_ep

    return create_dispatcher("deepep", mesh, E, H, torch.float32, deepep_mode=backend[7:],
                             max_dispatch_tokens_per_rank=MAX_LL_TOKENS,
                             deep_ep_module=fake_deep_ep)


def _moe(d, experts, x, ids, w, mode, tokens_per_rank=None):
    out = d.dispatch(x, ids, w, mode, tokens_per_rank)
    return d.combine(d.experts_forward(experts, out), out), out


def _check_counts(out, ids: torch.Tensor, rank: int, world: int) -> None:
    """tokens_per_expert of all ranks side by side = the global count of routed (token, expert)."""
    n = E // world
    got = torch.zeros(E, dtype=torch.int64)
    got[rank * n : (rank + 1) * n] = out.tokens_per_expert.long()
    want = torch.bincount(ids[ids >= 0], minlength=E)
    torch.distributed.all_reduce(got)
    torch.distributed.all_reduce(want)
    assert got.tolist() == want.tolist(), (got, want)


def _check(rank, world, backend) -> None:
    from moeserve.distributed import ParallelMesh

    g = torch.distributed.group.WORLD
    mesh = ParallelMesh(rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank,
                        ep_size=world, device=torch.device("cpu"), world_group=g, cpu_group=g,
                        ep_group=g)
    full = _full_experts()
    local, d = _shard(full, rank, world), _make(backend, mesh)
    formats = []
    for step, (counts, mode) in enumerate(_steps(world, backend)):
        x, ids, w = _inputs(rank, step, counts[rank])
        # odd steps pass the counts as the DP sync would (no count exchange in the dispatcher)
        got, out = _moe(d, local, x, ids, w, mode, counts if step % 2 else None)
        formats.append(out.format)
        _check_counts(out, ids, rank, world)
        torch.testing.assert_close(got, full.forward_loop(x, ids, w), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    expected = {"deepep-low_latency": [LOW_LATENCY] * 4,
                "deepep-auto": [STANDARD, LOW_LATENCY, LOW_LATENCY, STANDARD]}
    assert formats == expected.get(backend, [STANDARD] * 4), formats
    if backend == "deepep-auto":  # one normal → low-latency switch so far, with a buffer clean
        assert d.buffer.calls.count("clean_low_latency_buffer") == 1, d.buffer.calls
    _two_in_flight(d, full, local, rank, world, _steps(world, backend)[1][1])
    _overlapped(d, backend, full, local, rank, world, _steps(world, backend)[1][1])


def _two_in_flight(d, full, local, rank, world, mode, overlapped=False) -> None:
    """start A, start B, wait A, wait B; then both combines in flight, waited in reverse order."""
    a, b = _inputs(rank, 10, TOKENS[world][rank]), _inputs(rank, 11, TOKENS[world][-1 - rank])
    ha = d.dispatch_start(*a, mode, overlapped=overlapped)
    hb = d.dispatch_start(*b, mode, overlapped=overlapped)
    oa, ob = d.dispatch_wait(ha), d.dispatch_wait(hb)
    ca = d.combine_start(d.experts_forward(local, oa), oa)
    cb = d.combine_start(d.experts_forward(local, ob), ob)
    yb, ya = d.combine_wait(cb), d.combine_wait(ca)
    torch.testing.assert_close(ya, full.forward_loop(*a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(yb, full.forward_loop(*b), rtol=1e-5, atol=1e-5)


def _overlapped(d, backend, full, local, rank, world, mode) -> None:
    """Two in flight as TBO micro-batches (overlapped=True): the torch.distributed backends take
    their CUDA side-stream path (recorded: every launch after the compute stream, every one
    joined); the DeepEP adapter passes previous_event / async_finish / allocate_on_comm_stream
    to every normal-mode call."""
    ops = RecordingOps()
    if not backend.startswith("deepep"):
        d.comm = CommStream(torch.device("cpu"), ops)
    else:
        before = len(d.buffer.stream_options)
    _two_in_flight(d, full, local, rank, world, mode, overlapped=True)
    if backend.startswith("deepep"):
        opts = d.buffer.stream_options[before:]
        assert len(opts) == (6 if d.step_mode(mode) == "normal" else 0), opts
        assert all(o[1:] == (True, True, True) for o in opts), opts
    else:
        assert sum(e[0] == "side waits compute" for e in ops.log) == 4, ops.log
        assert ops.waited == ops.recorded and len(ops.recorded) == 4, ops.log


def _worker(rank: int, world: int, port: int, backend: str, results) -> None:
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=rank, world_size=world)
        _check(rank, world, backend)
        results.put((rank, None))
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _pool_worker(rank: int, world: int, port: int, tasks, results) -> None:
    """One rank of a RankPool: one gloo group, then each backend the parent names in turn."""
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=rank, world_size=world)
        while (backend := tasks.get()) is not None:
            try:
                _check(rank, world, backend)
                results.put((rank, None))
            except BaseException:  # reported to the parent, which fails the test
                results.put((rank, traceback.format_exc()))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RankPool:
    """`world` spawned gloo ranks that run one backend's checks per `run`: the cases of a world
    size share their processes (a rank's start, torch and this module imported, is ~2 s of a
    core; 36 of them were most of this file's time). A failed case ends the pool (its peers
    may hang in a collective); the next case starts a fresh one."""

    def __init__(self, world: int):
        self.world = world
        self.procs: list = []

    def _start(self) -> None:
        ctx = rank_context()
        self.results, port = ctx.Queue(), _free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_pool_worker, args=(r, self.world, port, self.tasks[r],
                                                              self.results))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, backend: str, timeout_s: float = 90.0) -> None:
        if not self.procs:
            self._start()
        for q in self.tasks:
            q.put(backend)
        errors = _collect(self.procs, self.results, timeout_s)
        if errors:
            self.close(join_s=5.0)
            pytest.fail("\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))

    def close(self, join_s: float = 10.0) -> None:
        for q in self.tasks if self.procs else ():
            q.put(None)
        for p in self.procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
        self.procs = []


def rank_context():
    """Ranks forked from this process' fork server, which imported torch once (the launchers'
    PRELOAD, so moeserve's own children share it), not spawned into fresh interpreters."""
    from moeserve.procs.forkserver import PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once this process' one started
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, backend: str, timeout_s: float = 90.0, worker=None,
              join_s: float = 5.0) -> None:
    """Spawn `world` ranks of `worker(rank, world, port, backend, results)` (default: this
    file's gloo worker); fail with the first child traceback, a dead child or a hang."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker or _worker, args=(r, world, port, backend, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        errors = _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
    if errors:
        pytest.fail("\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))


def _collect(procs, results, timeout_s: float) -> dict[int, str]:
    done: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(procs):
        try:
            rank, err = results.get(timeout=1.0)
            done[rank] = err
            if err:
                break  # the other ranks may now hang in a collective
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
            if dead:
                return {r: f"exited with code {procs[r].exitcode} without reporting" for r in dead}
            if time.monotonic() > deadline:
                missing = [r for r in range(len(procs)) if r not in done]
                return {r: f"no result after {timeout_s:.0f}s (hang?)" for r in missing}
    return {r: e for r, e in done.items() if e}


@pytest.fixture(scope="module")
def rank_pools():
    pools = {world: RankPool(world) for world in (2, 4)}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_combine_equals_all_experts(rank_pools, world, backend):
    rank_pools[world].run(backend)


def test_expert_owner():
    ids = torch.tensor([[0, 3, 4, 7], [-1, 5, 2, 6]])
    assert expert_owner(ids, 8, 2).tolist() == [[0, 0, 1, 1], [-1, 1, 0, 1]]
    assert expert_owner(ids, 8, 4).tolist() == [[0, 1, 2, 3], [-1, 2, 1, 3]]


def test_single_rank_is_local():
    from moeserve.distributed import single_rank_mesh

    full = _full_experts()
    d = create_dispatcher("a2a", single_rank_mesh(torch.device("cpu")), E, H, torch.float32)
    for t in (0, 6):
        x, ids, w = _inputs(0, 0, t)
        got, out = _moe(d, full, x, ids, w, EXTEND)
        assert out.format == STANDARD
        assert out.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
        torch.testing.assert_close(got, full.forward_loop(x, ids, w))


def test_deepep_without_deep_ep_names_the_key():
    from moeserve.ep.deepep import load_deep_ep

    with pytest.raises(RuntimeError, match=r"parallel\.a2a_backend=deepep"):
        load_deep_ep(torch.device("cpu"))


def test_unknown_backend_names_the_key():
    from moeserve.distributed import single_rank_mesh

    with pytest.raises(ValueError, match=r"parallel\.a2a_backend"):
        create_dispatcher("nope", single_rank_mesh(torch.device("cpu")), E, H, torch.float32)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_ep_prints_a_row_per_backend(capfd):
    from moeserve.bench.ep import main

    main(["--world", "2", "--hidden", "64", "--experts", "8", "--topk", "2", "--tokens", "0", "8",
          "--warmup", "1", "--iters", "2", "--dtype", "float32"])
    table = [line.split()[0] for line in capfd.readouterr().out.splitlines()[2:]]
    assert table == ["raw", "a2a", "allgather", "p2p"] * 2, table
