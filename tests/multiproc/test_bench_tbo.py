"""bench.tbo with a model folder and overrides (its GPU form, `scripts/gpu_check.sh tbo_ep`), run on
CPU: dp2 x ep2 engines with TBO off and on, one table row each and the on/off ratio."""

from __future__ import annotations

import pytest

from moeserve.bench.tbo import main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_tbo_with_a_model_folder(tiny_model, capsys):
    path = tiny_model("deepseek_v3")
    main(["--model", path, "--name", "tiny-v3", "--device", "cpu", "--ranks", "2", "--batch", "4",
          "--input", "16", "--output", "3", "--repeats", "1", "--min-tokens", "1",
          "--backend", "p2p", "-o", "scheduler.overlap=false"])
    out = capsys.readouterr().out.splitlines()
    title = next(line for line in out if line.startswith("tiny-v3, dp2×ep2"))
    assert "(p2p, gloo, CPU), 4 requests (2/rank)" in title and "scheduler.overlap=false" in title
    rows = {line.split()[0]: line.split()[1:] for line in out if line.split()[:1] in (["on"],
                                                                                     ["off"])}
    assert set(rows) == {"on", "off"}
    assert all(float(v[0]) > 0 and float(v[1]) > 0 for v in rows.values())
    assert rows["on"][2].endswith("%") and rows["off"][2] == "-"  # the timeline of TBO on
    assert any(line.startswith("on/off: prefill ") for line in out)
