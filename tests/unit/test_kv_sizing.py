"""KV pool sizing on CUDA (runtime/kv_memory.py): a size that cannot fit next to the largest
step's activations is refused at start-up with the bytes needed and free (issue 44). The GPU's
free/total memory is faked here; tests/gpu/test_config_matrix.py asks a real GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import ConfigError, compose
from moeserve.runtime.kv_memory import kv_bytes_per_token, kv_tokens
from moeserve.runtime.step_memory import step_activation_bytes
from moeserve.runtime.model_config import load_hf_config

GIB = 2 ** 30
MLA = {"kind": "mla", "layers": 61, "kv_lora_rank": 512, "rope_dim": 64}
CUDA = torch.device("cuda")


@pytest.fixture
def free_gib(monkeypatch):
    def fake(free: float, total: float = 80) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device=None: (int(free * GIB), int(total * GIB)))
    return fake


def test_explicit_size_that_does_not_fit_names_bytes_needed_and_free(free_gib):
    free_gib(10)
    per = kv_bytes_per_token(MLA, torch.bfloat16)
    assert per == 61 * 576 * 2
    with pytest.raises(ConfigError, match="cache.max_total_tokens") as e:
        kv_tokens(compose(["cache.max_total_tokens=200000"]), MLA, torch.bfloat16, CUDA,
                  reserve=2 * GIB)
    msg = str(e.value)
    assert "13.09 GiB" in msg and "10.00 GiB free" in msg and "2.00 GiB" in msg
    fits = int((10 * GIB - 2 * GIB) // per)
    assert f"at most {fits} tokens fit" in msg
    assert kv_tokens(compose([f"cache.max_total_tokens={fits}"]), MLA, torch.bfloat16, CUDA,
                     reserve=2 * GIB) == fits


def test_derived_size_leaves_the_reserve(free_gib):
    free_gib(20)
    cfg = compose(["cache.mem_fraction_static=0.9"])
    per = kv_bytes_per_token(MLA, torch.bfloat16)
    assert kv_tokens(cfg, MLA, torch.bfloat16, CUDA, reserve=3 * GIB) == int(
        (20 * GIB - 8 * GIB - 3 * GIB) // per)
    free_gib(9)  # 9 - 8 kept back - 3 reserved < 0, but the smallest pool fits in 9 - 3
    assert kv_tokens(cfg, MLA, torch.bfloat16, CUDA, reserve=3 * GIB) == 1024
    free_gib(3)  # not even beside the reserve
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        kv_tokens(cfg, MLA, torch.bfloat16, CUDA, reserve=3 * GIB)


def test_activation_reserve_grows_with_the_step(tiny_model):
    c = load_hf_config(tiny_model("deepseek_v3"))
    small = step_activation_bytes(c, 256, 8, torch.bfloat16)
    big = step_activation_bytes(c, 4096, 8, torch.bfloat16)
    assert big > small > 0  # (the logits of 8 requests are in both)
    assert step_activation_bytes(c, 4096, 8, torch.bfloat16, 8192) > big  # + the MHA piece


def test_context_length_beyond_the_checkpoints_positions_is_refused(tiny_model):
    """A context past max_position_embeddings used to pass and then crash the first long
    request in the rotary table ("position 256 is beyond the rope table")."""
    from moeserve import Engine
    from moeserve.runtime.model_config import context_length

    path = tiny_model("qwen3_moe")
    limit = load_hf_config(path).max_position_embeddings
    hf = load_hf_config(path)
    assert context_length(compose([f"model.context_length={limit}"]), hf) == limit
    assert context_length(compose([]), hf) == limit
    with pytest.raises(ConfigError, match="max_position_embeddings") as err:
        Engine(path, ["device=cpu", "model.dtype=float32", f"model.context_length={limit + 1}"])
    assert err.value.key == "model.context_length"
