"""Typed configuration: frozen dataclasses registered in Hydra's ConfigStore.

The YAML under `conf/` is composed against these schemas, so an unknown key or a wrong type fails at
compose time with Hydra's message; `validate()` then refuses impossible combinations naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("safetensors", "dummy")
ATTENTION_BACKENDS = ("torch",)
DEVICES = ("auto", "cpu", "cuda")
SCHEDULE_POLICIES = ("lpm", "fcfs")
A2A_BACKENDS = ("a2a", "allgather", "deepep")
DEEPEP_MODES = ("auto", "normal", "low_latency")
DP_POLICIES = ("round_robin", "shortest_queue", "prefix_aware")
RECORD_MODES = ("off", "stat", "per_pass")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config error at '{key}': {message}")
        self.key = key


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # HF-format folder; None = the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bf16/checkpoint dtype on CUDA, float32 on CPU
    load_format: str = "safetensors"  # dummy: random weights from config.json alone
    context_length: int | None = None  # None: max_position_embeddings of the checkpoint
    load_mtp: bool = False  # load the DeepSeek NextN (MTP) layer weights when present


@dataclass(frozen=True)
class CacheConfig:
    max_total_tokens: int | None = None  # KV slots; None: derived from memory (CPU: 65536)
    max_running_requests: int = 256
    page_size: int = 1
    mem_fraction_static: float = 0.85  # CUDA: share of free memory for weights + KV


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int = 2048  # max new prefill tokens per step; longer prompts are chunked
    policy: str = "lpm"  # lpm: longest cached prefix first | fcfs
    overlap: bool = True  # event_loop_overlap (post-process step N-1 while step N runs)
    disable_radix_cache: bool = False
    init_new_token_ratio: float = 0.7  # share of max_new_tokens reserved for running decodes
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # per decode step, back towards the minimum
    stream_interval: int = 1  # decode steps between streamed outputs


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"
    served_model_name: str | None = None  # default: the model folder's name
    max_n: int = 16  # largest `n` accepted per request
    log_level: str = "info"
    startup_timeout_s: float = 600.0


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks: tp_size in all (= nnodes × ranks per node); attention is data-parallel over dp_size
    groups of tp_size / dp_size ranks; MoE experts are spread over ep_size = tp_size ranks."""

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int | None = None  # None: tp_size (experts over every rank)
    a2a_backend: str = "a2a"  # a2a | allgather | deepep (dispatch/combine of MoE tokens)
    deepep_mode: str = "auto"  # auto: normal when any rank prefills, else low_latency
    dp_policy: str = "round_robin"  # round_robin | shortest_queue | prefix_aware
    prefix_aware_margin: int = 4  # prefix_aware: allowed extra queued requests on the cache owner
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of the torch.distributed rendezvous

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def ep(self) -> int:
        return self.tp_size if self.ep_size is None else self.ep_size


@dataclass(frozen=True)
class EPLBConfig:
    """Expert placement: physical experts = logical + num_redundant_experts, spread over EP ranks."""

    num_redundant_experts: int = 0
    init_placement: str | None = None  # placement.json or a recorder dump (rebalanced on load)
    record_mode: str = "off"  # off | stat (accumulate) | per_pass (window of record_window steps)
    record_window: int = 1000


@dataclass(frozen=True)
class AttentionConfig:
    backend: str = "torch"


@dataclass(frozen=True)
class MoeserveConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    device: str = "auto"
    seed: int = 0


def register_configs() -> None:
    """Register the schemas so `conf/*.yaml` defaults lists can extend them."""
    cs = ConfigStore.instance()
    cs.store(name="moeserve_schema", node=_schema_node(MoeserveConfig))
    cs.store(group="model", name="model_schema", node=_schema_node(ModelConfig))


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


def validate(cfg: MoeserveConfig) -> MoeserveConfig:
    """Refuse impossible values and combinations; returns cfg unchanged."""
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check_choice("model.load_format", cfg.model.load_format, LOAD_FORMATS)
    _check_choice("attention.backend", cfg.attention.backend, ATTENTION_BACKENDS)
    _check_choice("device", cfg.device, DEVICES)
    _check_positive("model.context_length", cfg.model.context_length)
    _check_positive("cache.max_total_tokens", cfg.cache.max_total_tokens)
    _check_positive("cache.max_running_requests", cfg.cache.max_running_requests, False)
    _check_positive("cache.page_size", cfg.cache.page_size, False)
    _check_choice("scheduler.policy", cfg.scheduler.policy, SCHEDULE_POLICIES)
    _check_positive("scheduler.chunked_prefill_size", cfg.scheduler.chunked_prefill_size, False)
    _check_positive("scheduler.stream_interval", cfg.scheduler.stream_interval, False)
    _check_positive("server.max_n", cfg.server.max_n, False)
    if not 0 < cfg.server.port < 65536:
        raise ConfigError("server.port", f"{cfg.server.port} is not a TCP port")
    _validate_parallel(cfg.parallel)
    _check_choice("eplb.record_mode", cfg.eplb.record_mode, RECORD_MODES)
    if cfg.eplb.num_redundant_experts < 0:
        raise ConfigError("eplb.num_redundant_experts", "must be >= 0")
    _check_positive("eplb.record_window", cfg.eplb.record_window, False)
    if not 0.0 < cfg.cache.mem_fraction_static <= 1.0:
        raise ConfigError("cache.mem_fraction_static", "must be in (0, 1]")
    return cfg


def _validate_parallel(p: ParallelConfig) -> None:
    _check_choice("parallel.a2a_backend", p.a2a_backend, A2A_BACKENDS)
    _check_choice("parallel.deepep_mode", p.deepep_mode, DEEPEP_MODES)
    _check_choice("parallel.dp_policy", p.dp_policy, DP_POLICIES)
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
    """Compose `conf/config.yaml` with Hydra overrides into a validated MoeserveConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        raw = hydra_compose(config_name="config", overrides=list(overrides))
    return to_config(raw)


def to_config(raw: Any) -> MoeserveConfig:
    """Turn a composed DictConfig into the frozen dataclass tree and validate it."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(raw)
    if not isinstance(obj, MoeserveConfig):  # composed without the schema
        raise ConfigError("<root>", "config was not composed against moeserve_schema")
    return validate(obj)
