"""Kernel and CUDA-graph choices: auto resolves by device, impossible explicit choices are refused
naming the key, and graph buckets follow the DP sync (every rank the largest batch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeserve.config import ConfigError, compose
from moeserve.core import ForwardMode
from moeserve.runtime.cuda_graph import CudaGraphRunner, decode_buckets
from moeserve.runtime.kernel_choice import (attention_backend_name, moe_backend_name,
                                            use_cuda_graphs, use_pdl)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_backends_by_device():
    cfg = compose()
    assert attention_backend_name(cfg, CUDA, False, False) == "triton"
    assert attention_backend_name(cfg, CPU, True, False) == "cpu"
    assert attention_backend_name(cfg, CPU, False, False) == "torch"
    assert moe_backend_name(cfg, CUDA, False) == "triton"
    assert moe_backend_name(cfg, CPU, False) == "torch"


@pytest.mark.parametrize("override,key", [("attention.backend=triton", "attention.backend"),
                                          ("moe.backend=triton", "moe.backend")])
def test_triton_on_cpu_needs_the_interpreter(override, key):
    cfg = compose([override])
    with pytest.raises(ConfigError, match=key):
        attention_backend_name(cfg, CPU, True, False) if key.startswith("attention") else \
            moe_backend_name(cfg, CPU, False)
    assert (attention_backend_name(cfg, CPU, True, True) if key.startswith("attention")
            else moe_backend_name(cfg, CPU, True)) == "triton"


def test_pdl_off_on_cpu_and_refused_where_asked_for():
    assert use_pdl(compose(), CPU) is False
    assert use_pdl(compose(["model.pdl=false"]), CUDA) is False  # never probes the device
    with pytest.raises(ConfigError, match="model.pdl"):
        compose(["device=cpu", "model.pdl=true"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="model.pdl"):
            use_pdl(compose(["model.pdl=true"]), CUDA)


def test_graphs_default_on_cuda_only_where_capturable():
    cfg = compose()
    assert use_cuda_graphs(cfg, CUDA, True, None) == (True, "")
    on, why = use_cuda_graphs(cfg, CUDA, False, None)
    assert not on and "attention.backend" in why
    on, why = use_cuda_graphs(cfg, CUDA, True, SimpleNamespace())  # a dispatcher, not graph-safe
    assert not on and "a2a_backend" in why
    assert use_cuda_graphs(cfg, CPU, True, None)[0] is False
    with pytest.raises(ConfigError, match="cuda_graph.enabled"):
        use_cuda_graphs(compose(["cuda_graph.enabled=true", "attention.backend=torch"]), CUDA,
                        False, None)
    with pytest.raises(ConfigError, match="cuda_graph.enabled"):
        compose(["cuda_graph.enabled=true", "device=cpu"])
    assert use_cuda_graphs(compose(["cuda_graph.enabled=false"]), CUDA, True, None)[0] is False


def test_decode_buckets():
    assert decode_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and decode_buckets(256)[-1] == 256
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(1) == [1]


def _fb(mode, n, global_mode=None, global_tokens=None, all_logits=False):
    return SimpleNamespace(forward_mode=mode, batch_size=n, global_forward_mode=global_mode,
                           global_num_tokens=global_tokens, return_all_logits=all_logits)


def test_bucket_of_step_follows_the_dp_sync():
    g = CudaGraphRunner.__new__(CudaGraphRunner)
    g.buckets = decode_buckets(64)
    D, E, I = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.IDLE
    assert g.bucket_of_step(_fb(D, 3)) == 4
    assert g.bucket_of_step(_fb(D, 65)) is None  # past max_bs: eager
    assert g.bucket_of_step(_fb(E, 3)) is None
    # DP: every rank the largest batch; an idle rank replays it with padding only
    assert g.bucket_of_step(_fb(D, 3, D, [3, 17])) == 24
    assert g.bucket_of_step(_fb(I, 0, D, [0, 17])) == 24
    assert g.bucket_of_step(_fb(I, 0, E, [0, 17])) is None  # another rank extends: all eager
    assert g.bucket_of_step(_fb(D, 2, D, [2, 100])) is None
