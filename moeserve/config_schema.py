"""The configuration's schema: the choices, the frozen dataclasses Hydra composes `conf/` against,
and ConfigError. Composition and the cross-key checks are in config.py, which re-exports these."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.deploy_schema import ClusterConfig, DisaggregationConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("safetensors", "dummy")
QUANTIZATIONS = ("auto", "none", "fp8")
FP8_GEMMS = ("triton", "deep_gemm")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
MLA_FORMS = ("auto", "absorbed", "mha")
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient")  # attention.sdpa_prefill_backend
EXTEND_BLOCK_MS = (None, 64, 128)  # attention.extend_block_m
MOE_BACKENDS = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULE_POLICIES = ("lpm", "fcfs")
A2A_BACKENDS = ("a2a", "allgather", "p2p", "deepep")
DEEPEP_MODES = ("auto", "normal", "low_latency")
DP_POLICIES = ("round_robin", "shortest_queue", "prefix_aware")
RECORD_MODES = ("off", "stat", "per_pass")
TOOL_PARSERS = ("auto", "none", "deepseek_v3", "hermes", "llama3")
REASONING_PARSERS = (None, "deepseek_r1", "qwen3")
START_METHODS = ("forkserver", "spawn")
SPEC_ALGORITHMS = ("none", "nextn")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config error at '{key}': {message}")
        self.key = key


@dataclass(frozen=True)
class ModelConfig:
    name: str = "embedded"  # the conf/model/ option; only "embedded" may leave path unset
    path: str | None = None  # HF-format folder; None (name=embedded): the embedded SmolLM2-135M
    # auto: the checkpoint's 16-bit dtype on CUDA; on CPU bf16 where bf16 linears are fast (native
    # bf16 with oneDNN's prepack, or the AVX2 + FMA C linear of kernels/cpu/linear.c), else float32
    dtype: str = "auto"
    load_format: str = "safetensors"  # dummy: random weights from config.json alone
    context_length: int | None = None  # None: max_position_embeddings of the checkpoint
    load_mtp: bool = False  # load the DeepSeek NextN (MTP) layer weights when present
    # auto: a DeepSeek block-FP8 checkpoint (quantization_config) stays resident in FP8 on CUDA
    # and is dequantized exactly on CPU | fp8: quantize float weights at load into 128x128 FP8
    # blocks (also on CPU, with reference matmuls) | none: dequantize FP8 checkpoints at load.
    # models/quantization.py says which weights stay in higher precision (docs/fp8.md)
    quantization: str = "auto"
    # with FP8 weights (quantization resolved to FP8 on CUDA): the LM head too, quantized at load
    # into the same blocks. Off by default: DeepSeek ships it in bf16 and sampling reads its
    # logits; at decode batch 1 it is the largest single weight stream (docs/fp8.md)
    fp8_lm_head: bool = False
    # FP8 linears' GEMM at prefill sizes (M > 16) on CUDA: triton (the Triton GEMM, or
    # torch._scaled_mm where its probe passed) | deep_gemm (DeepGEMM where the shape fits; it
    # must be installed: kernels/deepgemm_linear.py). Decode's small M is the same either way
    fp8_gemm: str = "triton"
    # CPU: run the decode step's small ops (norms, q/k norm + rope, router top-k, small experts,
    # attention, the greedy LM head) as C kernels built with the system C compiler
    # (kernels/cpu/); without one, torch ops
    cpu_kernels: bool = True
    # CUDA: RMSNorm (+ residual), q/k norm + rope and the softmax router top-k as Triton kernels
    # (kernels/triton/ops.py); false: torch ops
    gpu_kernels: bool = True
    # CUDA: launch the decode-path Triton kernels (small ops, GEMVs, attention, fused MoE) as
    # programmatic dependent launches, so each one's launch and weight loads overlap the previous
    # kernel (kernels/triton/pdl.py). None: where the GPU (sm90+) and Triton support it
    pdl: bool | None = None


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
    # event_loop_overlap: post-process step N-1 while step N runs. None: on CUDA only. On a CPU the
    # "device" is the same cores: the host work steals them from the forward's OpenMP team (on 2
    # cores a batch-16 SmolLM2 decode step went from 62 to 99 ms), so the plain loop is faster.
    overlap: bool | None = None
    disable_radix_cache: bool = False
    init_new_token_ratio: float = 0.7  # share of max_new_tokens reserved for running decodes
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # per decode step, back towards the minimum
    stream_interval: int = 1  # decode steps between streamed outputs
    # Prefill steps carry the running decodes along (one token each, in the same eager forward),
    # so decoding does not stall while new requests prefill; the chunk budget shrinks by them.
    # None: on CUDA (H200, Qwen3-30B-A3B, 256 concurrent: 3420 vs 2578 output tok/s), not on a
    # CPU, where a decode step is no cheaper than the eager forward it would ride in.
    mixed_chunk: bool | None = None
    # While requests decode, new arrivals wait up to this many decode steps so that one prefill
    # step serves several of them; a full chunk of waiting prompt tokens starts it at once.
    # 0: prefill at once. (H200, with mixed steps, a second run: 3024 tok/s at 2, 3538 at 4.)
    prefill_wait_steps: int = 0
    log_interval_s: float = 10.0  # per-rank step statistics in the log (0: off)
    # CPU: OpenMP threads of each rank's forward. None: the rank's share of the cores, but 1 for a
    # light model (decoder layers under 10M parameters), whose decode step is mostly per-op host
    # work: a second thread gains little there and stalls its parallel regions on the cores the
    # HTTP and detokenizer processes use (tiny Qwen3-MoE, 16 streams on 2 cores: ~2400 tok/s with
    # 1 thread, 1700-2240 with 2; SmolLM2-135M: 270 with 2, 186 with 1).
    cpu_threads: int | None = None
    # CPU: pin the scheduler ranks (only) to these cores, `taskset -c` syntax, split evenly among
    # the node's ranks; the HTTP, tokenizer and detokenizer processes keep the launcher's
    # affinity (procs/affinity.py). None: the ranks inherit it too
    cpus: str | None = None

    def use_overlap(self, device: str) -> bool:
        return self.overlap if self.overlap is not None else device == "cuda"

    def use_mixed_chunk(self, device: str) -> bool:
        return self.mixed_chunk if self.mixed_chunk is not None else device == "cuda"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"
    served_model_name: str | None = None  # default: the model folder's name
    max_n: int = 16  # largest `n` accepted per request
    # most tokens one request may generate (max_tokens above it is a 400; absent, it is the
    # default); None: up to the context
    max_completion_tokens: int | None = None
    log_level: str = "info"
    startup_timeout_s: float = 600.0
    tool_parser: str = "auto"  # auto (from the chat template) | none | deepseek_v3 | hermes | llama3
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: <think>…</think> → reasoning_content
    # SIGTERM: in-flight requests may finish for this long (new ones get 503), then the rest end
    shutdown_timeout_s: float = 30.0
    max_request_bytes: int = 16 * 1024 * 1024  # larger request bodies get 413
    # how a launcher starts its rank, controller and detokenizer processes: forkserver (a server
    # process that imported torch and transformers once forks each child: a DP4 Engine's start
    # and stop 18.5 -> 13.5 CPU-s on CPU) | spawn (a fresh interpreter per child)
    start_method: str = "forkserver"


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks: tp_size in all (= nnodes × ranks per node); attention is data-parallel over dp_size
    groups of tp_size / dp_size ranks; MoE experts are spread over ep_size = tp_size ranks."""

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int | None = None  # None: tp_size (experts over every rank)
    a2a_backend: str = "a2a"  # a2a | allgather | p2p | deepep (dispatch/combine of MoE tokens)
    deepep_mode: str = "auto"  # auto: normal when any rank prefills, else low_latency
    dp_policy: str = "round_robin"  # round_robin | shortest_queue | prefix_aware
    prefix_aware_margin: int = 4  # prefix_aware: allowed extra queued requests on the cache owner
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of the torch.distributed rendezvous
    # a rank waiting this long in the per-step DP sync, or holding work yet scheduling nothing
    # this long, logs every rank's last known state in one line (dp_attention/watchdog.py); 0: off
    lockstep_timeout_s: float = 60.0
    # elastic EP (moeserve/elastic/, docs/elastic_ep.md): a dead rank is dropped and the others
    # keep serving on a new group; a collective waits at most elastic_timeout_s for a peer, and a
    # rank silent (no heartbeat) that long is declared dead; elastic_relaunch starts it again
    elastic_ep: bool = False
    elastic_timeout_s: float = 5.0
    elastic_relaunch: bool = False

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
    require_placement: bool = False  # eplb=static: refuse to start without init_placement
    record_mode: str = "off"  # off | stat (accumulate) | per_pass (window of record_window steps)
    record_window: int = 1000
    rebalance_interval: int = 0  # forward steps between live rebalances (0: only on request)


