"""The EPLB recorder's one-launch Triton count (kernels/triton/expert_count.py) against a plain
Python count and against the recorder's torch ops: stat and per-pass rings, ids < 0, a captured
graph's row mask and on/off switch, several programs. CPU: Triton's interpreter (integer math only,
so exact there too)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moeserve.eplb.recorder import ExpertDistributionRecorder  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYERS, PHYSICAL = 3, 20


def python_count(steps, window_slots: int, layers: int, physical: int) -> torch.Tensor:
    """[slots, L, P] from (slot, layer, ids [T, K], rows [T] or None) by hand."""
    out = torch.zeros(window_slots, layers, physical, dtype=torch.int64)
    for slot, layer, ids, rows in steps:
        for t, row in enumerate(ids.tolist()):
            if rows is not None and not rows[t]:
                continue
            for e in row:
                if e >= 0:
                    out[slot, layer, e] += 1
    return out


def recorders(mode: str):
    recs = []
    for kernel in (False, True):
        r = ExpertDistributionRecorder(LAYERS, PHYSICAL, mode=mode, window=4, device=DEVICE)
        r.kernel_pdl = False if kernel else None
        recs.append(r)
    return recs


@pytest.mark.parametrize("mode", ["stat", "per_pass"])
@pytest.mark.parametrize("tokens,topk", [(1, 8), (37, 6), (300, 8)])
def test_kernel_count_equals_torch_ops_and_a_python_count(mode, tokens, topk):
    gen = torch.Generator().manual_seed(tokens * topk)
    torch_rec, kernel_rec = recorders(mode)
    for r in (torch_rec, kernel_rec):
        r.start()
    steps, slot = [], 0
    for step in range(3):
        for layer in range(LAYERS):
            ids = torch.randint(-1, PHYSICAL, (tokens, topk), generator=gen)  # -1: masked id
            rows = None
            if step == 1:  # a captured graph's padded rows (the row mask) count nothing
                rows = (torch.rand(tokens, generator=gen) < 0.7).long()
            for r in (torch_rec, kernel_rec):
                r.capture_rows = None if rows is None else rows.to(DEVICE)
                r.record(layer, ids.to(DEVICE))
                r.capture_rows = None
            steps.append((slot, layer, ids, rows))
        for r in (torch_rec, kernel_rec):
            r.step()
        if mode == "per_pass":
            slot = (slot + 1) % 5
    ours = kernel_rec._buf[..., :PHYSICAL].cpu()
    assert torch.equal(ours, torch_rec._buf[..., :PHYSICAL].cpu())
    if mode == "stat":
        assert torch.equal(ours, python_count(steps, 1, LAYERS, PHYSICAL))
    else:  # the ring: step() zeroes the pass it opens, so each slot holds its own step's counts
        want = python_count(steps, 5, LAYERS, PHYSICAL)
        assert torch.equal(ours[:3], want[:3])
    assert kernel_rec.topk == topk


def test_switched_off_a_captured_count_adds_nothing():
    """In a graph the record runs with recording off (`_on` 0): nothing may be counted."""
    _, rec = recorders("stat")
    rec.capture_rows = torch.ones(5, dtype=torch.int64, device=DEVICE)
    rec.record(0, torch.randint(0, PHYSICAL, (5, 4), device=DEVICE))
    assert int(rec._buf.sum()) == 0
    rec.start()
    rec.record(0, torch.randint(0, PHYSICAL, (5, 4), device=DEVICE))
    assert int(rec._buf.sum()) == 20


def test_a_layer_outside_the_buffer_is_refused():
    _, rec = recorders("stat")
    rec.start()
    with pytest.raises(ValueError, match="layer 3 outside"):
        rec.record(LAYERS, torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
