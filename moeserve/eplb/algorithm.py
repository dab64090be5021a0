"""DeepSeek's expert-parallel load balancer (EPLB) as pure tensor functions.

Load goes in, placement maps come out; nothing here knows about processes or devices, so every
case is testable on the CPU. Written from the published description of DeepSeek's `eplb.py`; the
outputs, tie-breaking included, follow it: items are visited heaviest first in the order
`torch.sort(descending=True)` gives, a tie between packs goes to the lowest pack index, and a tie
between experts for an extra replica goes to the lowest expert id.

Vocabulary: a *logical* expert is one set of weights of the checkpoint; a *physical* expert is one
slot on a GPU holding a copy of a logical expert. Slot p lives on GPU p // (P / num_gpus).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Placement(NamedTuple):
    phy2log: torch.Tensor  # [L, P] logical id held by each physical slot
    log2phy: torch.Tensor  # [L, E, X] slots of each logical expert by replica rank, -1 padded
    logcnt: torch.Tensor  # [L, E] number of replicas of each logical expert


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Put n weighted items into `num_packs` packs of n / num_packs items each, balancing weights.

    Greedy: heaviest item first, each into the lightest pack that still has room (lowest index on
    a tie). Equal pack sizes matter because a pack is a GPU (or node) with a fixed number of slots.

    weight: [X, n] -> pack_index [X, n] (pack of each item), rank_in_pack [X, n] (slot in the pack).
    """
    rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    if per_pack == 1:  # NOTE: identity, not greedy: the reference short-cuts this case the same way
        pack_index = torch.arange(n, dtype=torch.int64).expand(rows, n).clone()
        return pack_index, torch.zeros_like(pack_index)
    w = weight.float().cpu()
    # NOTE: the reference's own (unstable) sort call, so equal weights are visited in the same order
    order = w.sort(-1, descending=True).indices.numpy()  # [X, n]
    w_np = w.numpy()
    pack_index = np.full((rows, n), -1, dtype=np.int64)
    rank_in_pack = np.full((rows, n), -1, dtype=np.int64)
    for r in range(rows):
        loads = np.zeros(num_packs, dtype=np.float32)  # float32 sums, as the reference adds them
        counts = np.zeros(num_packs, dtype=np.int64)
        for item in order[r]:
            # first lightest pack with room
            pack = int(np.argmin(np.where(counts < per_pack, loads, np.inf)))
            pack_index[r, item] = pack
            rank_in_pack[r, item] = counts[pack]
            loads[pack] += w_np[r, item]
            counts[pack] += 1
    return torch.from_numpy(pack_index), torch.from_numpy(rank_in_pack)