@dataclass(frozen=True)
class AttentionConfig:
    # auto: triton on CUDA; on CPU the cpu backend where model.cpu_kernels built, else torch.
    # triton also runs on CPU under TRITON_INTERPRET=1 (float32; for tests)
    backend: str = "auto"
    # DeepSeek MLA: the form attention runs in (docs/mla.md). absorbed: every step over the
    # latent (MQA over [R + r] channels; decode's form) | mha: prefill/extend steps decompress
    # K/V from the latent cache by chunks and attend per head (prefill's form); decode steps
    # stay absorbed | auto: mha for steps of at least mla_mha_min_tokens new tokens where its
    # FLOP count is the lower
    mla_form: str = "auto"
    mla_mha_min_tokens: int = 256  # auto's crossover in tokens per step (bench.mla_forms)
    # KV positions decompressed at once by the MHA form (all requests of the step together):
    # bounds its K/V buffer, [chunk, heads, nope + v], whatever the prompt length
    mla_mha_chunk_tokens: int = 8192
    # query rows per program of the Triton extend (prefill) attention for keys of <= 128
    # channels: 64 | 128 (fewer K/V re-reads per FLOP, two warpgroups); None: the kernel's
    # default (64). MLA's absorbed latent keeps 32 (kernels/triton/attention_extend.py)
    extend_block_m: int | None = None
    # prefill and MIXED steps whose fresh requests (no cached prefix) hold at least this many
    # new tokens attend those requests with torch's scaled_dot_product_attention, one call
    # each, and run eager (attention/sdpa_prefill.py); the step's other requests keep the
    # Triton kernel. None: never. Triton backend, non-MLA models only. 4096: Qwen3-30B-A3B's
    # 4096-token prefill +14% and 8192-token +25% on an H100 (eager and cuDNN against the graph
    # and Triton; docs/gpu_decode.md); smaller steps keep their extend graphs
    sdpa_prefill_min_tokens: int | None = 4096
    # the SDPA kernel those steps use: auto (cuDNN, then FlashAttention, then the rest) | flash |
    # cudnn | efficient
    sdpa_prefill_backend: str = "auto"


