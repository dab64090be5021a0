"""The CPU forward's thread count: the rank's core share, one thread for a light model, or as set."""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from moeserve.config import compose
from moeserve.env import usable_cpus
from moeserve.scheduler.process import LIGHT_MODEL_LAYER_PARAMS, cpu_forward_threads, cpu_share


class _Model(nn.Module):
    def __init__(self, layer_params: int):
        super().__init__()
        self.embed_tokens = nn.Parameter(torch.empty(LIGHT_MODEL_LAYER_PARAMS), requires_grad=False)
        self.lm_head = nn.Linear(1, LIGHT_MODEL_LAYER_PARAMS, bias=False)
        self.layer = nn.Parameter(torch.empty(layer_params), requires_grad=False)


def test_light_model_gets_one_thread_heavy_one_the_share(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # set to 1 under pytest-xdist
    cfg = compose([])
    assert cpu_forward_threads(cfg, _Model(1000)) == 1  # embedding and head do not count
    assert cpu_forward_threads(cfg, _Model(LIGHT_MODEL_LAYER_PARAMS)) == cpu_share(cfg)
    assert cpu_share(cfg) == len(os.sched_getaffinity(0))


def test_share_follows_the_affinity_mask_and_omp_num_threads(monkeypatch):
    """A server under taskset or a container's cpuset sees its own cores, not the host's; an
    OMP_NUM_THREADS the user set caps each process's forward threads."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert usable_cpus() == 1 and cpu_share(compose([])) == 1
    finally:
        os.sched_setaffinity(0, cores)
    assert usable_cpus() == len(cores)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert usable_cpus() == 1
    assert cpu_share(compose(["parallel=dp2_ep2"])) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "x")  # not a count: ignored
    assert usable_cpus() == len(cores)


def test_explicit_setting_wins():
    cfg = compose([])
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, cpu_threads=3))
    assert cpu_forward_threads(cfg, _Model(1000)) == 3
    assert compose(["scheduler.cpu_threads=2"]).scheduler.cpu_threads == 2
