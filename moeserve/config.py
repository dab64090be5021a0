"""Typed configuration: the frozen dataclasses of config_schema.py (re-exported here), registered
in Hydra's ConfigStore, composed from `conf/` and checked.

The YAML under `conf/` is composed against these schemas, so an unknown key or a wrong type fails at
compose time with Hydra's message; `validate()` then refuses impossible combinations naming the key.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from hydra.core.config_store import ConfigStore

from moeserve.config_schema import (  # noqa: F401 (re-exported: callers import them from here)
    DTYPES, MLA_FORMS, EXTEND_BLOCK_MS, SDPA_BACKENDS, FP8_GEMMS, LOAD_FORMATS, QUANTIZATIONS,
    ATTENTION_BACKENDS, MOE_BACKENDS, DEVICES, SCHEDULE_POLICIES, A2A_BACKENDS, DEEPEP_MODES,
    DP_POLICIES, RECORD_MODES, TOOL_PARSERS, REASONING_PARSERS, START_METHODS, SPEC_ALGORITHMS,
    ConfigError, ModelConfig, CacheConfig, SchedulerConfig, ServerConfig, ParallelConfig,
    EPLBConfig, AttentionConfig, MoEConfig, CudaGraphConfig, TBOConfig, SPEC_STEP_ASIDE,
    SpecConfig, MoeserveConfig)
from moeserve.deploy_schema import (  # noqa: F401 (re-exported as well)
    CLUSTER_KINDS, LWS_MODES, TRANSFER_BACKENDS, ROUTER_POLICIES, DISAGG_MODES, TRANSFER_PROTOCOLS,
    LWSRoleConfig, LWSConfig, ClusterConfig, DisaggregationConfig)
from moeserve.procs.affinity import parse_cpu_list


def register_configs() -> None:
    """Register the schemas so `conf/*.yaml` defaults lists can extend them (once per process:
    every compose() calls this, and building the typed nodes costs ~0.1 s)."""
    cs = ConfigStore.instance()
    if "moeserve_schema.yaml" in cs.repo:
        return
    cs.store(name="moeserve_schema", node=_schema_node(MoeserveConfig))
    for group, cls in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=_schema_node(cls))


# One schema per conf/ group: each option's defaults list starts with `<group>_schema`.
GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig,
    "scheduler": SchedulerConfig, "server": ServerConfig, "eplb": EPLBConfig, "tbo": TBOConfig,
    "spec": SpecConfig, "cluster": ClusterConfig, "disaggregation": DisaggregationConfig}


def _schema_node(cls: type) -> Any:
    """A typed node for composition; frozenness is restored when converting to the dataclass."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cls)
    _clear_readonly(node)
    return node


def _clear_readonly(node: Any) -> None:
    from omegaconf import DictConfig

    node._set_flag("readonly", None)
    if isinstance(node, DictConfig):
        for key in node.keys():
            _clear_readonly(node._get_node(key))


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {list(choices)}")


