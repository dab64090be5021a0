"""`python -m moeserve.eplb` report / rebalance / simulate on small inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moeserve.eplb.cli import main, zipf_load
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.recorder import ExpertDistributionRecorder


@pytest.fixture
def dump_path(tmp_path) -> str:
    """A skewed recording: 3 layers, 16 experts, ep 4, top-2, under the trivial placement."""
    gen = torch.Generator().manual_seed(0)
    loc = ExpertLocation.trivial(3, 16, ep_size=4)
    rec = ExpertDistributionRecorder(3, 16, location=loc)
    rec.start()
    for _ in range(2):
        for layer in range(3):
            load, _ = zipf_load(1, 16, 2, 64, 1.3, gen)
            ids = torch.repeat_interleave(torch.arange(16), load[0]).view(-1, 2)  # [64, 2]
            rec.record(layer, ids)
        rec.step()
    rec.stop()
    path = str(tmp_path / "dump.pt")
    rec.dump(path, metadata={"model": "tiny-moe"})
    return path


def test_report_prints_table_and_png(dump_path, tmp_path, capsys):
    png = tmp_path / "load.png"
    assert main(["report", dump_path, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "model=tiny-moe" in out and "ep=4" in out and "steps=2" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "bal now" in line)
    layer_rows = [line.split() for line in lines[header + 2 : header + 5]]
    assert [r[0] for r in layer_rows] == ["0", "1", "2"]
    assert all(r[1] == "128" for r in layer_rows)  # 2 steps x 64 tokens
    mean = lines[header + 5].split()
    assert mean[0] == "mean" and float(mean[2]) >= float(mean[1])  # EPLB at least as balanced
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_rebalance_writes_loadable_placement(dump_path, tmp_path, capsys):
    out_json = tmp_path / "placement.json"
    args = ["rebalance", dump_path, "--ep-size", "4", "--nodes", "2", "--redundant", "4"]
    assert main([*args, "--groups", "4", "-o", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "eplb=" in out
    loc = ExpertLocation.load(str(out_json), ep_rank=1)
    assert (loc.num_layers, loc.num_logical, loc.num_physical) == (3, 16, 20)
    assert (loc.ep_size, loc.num_nodes) == (4, 2)
    assert loc.metadata["model"] == "tiny-moe"


def test_simulate_table(capsys):
    argv = ["simulate", "--ep", "2", "4", "--experts", "16", "--topk", "2", "--zipf", "1.2"]
    argv += ["--redundant", "0", "4", "5", "--layers", "2", "--tokens", "256"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[3:]]
    assert len(rows) == 2 * 3
    assert [r[0] for r in rows] == ["2", "2", "2", "4", "4", "4"]
    assert rows[2][5] == "n/a" and rows[5][5] == "n/a"  # 21 slots split over neither 2 nor 4 ranks
    for r in (rows[1], rows[4]):  # redundancy 4: balancedness up over the trivial placement
        assert float(r[5]) > float(r[4])


def test_module_entry_point():
    cmd = [sys.executable, "-m", "moeserve.eplb", "simulate", "--ep", "2", "--experts", "8"]
    cmd += ["--topk", "2", "--zipf", "1.0", "--redundant", "0", "--layers", "1", "--tokens", "64"]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "held-out" in res.stdout
