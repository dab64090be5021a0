"""Sweeps: many deployments priced on one workload, the best under an SLO, a table and a plot of
throughput against ITL.

The decode role sets the throughput/latency trade-off (batch per GPU, EP size, TBO, MTP), the
prefill role the input rate and TTFT. A disaggregated plan pairs the best of each and splits the
nodes so that prefill produces prompts as fast as decode consumes them:
prefill nodes / decode nodes = (decode output tok/s per node x input/output) / prefill input
tok/s per node.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moeserve.planner.arch import load_shape
from moeserve.planner.costs import CostModel
from moeserve.planner.deploy import Role
from moeserve.planner.predict import RolePrediction, predict_decode, predict_prefill
from moeserve.planner.profiles import load_profile
from moeserve.planner.workload import Workload, feasible_redundancy


@dataclass(frozen=True)
class SweepSpace:
    nodes: tuple[int, ...] = (1, 2, 4, 8)
    gpus_per_node: int = 8
    batches: tuple[int, ...] = (16, 32, 64, 128, 256)
    chunks: tuple[int, ...] = (4096, 8192, 16384)
    tbo: tuple[bool, ...] = (False, True)
    mtp: tuple[int, ...] = (0,)
    accept_len: float = 1.0
    redundant: int = 32
    graphs: bool | None = None


@dataclass(frozen=True)
class SLO:
    itl_ms: float | None = None
    ttft_ms: float | None = None

    @staticmethod
    def parse(items: list[str]) -> SLO:
        """`itl_ms=50 ttft_ms=2000` -> SLO."""
        kw = {}
        for item in items:
            key, _, val = item.partition("=")
            if key not in ("itl_ms", "ttft_ms") or not val:
                raise ValueError(f"SLO {item!r}: use itl_ms=N or ttft_ms=N")
            kw[key] = float(val)
        return SLO(**kw)


def _redundancy(experts: int, ep: int, most: int) -> int:
    """The largest redundancy <= most that divides over ep (0 for dense models)."""
    if not experts or ep <= 1:
        return 0
    try:
        return max(feasible_redundancy(experts, most, ep))
    except ValueError:
        return -1


def sweep_decode(model: str, c: CostModel, w: Workload, dtype: str, space: SweepSpace
                 ) -> list[RolePrediction]:
    s = load_shape(model)
    out = []
    for nodes, batch, tbo, mtp in itertools.product(space.nodes, space.batches, space.tbo,
                                                    space.mtp):
        gpus = nodes * space.gpus_per_node
        red = _redundancy(s.experts, gpus, space.redundant)
        if red < 0 or (tbo and gpus == 1):
            continue
        role = Role("decode", nodes, space.gpus_per_node, tbo=tbo, batch=batch, redundant=red,
                    mtp_steps=mtp, accept_len=space.accept_len if mtp else 1.0,
                    graphs=space.graphs)
        out.append(predict_decode(s, c, role, w, dtype, model))
    return out


def sweep_prefill(model: str, c: CostModel, w: Workload, dtype: str, space: SweepSpace
                  ) -> list[RolePrediction]:
    s = load_shape(model)
    out = []
    for nodes, chunk, tbo in itertools.product(space.nodes, space.chunks, space.tbo):
        gpus = nodes * space.gpus_per_node
        red = _redundancy(s.experts, gpus, space.redundant)
        if red < 0 or (tbo and gpus == 1):
            continue
        role = Role("prefill", nodes, space.gpus_per_node, tbo=tbo, chunk=chunk, redundant=red)
        out.append(predict_prefill(s, c, role, w, dtype, model))
    return out


def best(preds: list[RolePrediction], limit_ms: float | None) -> RolePrediction | None:
    """The highest throughput per GPU among plans that fit memory and meet the latency limit."""
    ok = [p for p in preds if p.fits and (limit_ms is None or p.latency_ms <= limit_ms)]
    return max(ok, key=lambda p: p.tok_s_gpu, default=None)


def frontier(preds: list[RolePrediction]) -> list[RolePrediction]:
    """Plans no other plan beats on both latency and throughput (fitting ones only)."""
    ok = sorted((p for p in preds if p.fits), key=lambda p: (p.latency_ms, -p.tok_s_gpu))
    out, top = [], -1.0
    for p in ok:
        if p.tok_s_gpu > top:
            out.append(p)
            top = p.tok_s_gpu
    return out


def node_split(prefill: RolePrediction, decode: RolePrediction, w: Workload) -> float:
    """Prefill nodes per decode node so that prompts arrive as fast as decode finishes them."""
    need = decode.tok_s_node * w.input_len / max(w.output_len, 1)
    return need / prefill.tok_s_node


def table(preds: list[RolePrediction]) -> str:
    head = (f"| {'role':<8} | {'nodes':>5} | {'EP':>4} | {'batch/chunk':>11} | {'TBO':>3} | "
            f"{'MTP':>3} | {'bal':>5} | {'step ms':>8} | {'lat ms':>8} | {'tok/s/GPU':>9} | "
            f"{'tok/s/node':>10} | {'mem GiB':>7} | fits |")
    rows = [head, "|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|"]
    for p in preds:
        r = p.role
        size = r.batch if r.kind == "decode" else r.chunk
        rows.append(
            f"| {r.kind:<8} | {r.nodes:>5} | {r.ep_size:>4} | {size:>11} | "
            f"{'on' if r.tbo else 'off':>3} | {r.mtp_steps:>3} | {p.balance:>5.3f} | "
            f"{p.step_ms:>8.2f} | {p.latency_ms:>8.2f} | {p.tok_s_gpu:>9.0f} | "
            f"{p.tok_s_node:>10.0f} | {p.memory.total / 2**30:>7.1f} | "
            f"{'yes' if p.fits else 'NO':>4} |")
    return "\n".join(rows)


def plot(preds: list[RolePrediction], path: str, slo_ms: float | None, title: str) -> None:
    """Output tok/s per GPU against ITL, one marker per decode plan, the frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for nodes in sorted({p.role.nodes for p in preds}):
        pts = [p for p in preds if p.role.nodes == nodes and p.fits]
        ax.scatter([p.latency_ms for p in pts], [p.tok_s_gpu for p in pts], s=18,
                   label=f"{nodes} node(s), EP{nodes * pts[0].role.gpus_per_node}" if pts else "")
    front = frontier(preds)
    ax.plot([p.latency_ms for p in front], [p.tok_s_gpu for p in front], "k-", lw=1,
            label="frontier")
    if slo_ms:
        ax.axvline(slo_ms, color="r", ls="--", lw=1, label=f"ITL SLO {slo_ms:g} ms")
    ax.set_xlabel("ITL (ms)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cost_model(profile: str, kernels: str) -> CostModel:
    return CostModel(load_profile(profile), kernels)
