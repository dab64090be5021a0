"""Where each expert goes on a new membership, and where each copy comes from (pure logic).

Slots: every member holds the same number of physical slots. The survivors keep at least the
original count per rank; when they are too few to hold every logical expert once, each gets
ceil(E / n) (weights loaded from the checkpoint fill what no survivor holds). The placement is
DeepSeek's EPLB run for the survivors (eplb/algorithm.py) on the load recorded so far; back at
the original membership it is the original placement (a relaunched rank rejoined).

Sources, per new slot: the rank itself when it already holds that expert (a local copy), else a
member that holds it (a peer copy; spread over the holders), else the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.eplb.algorithm import rebalance_experts

CHECKPOINT = -1  # Move.src: no member holds the expert


def slots_per_rank(num_logical: int, original_slots: int, members: int) -> int:
    return max(original_slots, -(-num_logical // members))


def target_placement(load: torch.Tensor, members: tuple[int, ...], original_ranks: int,
                     original: torch.Tensor, original_slots: int,
                     num_groups: int = 1) -> torch.Tensor:
    """phy2log [L, n * slots] for `members` (global ranks): the original placement [L, P0]
    when every original rank is a member, else EPLB over the n members for `load` [L, E]."""
    n = len(members)
    if tuple(members) == tuple(range(original_ranks)):
        return original.clone()
    num_logical = load.shape[1]
    slots = slots_per_rank(num_logical, original_slots, n)
    groups = num_groups if num_groups > 0 and num_logical % num_groups == 0 else 1
    return rebalance_experts(load.float() + 1.0, slots * n, groups, 1, n).phy2log


@dataclass(frozen=True)
class Move:
    """Fill slot `dst_slot` (local index) of member `dst` with logical expert `logical`, from
    local slot `src_slot` of member `src` (src == dst: a local copy; CHECKPOINT: from disk)."""

    dst: int
    dst_slot: int
    logical: int
    src: int
    src_slot: int = -1


def plan_moves(target: list[int], slots: int, holdings: list[list[int]]) -> list[Move]:
    """One layer's moves. target: logical id per new physical slot (len n * slots, member-major);
    holdings[m]: logical id of each local slot member m holds now (-1: empty). The same on every
    member, so each derives its own sends and receives from it."""
    holders: dict[int, list[tuple[int, int]]] = {}  # logical -> [(member, local slot)]
    for m, row in enumerate(holdings):
        for s, e in enumerate(row):
            if e >= 0 and all(h[0] != m for h in holders.get(e, ())):
                holders.setdefault(e, []).append((m, s))
    sends = [0] * len(holdings)
    moves = []
    for p, e in enumerate(target):
        dst, dst_slot = divmod(p, slots)
        mine = [s for s, x in enumerate(holdings[dst]) if x == e] if dst < len(holdings) else []
        if mine:
            moves.append(Move(dst, dst_slot, e, dst, mine[0]))
        elif e in holders:
            src, src_slot = min(holders[e], key=lambda h: (sends[h[0]], h[0]))
            sends[src] += 1
            moves.append(Move(dst, dst_slot, e, src, src_slot))
        else:
            moves.append(Move(dst, dst_slot, e, CHECKPOINT))
    return moves
