"""The deployment's schema: where ranks run (local, Slurm, Kubernetes LeaderWorkerSet) and the
prefill-decode roles (docs/disaggregation.md, docs/deploy_k8s.md). config_schema.py nests these in
MoeserveConfig; config.py re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

CLUSTER_KINDS = ("local", "local_2node", "slurm", "lws")
LWS_MODES = ("colocated", "pd")
TRANSFER_BACKENDS = ("mooncake", "nixl")
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
DISAGG_MODES = (None, "prefill", "decode")
TRANSFER_PROTOCOLS = ("auto", "tcp", "rdma")


@dataclass(frozen=True)
class LWSRoleConfig:
    """One side of a PD deployment on Kubernetes (docs/deploy_k8s.md)."""

    replicas: int = 1  # LeaderWorkerSet groups, each a whole prefill (or decode) server
    # Hydra overrides (key=value of config values, not group choices) this role adds to the
    # base config, e.g. its parallel layout: ["parallel.nnodes=2", "parallel.tp_size=16", ...]
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LWSConfig:
    """Kubernetes LeaderWorkerSet manifests (`cluster.kind=lws`, docs/deploy_k8s.md): one LWS group
    per server, a pod per node (leader = node 0), GPUs per pod = tp_size / nnodes."""

    mode: str = "colocated"  # colocated: one dp x ep server per group | pd: prefill, decode, router
    name: str = "moeserve"  # prefix of every object's name (a DNS label)
    namespace: str = "default"
    image: str | None = None  # an image with moeserve installed (and sglang-router, for pd)
    replicas: int = 1  # colocated: LWS groups behind one Service
    gpu_resource: str = "nvidia.com/gpu"  # the GPU limit's resource name (none with device=cpu)
    cpu: str | None = None  # Kubernetes quantities for each pod's requests = limits; None: unset
    memory: str | None = None
    shm_size: str = "16Gi"  # /dev/shm (a memory-backed emptyDir): NCCL and torch need more than 64M
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every container
    models_pvc: str | None = None  # a PersistentVolumeClaim mounted read-only at models_mount
    models_mount: str = "/models"
    pod_run_dir: str = "/var/log/moeserve"  # hydra.run.dir inside the pods (config, logs)
    folder: str = "lws"  # where the manifests are written, relative to the Hydra run dir
    # pd: each side's groups and overrides (the pods get disaggregation.mode=<role>)
    prefill: LWSRoleConfig = field(default_factory=LWSRoleConfig)
    decode: LWSRoleConfig = field(default_factory=LWSRoleConfig)
    # the bootstrap port and transfer backend are disaggregation.* (each role's config)
    router_image: str | None = None  # None: image
    router_port: int = 8000
    router_policy: str = "cache_aware"
    # set in the pods' commands: run this pod's node from the LWS_* environment (procs/lws.py)
    in_pod: bool = False


@dataclass(frozen=True)
class ClusterConfig:
    """Where the ranks run (`launch.multinode`). The node count is `parallel.nnodes`; each node
    runs tp_size / nnodes ranks (one per GPU)."""

    # local: one host | local_2node: two simulated nodes on one host | slurm | lws (Kubernetes)
    kind: str = "local"
    gpus_per_node: int | None = None  # None: tp_size / nnodes; when set it must equal that
    node_addr: str = "127.0.0.1"  # local_2node: host of every node (node 0 on slurm: from Slurm)
    dist_port: int | None = None  # torch.distributed rendezvous port on node 0; None: a free one
    zmq_base_port: int | None = None  # first of the tcp:// ZMQ ports; None: free ones (local_2node)
    # slurm (submitit)
    partition: str | None = None
    account: str | None = None
    time_min: int = 60
    job_name: str = "moeserve"
    cpus_per_task: int | None = None
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load, venv)
    folder: str = "submitit"  # submitit's job folder, relative to the Hydra run dir
    dry_run: bool = False  # print what would be submitted (slurm: the sbatch script) and exit 0
    lws: LWSConfig = field(default_factory=LWSConfig)


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill-decode disaggregation (moeserve/disaggregation/, docs/disaggregation.md): a prefill
    server computes the prompt's KV and the first token and writes them into a decode server's KV
    pool through a transfer engine; SGLang's router (`--pd-disaggregation`) fronts both."""

    mode: str | None = None  # None: colocated | prefill | decode
    transfer_backend: str = "mooncake"  # mooncake (Mooncake transfer engine) | nixl
    # mooncake's transport: auto (rdma where an RDMA device is present, else tcp) | tcp | rdma
    protocol: str = "auto"
    ib_device: str | None = None  # rdma: the HCA(s), e.g. "mlx5_0"; None: the engine's discovery
    bootstrap_port: int = 8998  # prefill: the bootstrap server (rooms -> this server's ranks)
    # the address peers reach this server's transfer engine and control sockets at
    host: str = "127.0.0.1"
    # prefill: a prefilled request keeps its KV slots until its decode server asks for them and
    # the write ends, at most this long (then they are freed and the request counts as failed)
    bootstrap_timeout_s: float = 60.0
    # decode: a request fails (with an error naming its prefill server) when its KV has not
    # arrived this long after it did
    waiting_timeout_s: float = 120.0
    # decode: prefill servers with requests in flight are probed this often; this many missed
    # probes in a row fail those requests at once
    heartbeat_interval_s: float = 1.0
    heartbeat_max_failures: int = 2
    # prefill: a registered buffer of this size that a prompt whose slots are fragmented is
    # gathered into before the write (fewer, longer byte ranges; disaggregation/staging.py);
    # 0 (default): write from the pool as it is (staging measured slower here: docs)
    staging_mb: int = 0
    # `launch.multinode +cluster=local` with deployment=true starts a whole PD deployment on this
    # host instead of one server: prefill and decode servers (`python -m launch.server` with the
    # same overrides plus their own below) and sglang-router in front (moeserve/server/
    # pd_deployment.py). cpus: `taskset -c` lists pinning each role (None: not pinned)
    deployment: bool = False
    prefill_servers: int = 1
    decode_servers: int = 1
    prefill_overrides: list[str] = field(default_factory=list)
    decode_overrides: list[str] = field(default_factory=list)
    prefill_cpus: str | None = None
    decode_cpus: str | None = None
    # with *_cpus: the cores of both roles' HTTP, tokenizer and detokenizer processes and of the
    # router; each role's *_cpus then pins its scheduler ranks alone (scheduler.cpus). None: a
    # role's front end shares its cores and the router is not pinned
    frontend_cpus: str | None = None
    # the prefill servers' niceness (`nice -n`, 0-19): on cores it shares with the token path (the
    # router, a client, a decode server's front end), a long prompt's prefill step then yields
    # to them at once instead of delaying streamed tokens by its length (docs/disaggregation.md)
    prefill_nice: int = 0
    # CUDA_VISIBLE_DEVICES of each role's servers (e.g. "0,1,2,3"); None: inherited
    prefill_gpus: str | None = None
    decode_gpus: str | None = None
    router_port: int = 8000
    # the router's Prometheus port; None: a free one (sglang-router's fixed default, 29000, made
    # a second deployment on the host panic at start: "Address already in use")
    router_metrics_port: int | None = None