def _check_positive(key: str, value: int | float | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")


def _check_cpus(key: str, value: str | None) -> None:
    if value is None:
        return
    try:  # syntax only: a config may be rendered for other hosts (the rank checks its own)
        parse_cpu_list(str(value))
    except ValueError as e:
        raise ConfigError(key, str(e)) from None


def validate(cfg: MoeserveConfig) -> MoeserveConfig:
    """Refuse impossible values and combinations; returns cfg unchanged."""
    if cfg.model.path is None and cfg.model.name != "embedded":
        raise ConfigError("model.path", f"model '{cfg.model.name}' needs model.path=<HF folder> "
                          "(only the embedded default model has no path)")
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check_choice("model.load_format", cfg.model.load_format, LOAD_FORMATS)
    _check_choice("model.quantization", cfg.model.quantization, QUANTIZATIONS)
    _check_choice("model.fp8_gemm", cfg.model.fp8_gemm, FP8_GEMMS)
    _check_choice("attention.backend", cfg.attention.backend, ATTENTION_BACKENDS)
    if cfg.attention.backend == "cpu" and (cfg.device == "cuda" or not cfg.model.cpu_kernels):
        raise ConfigError("attention.backend", "the cpu backend needs device=cpu (or auto "
                          "without CUDA) and model.cpu_kernels=true")
    _check_choice("attention.mla_form", cfg.attention.mla_form, MLA_FORMS)
    _check_positive("attention.mla_mha_min_tokens", cfg.attention.mla_mha_min_tokens, False)
    _check_positive("attention.mla_mha_chunk_tokens", cfg.attention.mla_mha_chunk_tokens, False)
    _check_choice("attention.extend_block_m", cfg.attention.extend_block_m, EXTEND_BLOCK_MS)
    _check_positive("attention.sdpa_prefill_min_tokens", cfg.attention.sdpa_prefill_min_tokens)
    _check_choice("attention.sdpa_prefill_backend", cfg.attention.sdpa_prefill_backend,
                  SDPA_BACKENDS)
    _check_choice("device", cfg.device, DEVICES)
    _check_choice("moe.backend", cfg.moe.backend, MOE_BACKENDS)
    _check_positive("cuda_graph.max_bs", cfg.cuda_graph.max_bs, False)
    if (cfg.cuda_graph.max_extend_tokens or 0) < 0:
        raise ConfigError("cuda_graph.max_extend_tokens", "must be >= 0 (0: extend runs eager)")
    if cfg.model.fp8_lm_head and cfg.model.quantization == "none":
        raise ConfigError("model.fp8_lm_head", "needs FP8 weights (model.quantization=auto with an "
                          "FP8 checkpoint, or fp8); model.quantization=none keeps every weight "
                          "in the model dtype")
    if cfg.model.pdl and cfg.device == "cpu":
        raise ConfigError("model.pdl", "programmatic dependent launch needs a CUDA device (sm90+)")
    if cfg.cuda_graph.enabled and cfg.device == "cpu":
        raise ConfigError("cuda_graph.enabled", "CUDA graphs need a CUDA device (device=cpu)")
    if cfg.cuda_graph.enabled and cfg.attention.backend in ("torch", "cpu"):
        raise ConfigError("cuda_graph.enabled", f"CUDA graphs cannot capture attention.backend="
                          f"{cfg.attention.backend}: it syncs with the host in decode (use "
                          "attention.backend=triton or auto)")
    _check_positive("model.context_length", cfg.model.context_length)
    _check_positive("cache.max_total_tokens", cfg.cache.max_total_tokens)
    _check_positive("cache.max_running_requests", cfg.cache.max_running_requests, False)
    _check_positive("cache.page_size", cfg.cache.page_size, False)
    _check_choice("scheduler.policy", cfg.scheduler.policy, SCHEDULE_POLICIES)
    _check_positive("scheduler.chunked_prefill_size", cfg.scheduler.chunked_prefill_size, False)
    _check_positive("scheduler.stream_interval", cfg.scheduler.stream_interval, False)
    _check_positive("scheduler.cpu_threads", cfg.scheduler.cpu_threads)
    _check_cpus("scheduler.cpus", cfg.scheduler.cpus)
    if cfg.scheduler.prefill_wait_steps < 0:
        raise ConfigError("scheduler.prefill_wait_steps", "must be >= 0 (0: prefill at once)")
    if cfg.scheduler.log_interval_s < 0:
        raise ConfigError("scheduler.log_interval_s", "must be >= 0 (0: off)")
    _check_positive("server.max_n", cfg.server.max_n, False)
    _check_positive("server.max_completion_tokens", cfg.server.max_completion_tokens)
    _check_positive("server.max_request_bytes", cfg.server.max_request_bytes, False)
    if cfg.server.shutdown_timeout_s < 0:
        raise ConfigError("server.shutdown_timeout_s", "must be >= 0")
    _check_choice("server.tool_parser", cfg.server.tool_parser, TOOL_PARSERS)
    _check_choice("server.reasoning_parser", cfg.server.reasoning_parser, REASONING_PARSERS)
    _check_choice("server.start_method", cfg.server.start_method, START_METHODS)
    if not 0 < cfg.server.port < 65536:
        raise ConfigError("server.port", f"{cfg.server.port} is not a TCP port")
    _validate_parallel(cfg.parallel)
    _check_positive("tbo.min_tokens", cfg.tbo.min_tokens, False)
    _check_choice("eplb.record_mode", cfg.eplb.record_mode, RECORD_MODES)
    if cfg.eplb.num_redundant_experts < 0:
        raise ConfigError("eplb.num_redundant_experts", "must be >= 0")
    _check_positive("eplb.record_window", cfg.eplb.record_window, False)
    if cfg.eplb.require_placement and cfg.eplb.init_placement is None:
        raise ConfigError("eplb.init_placement", "eplb=static needs a placement file "
                          "(eplb.init_placement=PATH)")
    if not 0.0 < cfg.cache.mem_fraction_static <= 1.0:
        raise ConfigError("cache.mem_fraction_static", "must be in (0, 1]")
    _validate_spec(cfg)
    _validate_cluster(cfg.cluster, cfg.parallel)
    _validate_disaggregation(cfg)
    _validate_elastic(cfg)
    return cfg


def _validate_disaggregation(cfg: MoeserveConfig) -> None:
    d = cfg.disaggregation
    _check_choice("disaggregation.mode", d.mode, DISAGG_MODES)
    _check_port("disaggregation.router_port", d.router_port)
    _check_port("disaggregation.router_metrics_port", d.router_metrics_port)
    _check_choice("disaggregation.transfer_backend", d.transfer_backend, TRANSFER_BACKENDS)
    _check_choice("disaggregation.protocol", d.protocol, TRANSFER_PROTOCOLS)
    if not 0 < d.bootstrap_port < 65536:
        raise ConfigError("disaggregation.bootstrap_port", f"{d.bootstrap_port} is not a TCP port")
    for key in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s",
                "heartbeat_max_failures"):
        _check_positive(f"disaggregation.{key}", getattr(d, key), False)
    if d.staging_mb < 0:
        raise ConfigError("disaggregation.staging_mb", f"must be >= 0, got {d.staging_mb}")
    _check_positive("disaggregation.prefill_servers", d.prefill_servers, False)
    for key in ("prefill_cpus", "decode_cpus", "frontend_cpus"):
        _check_cpus(f"disaggregation.{key}", getattr(d, key))
    if not 0 <= d.prefill_nice <= 19:
        raise ConfigError("disaggregation.prefill_nice", f"must be 0-19 (a lower priority), got "
                          f"{d.prefill_nice}")
    _check_positive("disaggregation.decode_servers", d.decode_servers, False)
    if d.deployment and d.mode is not None:
        raise ConfigError("disaggregation.deployment", "a deployment starts both roles itself: "
                          "set the roles' keys in prefill_overrides / decode_overrides, not mode")
    if d.mode is None:
        return
    if d.mode == "prefill" and d.bootstrap_port == cfg.server.port:
        raise ConfigError("disaggregation.bootstrap_port", "the bootstrap server needs a port of "
                          f"its own (server.port is {cfg.server.port} too)")