@dataclass(frozen=True)
class MoEConfig:
    # routed-expert GEMMs. auto: triton (fused MoE kernels) on CUDA, torch elsewhere; triton also
    # runs on CPU under TRITON_INTERPRET=1 (float32; for tests)
    backend: str = "auto"
    # folder of tuned fused-MoE launch configs (JSON, from `python -m moeserve.tools.tune_moe`);
    # None: the ones shipped in moeserve/kernels/triton/moe_configs/
    config_dir: str | None = None


@dataclass(frozen=True)
class CudaGraphConfig:
    """Decode steps replayed from CUDA graphs captured at start-up, one per batch-size bucket;
    extend (prefill and MIXED) steps from graphs per token-count bucket."""

    enabled: bool | None = None  # None: on CUDA devices; true with device=cpu is refused
    max_bs: int = 256  # largest captured batch; larger decode batches run eager
    # largest captured extend step in tokens; None: scheduler.chunked_prefill_size; 0: extend
    # steps run eager. Longer steps, TBO steps and DP/EP deployments run eager.
    max_extend_tokens: int | None = None


@dataclass(frozen=True)
class TBOConfig:
    """Two-batch overlap (moeserve/tbo/): each step of a MoE model under expert parallelism runs
    as two micro-batches whose dispatch/combine hides behind the other's compute. With a dense
    model or ep_size=1 it is a no-op (logged)."""

    enabled: bool = False
    # a step splits when some rank has at least this many tokens (1: every step with a token)
    min_tokens: int = 32


