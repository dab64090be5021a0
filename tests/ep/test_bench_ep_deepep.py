"""bench.ep's DeepEP rows through the adapter, on CPU against the emulation (fake_deep_ep): one
row per mode and size, low-latency rows only up to --ll-max-tokens."""

from __future__ import annotations

import pytest

from moeserve.bench.ep import main


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_ep_adds_deepep_rows(capfd):
    main(["--world", "2", "--hidden", "64", "--experts", "8", "--topk", "2", "--tokens", "8", "32",
          "--warmup", "1", "--iters", "2", "--dtype", "float32", "--ll-max-tokens", "16",
          "--backend", "p2p", "deepep-normal", "deepep-low_latency",
          "--deep-ep-module", "fake_deep_ep"])
    lines = capfd.readouterr().out.splitlines()
    table = [(line.split()[0], int(line.split()[-4])) for line in lines[2:]]
    assert table == [("raw", 8), ("p2p", 8), ("deepep-normal", 8), ("deepep-low_latency", 8),
                     ("raw", 32), ("p2p", 32), ("deepep-normal", 32)], lines