ELASTIC_A2A_BACKENDS = ("a2a", "allgather")  # torch.distributed groups that can be re-formed


def _validate_elastic(cfg: MoeserveConfig) -> None:
    """Elastic EP's keys against the others (docs/elastic_ep.md: what it supports)."""
    p = cfg.parallel
    if not p.elastic_ep:
        if p.elastic_relaunch:
            raise ConfigError("parallel.elastic_relaunch", "needs parallel.elastic_ep=true")
        return
    if p.elastic_timeout_s <= 0:
        raise ConfigError("parallel.elastic_timeout_s", f"must be positive, got "
                          f"{p.elastic_timeout_s}")
    if p.dp_size < 2 or p.dp_size != p.tp_size:
        raise ConfigError("parallel.elastic_ep", "needs data-parallel attention over several "
                          f"ranks (dp_size = tp_size > 1), got tp_size {p.tp_size}, dp_size "
                          f"{p.dp_size}")
    if p.ep != p.tp_size:
        raise ConfigError("parallel.elastic_ep", "needs experts over every rank (ep_size = "
                          "tp_size)")
    if p.nnodes != 1:
        raise ConfigError("parallel.elastic_ep", "runs on one node for now (parallel.nnodes=1)")
    if p.a2a_backend not in ELASTIC_A2A_BACKENDS:
        raise ConfigError("parallel.a2a_backend", f"elastic EP re-forms torch.distributed "
                          f"groups; use one of {list(ELASTIC_A2A_BACKENDS)}, got "
                          f"{p.a2a_backend!r}")
    if cfg.spec.algorithm != "none":
        raise ConfigError("spec.algorithm", "speculative decoding is not supported with "
                          "parallel.elastic_ep=true")
    if cfg.cuda_graph.enabled:  # None is fine: elastic EP drops the graphs at a regroup
        raise ConfigError("cuda_graph.enabled", "graphs capture the EP group and expert "
                          "tables, which elastic EP replaces: set cuda_graph.enabled=false")
    if p.elastic_timeout_s > p.lockstep_timeout_s > 0:
        raise ConfigError("parallel.elastic_timeout_s", f"{p.elastic_timeout_s} exceeds "
                          f"parallel.lockstep_timeout_s {p.lockstep_timeout_s}")


