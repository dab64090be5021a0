"""The typed config: Hydra composition against the schema, and refusal of bad values by key."""

from __future__ import annotations

import dataclasses

import pytest
from hydra.errors import ConfigCompositionException

from moeserve.config import ConfigError, compose


def test_defaults_compose_and_are_frozen():
    cfg = compose([])
    assert cfg.model.path is None and cfg.server.host == "127.0.0.1" and cfg.server.port == 30000
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.path = "x"  # type: ignore[misc]


def test_overrides_apply():
    cfg = compose(["model.dtype=float32", "scheduler.overlap=false", "cache.page_size=4"])
    assert cfg.model.dtype == "float32" and not cfg.scheduler.overlap and cfg.cache.page_size == 4


def test_compose_once_per_override_list_and_a_copy_each_time(monkeypatch):
    """The same overrides compose once per process; each caller gets its own equal copy (the
    frozen tree's lists are not shared), and a refused override is refused every time."""
    import hydra

    from moeserve import config

    calls = []
    real = hydra.compose
    monkeypatch.setattr(hydra, "compose", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    overrides = ["cache.page_size=3", "cluster.setup=[a]"]
    first, second = compose(overrides), compose(tuple(overrides))
    assert len(calls) <= 1 and first == second and first is not second
    first.cluster.setup.append("b")
    assert compose(overrides).cluster.setup == ["a"] and len(calls) <= 1
    assert compose(["cache.page_size=5"]).cache.page_size == 5 and len(calls) <= 2
    for _ in range(2):
        with pytest.raises(ConfigError, match="cache.page_size"):
            compose(["cache.page_size=0"])
    assert config._compose.cache_info().hits >= 2


@pytest.mark.parametrize("override", ["model.nonexistent=1", "cache.max_running_requests=abc",
                                      "scheduler.overlap=maybe"])
def test_unknown_keys_and_wrong_types_fail_in_hydra(override):
    with pytest.raises(ConfigCompositionException):
        compose([override])


@pytest.mark.parametrize("override,key", [
    ("model.dtype=int4", "model.dtype"),
    ("model.quantization=int4", "model.quantization"),
    ("model.quantization=FP8", "model.quantization"),
    ("cache.page_size=0", "cache.page_size"),
    ("scheduler.policy=random", "scheduler.policy"),
    ("server.port=70000", "server.port"),
    ("cache.mem_fraction_static=1.5", "cache.mem_fraction_static"),
    ("attention.backend=magic", "attention.backend"),
    ("attention.backend=cpu device=cuda", "attention.backend"),
    ("attention.backend=cpu model.cpu_kernels=false", "attention.backend"),
    ("attention.extend_block_m=96", "attention.extend_block_m"),
    ("attention.sdpa_prefill_min_tokens=0", "attention.sdpa_prefill_min_tokens"),
    ("attention.sdpa_prefill_backend=fast", "attention.sdpa_prefill_backend"),
])
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose(override.split())
    assert err.value.key == key and key in str(err.value)
