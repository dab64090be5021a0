"""The scheduler process: ZMQ I/O around the Scheduler, ready handshake and load reports."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import zmq

from moeserve.config import MoeserveConfig
from moeserve.env import usable_cpus
from moeserve.ipc.messages import (ControlReply, ControlReq, LoadReport, ReadyMsg, SchedulerInput,
                                   TokenOutput, TokenOutputBatch)
from moeserve.ipc.queues import Endpoints, PullQueue, PushQueue
from moeserve.procs.affinity import pin_rank

logger = logging.getLogger(__name__)

LOAD_REPORT_INTERVAL_S = 0.5
SPEC_LOG_INTERVAL_S = 10.0  # speculative decoding's accept length, logged per interval
LIGHT_MODEL_LAYER_PARAMS = 10_000_000  # below: one forward thread (SchedulerConfig.cpu_threads)


class ZmqSchedulerIO:
    """SchedulerIO over ZMQ: requests in, token outputs to the detokenizer, control replies and
    periodic load reports to the tokenizer manager."""

    def __init__(self, endpoints: Endpoints, rank: int, dp_rank: int):
        self.ctx = zmq.Context()
        self.inbox: PullQueue = PullQueue(self.ctx, endpoints.scheduler_address(dp_rank),
                                          SchedulerInput)
        self.to_detok = PushQueue(self.ctx, endpoints.detokenizer_in)
        self.to_manager = PushQueue(self.ctx, endpoints.manager_in)
        self.to_controller = (PushQueue(self.ctx, endpoints.controller_in)
                              if endpoints.controller_in else None)
        self.rank = rank
        self.load_fn: Callable[[], dict] | None = None
        self._next_report = 0.0
        self._spec_log = (0.0, 0, 0, 0)  # (time, verify steps, draft tokens, accepted tokens)

    def recv(self, timeout_ms: int):
        self._maybe_report()
        first = self.inbox.get(timeout_ms) if timeout_ms else None
        return ([first] if first is not None else []) + self.inbox.get_nowait_all()

    def send_outputs(self, outputs: list[TokenOutput], stop_strings: dict[str, list[str]]) -> None:
        self.to_detok.put(TokenOutputBatch(outputs=outputs, stop_strings=stop_strings))

    def send_control(self, req: ControlReq, ok: bool, data: dict) -> None:
        self.to_manager.put(ControlReply(cid=req.cid, rank=self.rank, ok=ok, data=data))

    def close(self) -> None:
        for q in (self.inbox, self.to_detok, self.to_manager, self.to_controller):
            if q is not None:
                q.close()
        self.ctx.term()

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if self.load_fn is None or now < self._next_report:
            return
        self._next_report = now + LOAD_REPORT_INTERVAL_S
        load = self.load_fn()
        report = LoadReport(
            rank=self.rank, running=load["running"], waiting=load["waiting"],
            used_tokens=load["used_tokens"], max_total_tokens=load["max_total_tokens"],
            cache_hit_tokens=load["cache_hit_tokens"], prompt_tokens=load["prompt_tokens"],
            eplb_balancedness=load.get("eplb_balancedness", -1.0), disagg=load.get("disagg", {}))
        self.to_manager.put(report)
        if self.to_controller is not None:
            self.to_controller.put(report)
        if "spec_verify_steps" in load and now >= self._spec_log[0] + SPEC_LOG_INTERVAL_S:
            self._log_spec(now, load)

    def _log_spec(self, now: float, load: dict) -> None:
        counts = (load["spec_verify_steps"], load["spec_draft_tokens"],
                  load["spec_accepted_tokens"])
        steps, drafts, accepted = (c - p for c, p in zip(counts, self._spec_log[1:]))
        if steps:
            logger.info("rank %d speculative decoding: %d verify passes, accept length %.2f, "
                        "%.0f%% of drafts accepted", self.rank, steps, accepted / steps,
                        100.0 * (accepted - steps) / max(drafts, 1))
        self._spec_log = (now, *counts)


def rank_device(device: str, rank: int):
    """cuda:<local rank> on GPUs (one rank per GPU), cpu otherwise."""
    import torch

    from moeserve.runtime.model_config import resolve_device

    base = resolve_device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", rank % torch.cuda.device_count())


def cpu_share(cfg: MoeserveConfig) -> int:
    """This rank's share of the cores the server may use (env.usable_cpus)."""
    local_ranks = cfg.parallel.world_size // cfg.parallel.nnodes
    return max(1, usable_cpus() // local_ranks)


def cpu_forward_threads(cfg: MoeserveConfig, model) -> int:
    """scheduler.cpu_threads, or by default the core share (1 for a light model: see the field)."""
    if cfg.scheduler.cpu_threads is not None:
        return cfg.scheduler.cpu_threads
    layer_params = sum(p.numel() for name, p in model.named_parameters()
                       if "embed_tokens" not in name and "lm_head" not in name)
    return 1 if layer_params < LIGHT_MODEL_LAYER_PARAMS else cpu_share(cfg)


def run_scheduler_process(cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                          rank: int = 0) -> None:
    """Process entry for global rank `rank`: join the process groups, load the model (its expert
    shard), announce readiness with the KV capacity, serve forever."""
    from dataclasses import replace

    import torch

    from moeserve.distributed import init_mesh
    from moeserve.models.weight_bytes import weight_bytes
    from moeserve.procs.children import STOP_SIGNAL
    from moeserve.procs.exit import exit_now
    from moeserve.scheduler.setup import build_scheduler
    from moeserve.scheduler.shutdown import StopRequest, release_rank

    device = rank_device(cfg.device, rank)
    local_ranks = cfg.parallel.world_size // cfg.parallel.nnodes
    pin_rank(cfg.scheduler.cpus, rank % local_ranks, local_ranks)  # before any thread starts
    if device.type == "cpu":
        torch.set_num_threads(cpu_share(cfg))  # ranks share the cores: no oversubscription
    cfg = replace(cfg, model=replace(cfg.model, path=model_path))
    elastic = None
    if cfg.parallel.elastic_ep:  # groups re-formed when a rank dies (moeserve/elastic/)
        from moeserve.elastic.rank import ElasticRank

        elastic = ElasticRank(cfg, rank, device)
        mesh = elastic.initial_mesh()
    else:
        mesh = init_mesh(cfg.parallel, rank, device)
    io = ZmqSchedulerIO(endpoints, rank, mesh.dp_rank)
    scheduler, _ = build_scheduler(cfg, io, mesh)
    if elastic is not None:
        elastic.attach(scheduler)
    if device.type == "cpu":
        torch.set_num_threads(cpu_forward_threads(cfg, scheduler.runner.model))
    io.load_fn = scheduler.load
    info = {"max_total_tokens": scheduler.runner.memory.allocator.size, "dp_rank": mesh.dp_rank,
            "max_req_len": scheduler.max_req_len,
            "max_running_requests": cfg.cache.max_running_requests,
            "weight_bytes": weight_bytes(scheduler.runner.model)}  # by part, this rank
    if scheduler.pd is not None:
        info["pd"] = scheduler.pd.info()  # the bootstrap server's route table reads it
    if elastic is not None:  # which process a rank is (the fault tests' role_pids assumes none)
        info["elastic_pid"] = os.getpid()
    io.to_manager.put(ReadyMsg(role="scheduler", rank=rank, info=info))
    logger.info("scheduler %d ready: %s", rank, info)
    stop = StopRequest(scheduler)
    stop.install(STOP_SIGNAL)  # from now on the ranks stop together (scheduler/shutdown.py)
    if elastic is not None:
        elastic.run(should_stop=stop)
    else:
        scheduler.run_forever(should_stop=stop)
    release_rank(scheduler)
    io.close()
    exit_now(0)