MAX_TREE_TOPK = 4
MAX_TREE_NODES = 64  # draft nodes per request in a tree's verify step


def _validate_spec(cfg: MoeserveConfig) -> None:
    """Speculative decoding's keys (the model-dependent checks happen when the draft is built)."""
    s = cfg.spec
    _check_choice("spec.algorithm", s.algorithm, SPEC_ALGORITHMS)
    if s.algorithm == "none":
        if s.draft_path is not None:
            raise ConfigError("spec.draft_path", "set without spec.algorithm=nextn")
        return
    if not 1 <= s.num_steps <= 8:
        raise ConfigError("spec.num_steps", f"must be in [1, 8], got {s.num_steps}")
    if s.max_batch_size is not None and s.max_batch_size < 0:
        raise ConfigError("spec.max_batch_size",
                          "must be >= 0 (0: always speculate) or null (the device's default)")
    if s.min_batch_size < 0:
        raise ConfigError("spec.min_batch_size", f"must be >= 0, got {s.min_batch_size}")
    if not 1 <= s.topk <= MAX_TREE_TOPK:
        raise ConfigError("spec.topk", f"must be in [1, {MAX_TREE_TOPK}], got {s.topk}")
    if s.num_draft_tokens:
        full = sum(s.topk ** d for d in range(1, s.num_steps + 1))
        if s.topk == 1:
            raise ConfigError("spec.num_draft_tokens", "sizes a draft tree: set spec.topk > 1 "
                              "(a chain verifies spec.num_steps + 1 tokens)")
        if not 3 <= s.num_draft_tokens <= full + 1:
            raise ConfigError("spec.num_draft_tokens", f"must be in [3, {full + 1}] (the last "
                              f"token + 2 .. {full} nodes of the topk {s.topk}, depth "
                              f"{s.num_steps} tree), got {s.num_draft_tokens}")
    if s.topk > 1:
        if s.draft_nodes > MAX_TREE_NODES:
            raise ConfigError("spec.topk", f"a tree of topk {s.topk} and depth {s.num_steps} has "
                              f"{s.draft_nodes} nodes, more than {MAX_TREE_NODES}: lower "
                              "spec.topk or spec.num_steps, or prune it with "
                              "spec.num_draft_tokens")
        if cfg.parallel.dp_size > 1:
            raise ConfigError("spec.topk", "draft trees (topk > 1) are not built for DP "
                              "attention; use spec.topk=1 with parallel.dp_size > 1")


