"""What the real DeepEP kernels cannot run is refused at start-up, naming the key
(docs/architecture.md §11: a tiny model's hidden size killed a rank inside
low_latency_dispatch)."""

from __future__ import annotations

import pytest
import torch

from moeserve.ep.deepep import LOW_LATENCY_HIDDEN_SIZES, check_supported


@pytest.mark.parametrize("mode", ["low_latency", "auto"])
def test_low_latency_needs_a_built_hidden_size(mode):
    with pytest.raises(ValueError, match=r"parallel\.deepep_mode=normal.*|hidden_size is 64"):
        check_supported(mode, 64, torch.bfloat16)
    for hidden in (2048, 7168):  # Qwen3-30B-A3B, DeepSeek-V3
        assert hidden in LOW_LATENCY_HIDDEN_SIZES
        check_supported(mode, hidden, torch.bfloat16)


def test_normal_mode_takes_any_hidden_but_only_bf16():
    check_supported("normal", 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"model\.dtype=bfloat16"):
        check_supported("normal", 7168, torch.float32)


def test_low_latency_buffers_fit_the_largest_decode_batch():
    from moeserve.config import compose
    from moeserve.runtime.moe_setup import low_latency_max_tokens

    assert low_latency_max_tokens(compose([])) == 256  # max_running_requests, cuda_graph.max_bs
    cfg = compose(["cache.max_running_requests=301", "cuda_graph.max_bs=64"])
    assert low_latency_max_tokens(cfg) == 304