def replicate_experts(
    weight: torch.Tensor, num_phy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grow `num_log` experts to `num_phy` slots; each extra slot goes to the expert with the most
    load per replica, which minimises the largest per-replica load (an expert's load is split
    evenly over its replicas).

    weight: [X, num_log] -> phy2log [X, num_phy] (slot i < num_log holds expert i; extra slots in
    the order granted), rank [X, num_phy] (replica index of each slot), logcnt [X, num_log].
    """
    rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"{num_phy} physical slots cannot hold {num_log} logical experts")
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    row = torch.arange(rows)
    for slot in range(num_log, num_phy):
        hottest = (weight / logcnt).argmax(-1)  # [X]; argmax picks the first maximum
        phy2log[:, slot] = hottest
        rank[:, slot] = logcnt[row, hottest]
        logcnt[row, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of a batch of permutations: perm [X, n] -> inv [X, n] with inv[x, perm[x, i]] = i."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=perm.dtype).expand_as(perm))
    return inv


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three greedy steps that keep traffic inside a node, where it is cheap.

    1. Pack expert groups to nodes by group load (a node owns whole groups: group-limited routing
       then touches few nodes).
    2. Within each node, replicate its experts into num_physical / num_nodes slots (replicas never
       leave their node).
    3. Within each node, pack its physical slots onto its GPUs, num_physical / num_gpus per GPU.

    weight: [L, E] float -> phy2log [L, P], phyrank [L, P] (replica index per slot), logcnt [L, E].
    """
    num_layers, num_log = weight.shape
    for what, a, b in [
        ("experts", num_log, num_groups),
        ("groups", num_groups, num_nodes),
        ("gpus", num_gpus, num_nodes),
        ("physical experts", num_physical, num_gpus),
    ]:
        if a % b:
            raise ValueError(f"{what} ({a}) must divide by {b}")
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_log // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # Step 1. "mlog" numbers logical experts node-major: node n owns mlog ids
    # [n * log_per_node, (n + 1) * log_per_node).
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, G]
    group_node, group_slot = balanced_packing(group_load, num_nodes)  # [L, G] each
    first_mlog = (group_node * groups_per_node + group_slot) * group_size  # [L, G]
    log2mlog = (first_mlog.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)  # [L, E]
    mlog2log = _inverse(log2mlog)  # [L, E]

    # Step 2. One row per (layer, node): replicate that node's experts into its share of slots.
    mlog_load = weight.gather(-1, mlog2log).view(-1, log_per_node)  # [L*N, E/N]
    # phy2mlog, phyrank: [L*N, P/N]; mlogcnt: [L*N, E/N]
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_physical // num_nodes)

    # Step 3. Pack each node's slots onto its GPUs by per-replica load; "pphy" = final slot order.
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)  # [L*N, P/N]
    gpu, slot_in_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * slots_per_gpu + slot_in_gpu)  # [L*N, P/N]

    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(num_layers, num_nodes, -1)  # node-local mlog ids
    node_base = torch.arange(num_nodes).view(1, -1, 1) * log_per_node  # [1, N, 1]
    pphy2mlog = (pphy2mlog + node_base).flatten(-2)  # [L, P]
    phy2log = mlog2log.gather(-1, pphy2mlog)  # [L, P]
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)  # [L, P]
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)  # [L, E]
    return phy2log, pphyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Placement:
    """DeepSeek's EPLB entry point: the hierarchical policy when groups split evenly over nodes,
    else the global one (hierarchical with one group on one node: replicas may go anywhere).

    weight: [L, E] load per logical expert (any dtype; computed in float32 on the CPU)
    -> Placement(phy2log [L, P], log2phy [L, E, X] (-1 padded, X = most replicas of any expert),
    logcnt [L, E]).
    """
    num_layers, num_log = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, 1, 1, num_gpus
        )
    max_cnt = int(logcnt.max())
    log2phy = torch.full((num_layers, num_log, max_cnt), -1, dtype=torch.int64)
    slots = torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1)  # [L, P]
    log2phy.view(num_layers, -1).scatter_(-1, phy2log * max_cnt + phyrank, slots)
    return Placement(phy2log, log2phy, logcnt)


def balancedness(load_per_rank: torch.Tensor) -> torch.Tensor:
    """mean / max of the load over ranks (1.0 = perfect; the slowest rank sets the step time).

    load_per_rank: [..., R] -> [...]; an all-zero row counts as balanced.
    """
    load = load_per_rank.double()
    peak = load.amax(-1)
    return torch.where(peak > 0, load.mean(-1) / peak.clamp(min=1e-30), torch.ones_like(peak))


def rank_load(
    phy2log: torch.Tensor, logical_load: torch.Tensor, logcnt: torch.Tensor, ep_size: int
) -> torch.Tensor:
    """Expected tokens per rank when each logical expert's load is split evenly over its replicas.

    phy2log [L, P], logical_load [L, E], logcnt [L, E]  ->  [L, ep_size] (float64).
    """
    num_layers, num_phy = phy2log.shape
    if num_phy % ep_size:
        raise ValueError(f"{num_phy} physical experts do not divide over ep_size {ep_size}")
    per_replica = logical_load.double() / logcnt.double()  # [L, E]
    phy_load = per_replica.gather(-1, phy2log.long())  # [L, P]
    return phy_load.view(num_layers, ep_size, num_phy // ep_size).sum(-1)


def trivial_rank_load(logical_load: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Tokens per rank with expert e on rank e // (E / ep_size): [L, E] -> [L, ep_size]."""
    num_layers, num_log = logical_load.shape
    phy2log = torch.arange(num_log).expand(num_layers, -1)
    ones = torch.ones_like(logical_load, dtype=torch.int64)  # [L, E]
    return rank_load(phy2log, logical_load, ones, ep_size)