def loads_mtp_layer(cfg: MoeserveConfig) -> bool:
    """The checkpoint's NextN layer is built: asked for, or the draft of spec.algorithm=nextn
    without a separately trained head."""
    spec = cfg.spec.algorithm == "nextn" and cfg.spec.draft_path is None
    return cfg.model.load_mtp or spec


def _validate_cluster(c: ClusterConfig, p: ParallelConfig) -> None:
    _check_choice("cluster.kind", c.kind, CLUSTER_KINDS)
    per_node = p.tp_size // p.nnodes  # nnodes divides tp_size (checked in _validate_parallel)
    if c.gpus_per_node is not None and c.gpus_per_node != per_node:
        raise ConfigError("cluster.gpus_per_node", f"{c.gpus_per_node} != tp_size / nnodes = "
                          f"{p.tp_size} / {p.nnodes}; set parallel.tp_size/nnodes instead")
    if c.kind == "local" and p.nnodes != 1:
        raise ConfigError("parallel.nnodes", f"cluster.kind=local runs one node, got {p.nnodes}")
    if c.kind == "local_2node" and p.nnodes != 2:
        raise ConfigError("parallel.nnodes", f"cluster.kind=local_2node needs 2, got {p.nnodes}")
    if c.kind != "local" and p.dp_size != p.tp_size:
        raise ConfigError("parallel.dp_size", "several nodes need one DP rank per scheduler rank "
                          "(dp_size = tp_size)")
    _check_positive("cluster.time_min", c.time_min, False)
    for key in ("dist_port", "zmq_base_port"):
        _check_port(f"cluster.{key}", getattr(c, key))
    if c.kind == "lws" and not c.lws.in_pod:  # a pod runs its node; the manifests are made
        _validate_lws(c.lws)


def _check_port(key: str, port: int | None) -> None:
    if port is not None and not 0 < port < 65536:
        raise ConfigError(key, f"{port} is not a TCP port")


# Kubernetes' own formats: a DNS-1123 label, a resource quantity, an environment variable name.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([eE][0-9]+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LWS_NAME_MAX = 40  # room for '-prefill-<group>-<worker>' and the StatefulSet hash in 63


def _validate_lws(w: LWSConfig) -> None:
    _check_choice("cluster.lws.mode", w.mode, LWS_MODES)
    if not w.image:
        raise ConfigError("cluster.lws.image", "cluster.kind=lws needs the pods' image "
                          "(one with moeserve installed): cluster.lws.image=REGISTRY/NAME:TAG")
    for key in ("name", "namespace"):
        value = getattr(w, key)
        if not _DNS_LABEL.fullmatch(value) or len(value) > _LWS_NAME_MAX:
            raise ConfigError(f"cluster.lws.{key}", f"{value!r} is not a DNS label (lower-case "
                              f"letters, digits, '-', at most {_LWS_NAME_MAX} characters)")
    for key in ("cpu", "memory", "shm_size"):
        value = getattr(w, key)
        if value is not None and not _QUANTITY.fullmatch(str(value)):
            raise ConfigError(f"cluster.lws.{key}", f"{value!r} is not a Kubernetes quantity "
                              "(e.g. 16, 500m, 64Gi)")
    for name in w.env:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError("cluster.lws.env", f"{name!r} is not an environment variable name")
    if not w.gpu_resource:
        raise ConfigError("cluster.lws.gpu_resource", "must name the GPU resource "
                          "(e.g. nvidia.com/gpu)")
    _check_positive("cluster.lws.replicas", w.replicas, False)
    _check_port("cluster.lws.router_port", w.router_port)
    _check_choice("cluster.lws.router_policy", w.router_policy, ROUTER_POLICIES)
    for role in ("prefill", "decode"):
        _check_positive(f"cluster.lws.{role}.replicas", getattr(w, role).replicas, False)
        for o in getattr(w, role).overrides:
            if "=" not in o or o.split("=", 1)[0].startswith(("+", "~")):
                raise ConfigError(f"cluster.lws.{role}.overrides", f"{o!r} is not key=value")


