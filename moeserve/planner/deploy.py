"""A deployment to price: one colocated role, or a prefill and a decode role (PD disaggregated),
each with its own nodes, EP size, batch, TBO and MTP; and its Hydra `+deploy=` preset."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Role:
    kind: str  # prefill | decode | colocated
    nodes: int = 1
    gpus_per_node: int = 8
    ep: int | None = None  # None: every GPU of the role (DP attention on all of them)
    tbo: bool = False
    a2a: str = "auto"  # auto (DeepEP normal for prefill, low-latency for decode) | p2p | ...
    batch: int = 128  # decode: requests per GPU
    chunk: int = 8192  # prefill: new tokens per GPU per step
    redundant: int = 0  # EPLB redundant expert slots
    eplb: bool = True
    mtp_steps: int = 0  # MTP draft steps (0: off)
    accept_len: float = 1.0  # tokens accepted per verify, MTP on
    graphs: bool | None = None  # decode CUDA graphs; None: where the runtime would capture them

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ep_size(self) -> int:
        return self.ep or self.gpus

    def backend(self, step: str) -> str:
        if self.a2a != "auto":
            return self.a2a
        return "deepep_ll" if step == "decode" else "deepep_normal"

    def with_(self, **kw) -> Role:
        return replace(self, **kw)


@dataclass(frozen=True)
class Deployment:
    model: str
    profile: str
    dtype: str = "fp8"  # fp8 | bf16
    kernels: str = "moeserve"  # moeserve | best (costs.py)
    prefill: Role | None = None
    decode: Role | None = None
    colocated: Role | None = None

    def __post_init__(self):
        if self.colocated is None and (self.prefill is None or self.decode is None):
            raise ValueError("a deployment is colocated, or has both a prefill and a decode role")
        if self.dtype not in ("fp8", "bf16"):
            raise ValueError(f"dtype must be fp8 or bf16, not {self.dtype!r}")

    @property
    def roles(self) -> list[Role]:
        return [self.colocated] if self.colocated else [self.prefill, self.decode]

    @property
    def nodes(self) -> int:
        return sum(r.nodes for r in self.roles)


DEEPEP_MODE = {"decode": "low_latency", "prefill": "normal", "colocated": "auto"}
MODEL_CONF = {"deepseek_v3": "deepseek_v3", "qwen3_30b_a3b": "qwen3_30b_a3b",
              "llama3_8b": "llama3_8b", "deepseek_v2_lite": "deepseek_v2_lite"}


def deploy_yaml(dep: Deployment, role: Role, name: str, note: str) -> str:
    """A `+deploy=NAME` preset (package _global_) for one role: the composition
    `launch.multinode` runs (PD disaggregation itself is not in the runtime's schema yet, so a
    disaggregated plan is written as one preset per role)."""
    conf = MODEL_CONF.get(dep.model)
    if conf is None:
        raise ValueError(f"no conf/model option for {dep.model!r}")
    p = role.gpus
    lines = [
        "# @package _global_",
        f"# Written by `python -m moeserve.planner` ({note}).",
        f"# {role.kind} role: {role.nodes} node(s) x {role.gpus_per_node} GPUs, DP attention "
        f"{p}, EP {role.ep_size}. Usage:",
        f"#   python -m launch.multinode +deploy={name} +cluster=slurm model.path=DIR",
        "defaults:",
        f"  - override /model: {conf}",
        "  - override /scheduler: throughput",
        "  - override /server: public",
        "  - override /tbo: " + ('"on"' if role.tbo else '"off"'),  # bare on/off: YAML bools
        "",
        "device: cuda",
        "model:",
        f"  quantization: {'auto' if dep.dtype == 'fp8' else 'none'}",
        "parallel:",
        f"  tp_size: {p}",
        f"  dp_size: {p}",
        f"  ep_size: {role.ep_size}",
        f"  nnodes: {role.nodes}",
        f"  a2a_backend: {'deepep' if role.ep_size > 1 else 'a2a'}",
        f"  deepep_mode: {DEEPEP_MODE[role.kind]}",
        "eplb:",
        f"  num_redundant_experts: {role.redundant}",
        "  record_mode: stat",
        "cache:",
        "  mem_fraction_static: 0.85",
        f"  max_running_requests: {max(role.batch, 1) * p if role.kind != 'prefill' else 1024}",
        "scheduler:",
        f"  chunked_prefill_size: {role.chunk}",
    ]
    if role.mtp_steps:
        lines[9:9] = ["  - override /spec: nextn"]
        lines += ["spec:", f"  num_steps: {role.mtp_steps}"]
    return "\n".join(lines) + "\n"


def conf_dir() -> str:
    """The `conf/` package the runtime composes from (next to the moeserve package)."""
    import conf

    return os.path.dirname(conf.__file__)


def write_deploy(dep: Deployment, name: str, note: str, out_dir: str | None = None
                 ) -> list[str]:
    """Write the preset(s): NAME.yaml for a colocated plan, NAME_prefill / NAME_decode for a
    disaggregated one, into `out_dir/deploy/` (default: conf/deploy/). Returns the paths."""
    folder = os.path.join(out_dir or conf_dir(), "deploy")
    os.makedirs(folder, exist_ok=True)
    named = ([(name, dep.colocated)] if dep.colocated
             else [(f"{name}_prefill", dep.prefill), (f"{name}_decode", dep.decode)])
    paths = []
    for n, role in named:
        path = os.path.join(folder, f"{n}.yaml")
        with open(path, "w") as f:
            f.write(deploy_yaml(dep, role, n, note))
        paths.append(path)
    return paths