# Decode batch sizes above which speculation costs more than it gains, measured (docs/spec_mtp.md):
# CPU, SmolLM2-135M with a trained head (bench.spec_accept, 2 cores, bf16): N=1..3 paid 1.25-1.43x
# at 2 requests in flight, N=3 lost (0.86x) at 4 and every N at 8; one H200, Llama-3-8B shape,
# N=3 at accept length 2.0 (bench.spec_step): a round paid 1.29x at batch 16 and lost at 64.
SPEC_STEP_ASIDE = {"cpu": 2, "cuda": 32}


@dataclass(frozen=True)
class SpecConfig:
    """MTP (NextN) speculative decoding (moeserve/spec_mtp/): a one-layer draft proposes
    `num_steps` tokens, the target verifies them in one pass; outputs are those of plain decoding."""

    algorithm: str = "none"  # none | nextn
    num_steps: int = 3  # draft steps: the chain's length, or the tree's depth
    # 1: a chain; k > 1: a draft tree of depth num_steps, ranks < k at each node (spec_mtp/tree.py)
    topk: int = 1
    # with topk > 1: tokens a verify step scores per request (the last token + the tree's nodes,
    # as SGLang's speculative_num_draft_tokens): a pruned tree of the num_draft_tokens - 1 rank
    # paths the draft head's eval found most often right; 0: the full k-ary tree
    num_draft_tokens: int = 0
    # a trained NextN head (python -m moeserve.spec_mtp.training) instead of the checkpoint's
    # MTP layer
    draft_path: str | None = None
    # decode batches larger than this run plain decode steps (the draft keeps up with one token);
    # 0: always speculate; None: the size measured for the device (SPEC_STEP_ASIDE)
    max_batch_size: int | None = None
    # decode batches smaller than this run plain steps too: a MoE target's verify reads the
    # experts of every drafted token, several times a small plain step's expert bytes (one H100,
    # Qwen3-30B-A3B: 0.77x at batch 1, 1.61x at 64; docs/spec_mtp.md); 0: from batch 1
    min_batch_size: int = 0

    @property
    def draft_nodes(self) -> int:
        """Draft tokens a verify step scores per request: num_steps, or the tree's nodes."""
        if self.topk > 1 and self.num_draft_tokens:
            return self.num_draft_tokens - 1
        return sum(self.topk ** d for d in range(1, self.num_steps + 1))

    @property
    def verify_width(self) -> int:
        """New positions per request in a verify step: the last token and the drafts."""
        return self.draft_nodes + 1

    def speculates(self, batch: int, device: str) -> bool:
        """Whether a decode batch of `batch` requests verifies drafts (else: plain steps)."""
        top = self.step_aside_above(device)
        return batch >= self.min_batch_size and not (top and batch > top)

    def step_aside_above(self, device: str) -> int:
        """max_batch_size resolved for a "cpu" or "cuda" rank (0: never step aside)."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        return SPEC_STEP_ASIDE.get(device, 0)


@dataclass(frozen=True)
class MoeserveConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    tbo: TBOConfig = field(default_factory=TBOConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    device: str = "auto"
    seed: int = 0
