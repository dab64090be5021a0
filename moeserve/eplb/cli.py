"""`python -m moeserve.eplb`: inspect a recorded load, turn it into a placement, or simulate.

  report DUMP [--png FILE] [--groups G]
      per layer: tokens, per-rank max/mean, balancedness now and under the EPLB placement
  rebalance DUMP --ep-size N --nodes K --redundant R [--groups G] -o placement.json
  simulate [--ep ...] [--experts E] [--topk K] [--zipf ...] [--redundant ...] [--layers L]
           [--tokens T] [--groups G] [--gpus-per-node N] [--seed S]
      Zipf-skewed synthetic routing: balancedness with the trivial placement vs EPLB

Balancedness = mean / max tokens per rank (1.0 = every rank equally busy), averaged over layers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from moeserve.eplb.algorithm import balancedness, rank_load, rebalance_experts, trivial_rank_load
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.recorder import ExpertDump, load_dump


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned plain-text table (floats with 3 decimals)."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(r, widths))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def eplb_rank_load(
    load: torch.Tensor, num_phy: int, groups: int, nodes: int, ep: int
) -> torch.Tensor:
    """Per-rank load [L, ep] of the EPLB placement computed from `load` [L, E], on that load."""
    placement = rebalance_experts(load, num_phy, groups, nodes, ep)
    return rank_load(placement.phy2log, load, placement.logcnt, ep)


def _groups(dump: ExpertDump, override: int | None) -> int:
    return override if override is not None else int(dump.metadata.get("num_groups") or 1)


# ---- report ----
def cmd_report(args: argparse.Namespace) -> int:
    dump = load_dump(args.dump)
    meta, ep, nodes = dump.metadata, dump.ep_size, dump.num_nodes
    num_layers, num_phy = dump.physical_counts.shape
    load = dump.logical_load()  # [L, E]
    now = dump.physical_counts.double().view(num_layers, ep, num_phy // ep).sum(-1)  # [L, ep]
    after = eplb_rank_load(load, num_phy, _groups(dump, args.groups), nodes, ep)  # [L, ep]
    bal_now, bal_after = balancedness(now), balancedness(after)  # [L] each
    topk = int(meta.get("topk") or 1)
    rows: list[list[object]] = [
        [i, int(load[i].sum()) // topk, float(now[i].max()), float(now[i].mean()),
         float(bal_now[i]), float(bal_after[i])]
        for i in range(num_layers)
    ]  # fmt: skip
    rows.append(["mean", "", "", "", float(bal_now.mean()), float(bal_after.mean())])
    print(
        f"dump {args.dump}: model={meta.get('model', '?')} layers={num_layers} "
        f"experts={dump.num_logical} physical={num_phy} ep={ep} nodes={nodes} "
        f"steps={meta.get('steps', '?')} topk={topk}"
    )
    headers = ["layer", "tokens", "rank max", "rank mean", "bal now", "bal eplb"]
    print(format_table(headers, rows))
    if args.png:
        save_heatmap(load, args.png, title=f"{meta.get('model') or 'expert load'}: tokens")
        print(f"heatmap -> {args.png}")
    return 0


def save_heatmap(load: torch.Tensor, path: str, title: str = "") -> None:
    """Layer x logical expert heatmap of token counts, rendered off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = (max(6.0, load.shape[1] / 16), max(3.0, load.shape[0] / 4))
    fig, ax = plt.subplots(figsize=size)
    im = ax.imshow(load.float().numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set(xlabel="logical expert", ylabel="layer", title=title)
    fig.colorbar(im, ax=ax, label="tokens")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ---- rebalance ----
def cmd_rebalance(args: argparse.Namespace) -> int:
    dump = load_dump(args.dump)
    load = dump.logical_load()  # [L, E]
    groups, ep = _groups(dump, args.groups), args.ep_size
    meta = {"model": dump.metadata.get("model"), "from_dump": args.dump}
    loc = ExpertLocation.from_algorithm(load, ep, args.nodes, args.redundant, groups, metadata=meta)
    loc.save(args.output)
    after = balancedness(rank_load(loc.physical_to_logical, load, loc.logical_count, ep)).mean()
    before = "n/a"
    if load.shape[1] % ep == 0:
        before = f"{float(balancedness(trivial_rank_load(load, ep)).mean()):.3f}"
    policy = "hierarchical" if groups % args.nodes == 0 else "global"
    print(
        f"placement -> {args.output}: {loc.num_layers} layers, {loc.num_logical} logical -> "
        f"{loc.num_physical} physical experts, ep={ep} nodes={args.nodes} groups={groups} "
        f"({policy} policy)"
    )
    print(f"balancedness on the dump: trivial={before} eplb={float(after):.3f}")
    return 0


# ---- simulate ----
def zipf_load(
    layers: int, experts: int, topk: int, tokens: int, s: float, gen: torch.Generator,
    perms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Synthetic routing: the i-th most popular expert has popularity ∝ 1 / i^s, experts shuffled
    per layer; each token draws `topk` distinct experts without replacement.

    Returns (load [L, E] int64, perms [L, E]); pass `perms` back to draw another sample from the
    same distribution (a held-out workload).
    """
    if perms is None:
        perms = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)])
    popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s  # [E] by rank
    load = torch.zeros(layers, experts, dtype=torch.int64)
    for layer in range(layers):
        probs = torch.empty(experts, dtype=torch.float64)
        probs[perms[layer]] = popularity  # expert perms[layer][i] has popularity rank i
        picks = torch.multinomial(probs.expand(tokens, -1), topk, generator=gen)  # [T, K] distinct
        load[layer] = torch.bincount(picks.flatten(), minlength=experts)
    return load, perms


def cmd_simulate(args: argparse.Namespace) -> int:
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[list[object]] = []
    for s in args.zipf:
        sample = (args.layers, args.experts, args.topk, args.tokens, s, gen)
        fit, perms = zipf_load(*sample)
        held_out, _ = zipf_load(*sample, perms)
        for ep in args.ep:
            nodes = max(1, ep // args.gpus_per_node)
            before = float(balancedness(trivial_rank_load(fit, ep)).mean())
            for r in args.redundant:
                num_phy = args.experts + r
                if num_phy % ep:
                    rows.append([ep, nodes, s, r, before, f"n/a ({num_phy} % {ep})", ""])
                    continue
                p = rebalance_experts(fit, num_phy, args.groups, nodes, ep)
                after = balancedness(rank_load(p.phy2log, fit, p.logcnt, ep)).mean()
                held = balancedness(rank_load(p.phy2log, held_out, p.logcnt, ep)).mean()
                rows.append([ep, nodes, s, r, before, float(after), float(held)])
    print(
        f"simulate: {args.experts} experts top-{args.topk}, {args.layers} layers x {args.tokens} "
        f"tokens, groups={args.groups}, {args.gpus_per_node} GPUs/node, seed={args.seed}"
    )
    print(format_table(["ep", "nodes", "zipf", "redundant", "before", "after", "held-out"], rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moeserve.eplb",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="per-layer load table (+ PNG heatmap)")
    rep.add_argument("dump")
    rep.add_argument("--png", help="write a layer x expert heatmap here")
    rep.add_argument("--groups", type=int, help="expert groups (default: dump metadata, else 1)")
    rep.set_defaults(fn=cmd_report)
    reb = sub.add_parser("rebalance", help="EPLB placement from a dump -> placement.json")
    reb.add_argument("dump")
    reb.add_argument("--ep-size", type=int, required=True)
    reb.add_argument("--nodes", type=int, default=1)
    reb.add_argument("--redundant", type=int, default=0)
    reb.add_argument("--groups", type=int, help="expert groups (default: dump metadata, else 1)")
    reb.add_argument("-o", "--output", default="placement.json")
    reb.set_defaults(fn=cmd_rebalance)
    sim = sub.add_parser("simulate", help="balancedness before/after on Zipf-skewed routing")
    sim.add_argument("--ep", type=int, nargs="+", default=[4, 8, 32, 64])
    sim.add_argument("--experts", type=int, default=256)
    sim.add_argument("--topk", type=int, default=8)
    sim.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.2, 1.5])
    sim.add_argument("--redundant", type=int, nargs="+", default=[0, 16, 32])
    sim.add_argument("--layers", type=int, default=4)
    sim.add_argument("--tokens", type=int, default=8192)
    sim.add_argument("--groups", type=int, default=1, help="expert groups (1: global policy)")
    sim.add_argument("--gpus-per-node", type=int, default=8)
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(fn=cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)