def _validate_parallel(p: ParallelConfig) -> None:
    _check_choice("parallel.a2a_backend", p.a2a_backend, A2A_BACKENDS)
    _check_choice("parallel.deepep_mode", p.deepep_mode, DEEPEP_MODES)
    _check_choice("parallel.dp_policy", p.dp_policy, DP_POLICIES)
    if p.lockstep_timeout_s < 0:
        raise ConfigError("parallel.lockstep_timeout_s", f"must be >= 0 (0: off), got "
                          f"{p.lockstep_timeout_s}")
    for key in ("tp_size", "dp_size", "nnodes"):
        _check_positive(f"parallel.{key}", getattr(p, key), False)
    if p.tp_size % p.dp_size:
        raise ConfigError("parallel.dp_size", f"{p.dp_size} does not divide tp_size {p.tp_size}")
    if p.attn_tp_size != 1:
        raise ConfigError("parallel.dp_size", "attention tensor parallelism (tp_size / dp_size > 1) "
                          "is not supported: set dp_size = tp_size")
    if p.ep_size is not None and p.ep_size not in (1, p.tp_size):
        raise ConfigError("parallel.ep_size", f"must be 1 or tp_size ({p.tp_size}), got {p.ep_size}")
    if p.tp_size % p.nnodes:
        raise ConfigError("parallel.nnodes", f"{p.nnodes} nodes do not divide tp_size {p.tp_size}")
    if not 0 <= p.node_rank < p.nnodes:
        raise ConfigError("parallel.node_rank", f"must be in [0, {p.nnodes})")


def compose(overrides: list[str] | tuple[str, ...] = ()) -> MoeserveConfig:
    """Compose `conf/config.yaml` with Hydra overrides into a validated MoeserveConfig: once per
    process and override list (Hydra's composition took ~0.15 s of a core, at every offline
    Engine's start), a deep copy each call (the frozen tree still holds lists)."""
    register_configs()  # as before, whether or not the list was composed already
    return copy.deepcopy(_compose(tuple(overrides)))


@functools.lru_cache(maxsize=64)
def _compose(overrides: tuple[str, ...]) -> MoeserveConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        raw = hydra_compose(config_name="config", overrides=list(overrides))
    return to_config(raw)


def to_config(raw: Any) -> MoeserveConfig:
    """Turn a composed DictConfig into the frozen dataclass tree and validate it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    try:
        obj = OmegaConf.to_object(raw)
    except MissingMandatoryValue as e:
        raise ConfigError(str(e.full_key), "is mandatory (??? in the config): give it as an "
                          "override") from None
    if not isinstance(obj, MoeserveConfig):  # composed without the schema
        raise ConfigError("<root>", "config was not composed against moeserve_schema")
    return validate(obj)


def with_overrides(cfg: MoeserveConfig, overrides: list[str] | tuple[str, ...]) -> MoeserveConfig:
    """cfg with `key=value` overrides of config values applied and validated (a new config: cfg
    is frozen). Group choices (`parallel=dp8_ep8`) need Hydra's composition, not this."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.structured(cfg)
    _clear_readonly(node)
    try:
        merged = OmegaConf.merge(node, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(str(getattr(e, "full_key", None) or "<override>"),
                          str(e).splitlines()[0]) from None
    return to_config(merged)
