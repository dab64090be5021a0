"""ModelRunner: owns the model, its KV memory and the attention backend; runs one ForwardBatch."""

from __future__ import annotations

import contextlib
import logging

import torch

from moeserve.attention.registry import create_attention_backend
from moeserve.config import MoeserveConfig, loads_mtp_layer
from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.host_copy import to_device
from moeserve.distributed import ParallelMesh, single_rank_mesh
from moeserve.kernels.attach import attach_ops
from moeserve.kernels.cpu.build import load_cpu_kernels
from moeserve.kernels.cpu.ops import CpuKernels, supports
from moeserve.env import env
from moeserve.layers.linear import pack_bf16_linears, pack_linears
from moeserve.layers.moe_parallel import ExpertRecorder
from moeserve.models.loader import WeightLoadError, no_random_init
from moeserve.models.quantization import resolve_quant_plan
from moeserve.models.registry import model_class
from moeserve.runtime.kernel_choice import (attention_backend_name, moe_backend_name, use_pdl,
                                            use_cuda_graphs)
from moeserve.runtime.kv_memory import init_kv_memory, kv_layout
from moeserve.runtime.model_config import (context_length, load_hf_config, resolve_device,
                                           resolve_dtype)
from moeserve.runtime.step_memory import step_activation_bytes
from moeserve.attention.mla_mha import MlaFormPolicy, MlaShape
from moeserve.attention.sdpa_prefill import SdpaPrefillPolicy
from moeserve.runtime.moe_setup import build_moe_parallel, num_logical_experts
from moeserve.runtime.sampler import greedy
from moeserve.tbo.operations import Timeline
from moeserve.tbo.strategy import forward_two_batches, tbo_active

logger = logging.getLogger(__name__)

GREEDY_HEAD_MAX_HIDDEN = 256  # measured: fused greedy head faster up to 256, even at 512
class ModelRunner:
    def __init__(self, cfg: MoeserveConfig, model_path: str, mesh: ParallelMesh | None = None,
                 recorder: ExpertRecorder | None = None):
        self.cfg = cfg
        self.mesh = mesh or single_rank_mesh(resolve_device(cfg.device))
        self.device = self.mesh.device
        self.hf_config = load_hf_config(model_path)
        self.dtype = resolve_dtype(cfg.model.dtype, self.hf_config, self.device,
                                   cfg.model.cpu_kernels)
        self.moe_parallel = build_moe_parallel(
            cfg, self.mesh, self.hf_config, self.dtype,
            moe_backend_name(cfg, self.device, env().triton_interpret), recorder)
        # the ExpertDistributionRecorder this runner made and steps (None: dense, or given one)
        self.recorder = (self.moe_parallel.recorder
                         if recorder is None and num_logical_experts(self.hf_config) else None)
        self.draft = None  # spec_mtp.draft.Draft with spec.algorithm=nextn
        self.draft_graphs = None  # its decode-shaped passes' CUDA graphs (Draft.capture_graphs)
        self.model = self._build_model(model_path)
        self.context_len = context_length(cfg, self.hf_config)
        layout = kv_layout(self.model, self.hf_config, self.draft)
        self.mla_policy = mla_form_policy(cfg, self.hf_config) if layout["kind"] == "mla" \
            else None  # which form MLA attention runs in, per step (attention/mla_mha.py)
        # a verify step reads and writes its width of positions past a request's last token
        spare = cfg.spec.verify_width if self.draft is not None else 0
        self.memory, self.context_len = init_kv_memory(
            cfg, layout, self.context_len, self.dtype, self.device, spare, self._tree_rows(),
            self._step_reserve())
        self.cpu_kernels = self._cpu_kernels()
        if self.cpu_kernels is not None:  # to the modules declaring `cpu_kernels`; bf16
            attach_ops(self.model, "cpu_kernels", self.cpu_kernels)  # linears without oneDNN's
            pack_bf16_linears(self.model, self.cpu_kernels)  # prepack run CpuKernels.linear
        self.pdl = use_pdl(cfg, self.device)  # programmatic dependent launches (triton/pdl.py)
        if self.device.type == "cuda" and hasattr(self.moe_parallel.recorder, "kernel_pdl"):
            self.moe_parallel.recorder.kernel_pdl = self.pdl  # one counting launch a layer
        self.gpu_ops = self._gpu_ops()
        self.attn_backend = self._attention_backend()
        self.sdpa_policy = sdpa_prefill_policy(cfg, self.attn_backend, layout["kind"] == "mla")
        self.greedy_head = self._greedy_head()
        self.extend_graphs = None  # runtime/extend_graph.py: prefill/MIXED steps by token bucket
        self.graph_runner = self._cuda_graphs()
        # two-batch overlap applies (the scheduler votes with it in the DP sync)
        self.tbo_active = tbo_active(cfg.tbo, bool(self.moe_parallel.experts_by_layer),
                                     self.mesh.ep_size)
        prefix = env().tbo_timeline
        self.tbo_timeline = Timeline(self.mesh.rank, f"{prefix}.rank{self.mesh.rank}.jsonl"
                                     ) if prefix else None

    # ---- construction -------------------------------------------------------------------------
    def _build_model(self, path: str) -> torch.nn.Module:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise WeightLoadError(f"{path}/config.json has no 'architectures' entry")
        cls = model_class(archs[0])
        quant = resolve_quant_plan(self.cfg.model, self.hf_config, path, self.device)
        quant.configure(self.moe_parallel)  # FP8 experts are built in FP8
        with _default_dtype(self.dtype), self.device, no_random_init():  # filled below
            model = quant.convert(cls(self.hf_config, **self._model_kwargs(cls)))
        if self.cfg.model.load_format == "dummy":
            _init_dummy(model, self.cfg.seed)
            quant.init_dummy(model, self.cfg.seed)
        else:
            quant.load(model, path)
        for m in model.modules():  # copies derived from the loaded weights (MLAttention's)
            if hasattr(m, "after_load"):
                m.after_load()
        if self.cfg.spec.algorithm != "none":
            from moeserve.spec_mtp.draft import build_draft

            with _default_dtype(self.dtype), self.device:
                self.draft = build_draft(self.cfg, model, self.hf_config)
            logger.info("speculative decoding: NextN draft (%s), %d steps", self.draft.kind,
                        self.cfg.spec.num_steps)
        if self.device.type == "cpu":
            pack_linears(model)  # after loading: the packed copies are taken from loaded weights
        return model.eval()

    def _step_reserve(self) -> int:
        """Bytes the KV pool leaves free on CUDA for the largest step's activations: a prefill
        chunk, or a decode step of every running request (runtime/step_memory.py)."""
        if self.device.type != "cuda":
            return 0
        c = self.cfg
        tokens = max(c.scheduler.chunked_prefill_size, c.cache.max_running_requests)
        return step_activation_bytes(self.hf_config, tokens, c.cache.max_running_requests,
                                     self.dtype, c.attention.mla_mha_chunk_tokens)

    def _tree_rows(self) -> int:
        """Scratch table rows of a draft tree: one per node of every request a verify step may
        hold (spec.max_batch_size, else every running request)."""
        spec = self.cfg.spec
        if self.draft is None or spec.topk == 1:
            return 0
        batch = spec.step_aside_above(self.device.type) or self.cfg.cache.max_running_requests
        return spec.draft_nodes * min(batch, self.cfg.cache.max_running_requests)

    def _cpu_kernels(self) -> CpuKernels | None:
        """The C decode kernels, for a CPU model in float32 or bfloat16 with model.cpu_kernels on;
        None otherwise, or without a C compiler (then torch ops run)."""
        if self.device.type != "cpu" or not self.cfg.model.cpu_kernels or not supports(self.dtype):
            return None
        e = env()
        return load_cpu_kernels(e.cache_dir, e.cc)

    def _greedy_head(self) -> torch.Tensor | None:
        """The LM head packed for `CpuKernels.greedy_head` (bf16, AVX512-BF16, hidden size at most
        GREEDY_HEAD_MAX_HIDDEN, where it beats oneDNN's matmul plus an argmax pass: 129k x 64 at 16
        tokens 2.0 -> 1.2 ms, at 1 token 1.0 -> 0.17 ms); None where the logits are computed."""
        head = getattr(self.model, "lm_head", None)
        k = self.cpu_kernels
        if (k is None or not k.has_bf16_dot or self.dtype != torch.bfloat16 or head is None
                or head.weight.shape[1] > GREEDY_HEAD_MAX_HIDDEN or head.weight.shape[1] % 2
                or head.weight.shape[0] != self.hf_config.vocab_size):
            return None
        return k.pack_greedy_head(head.weight.detach())

    def _attention_backend(self):
        name = attention_backend_name(self.cfg, self.device, self.cpu_kernels is not None,
                                      env().triton_interpret)
        if name == "triton":
            return create_attention_backend(name, pdl=self.pdl,
                                            extend_block_m=self.cfg.attention.extend_block_m)
        return create_attention_backend(name, *([self.cpu_kernels] if name == "cpu" else []))

    def _gpu_ops(self):
        """Triton RMSNorm / q-k norm + rope / router top-k handed to the modules declaring a
        `gpu_ops` attribute, on CUDA with model.gpu_kernels on; None otherwise."""
        if self.device.type != "cuda" or not self.cfg.model.gpu_kernels:
            return None
        from moeserve.kernels.attach import attach_ops
        from moeserve.kernels.triton.ops import TritonOps

        ops = TritonOps(pdl=self.pdl)
        attach_ops(self.model, "gpu_ops", ops)
        return ops

    def _cuda_graphs(self):
        """Decode graphs per batch bucket, captured now (see runtime/cuda_graph.py); None where
        the step runs eager (the log says why)."""
        on, why = use_cuda_graphs(self.cfg, self.device, self.attn_backend.graph_safe,
                                  self.moe_parallel.dispatcher)
        if not on:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off: %s", why)
            return None
        from moeserve.runtime.cuda_graph import CudaGraphRunner

        # a speculative verify step is a decode batch of its width of queries per request
        width = self.cfg.spec.verify_width if self.draft is not None else 1
        graphs = CudaGraphRunner(self, min(self.cfg.cuda_graph.max_bs,
                                           width * self.cfg.cache.max_running_requests))
        self.extend_graphs = self._extend_graphs()
        if self.extend_graphs is not None:  # the largest graphs first, in the shared pool
            self.extend_graphs.capture()
            graphs.pool = self.extend_graphs.pool
        graphs.capture()
        if self.draft is not None:
            self.draft_graphs = self.draft.capture_graphs(self, graphs.max_bs)
        return graphs

    def _extend_graphs(self):
        """Extend-step graphs up to cuda_graph.max_extend_tokens (default: the prefill chunk), on
        one rank with a backend whose extend is graph-safe; None (logged) otherwise."""
        limit = self.cfg.cuda_graph.max_extend_tokens
        limit = self.cfg.scheduler.chunked_prefill_size if limit is None else limit
        why = ("cuda_graph.max_extend_tokens=0" if limit == 0 else
               f"{self.mesh.world_size} ranks (DP/EP collectives)" if self.mesh.distributed else
               "the attention backend's extend is not graph-safe"
               if not getattr(self.attn_backend, "extend_graph_safe", False) else "")
        if why:
            logger.info("extend steps run eager: %s", why)
            return None
        from moeserve.runtime.extend_graph import ExtendGraphRunner

        return ExtendGraphRunner(self, limit, self.cfg.cache.max_running_requests)

    def _model_kwargs(self, cls: type) -> dict:
        kwargs = {"parallel": self.moe_parallel}
        if getattr(cls, "has_mtp", False):
            kwargs["load_mtp"] = loads_mtp_layer(self.cfg)
        return kwargs

    # ---- execution ----------------------------------------------------------------------------
    def make_batch(self, mode: ForwardMode, input_ids: torch.Tensor | list[int],
                   positions: torch.Tensor | list[int], out_cache_loc: torch.Tensor,
                   req_pool_indices: list[int], prefix_lens: list[int], extend_lens: list[int],
                   return_all_logits: bool = False,
                   global_mode: ForwardMode | None = None,
                   global_num_tokens: list[int] | None = None,
                   seq_lens_dev: torch.Tensor | None = None, tbo: bool = False) -> ForwardBatch:
        """The one place a ForwardBatch is built; seq_lens = prefix_lens + extend_lens
        (`seq_lens_dev`: the same, already on the device). Tensor arguments already on the
        device are used as they are (no copy)."""
        dev = self.device
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]

        def ints(x) -> torch.Tensor:
            return to_device(torch.as_tensor(x, dtype=torch.int64), dev)

        return ForwardBatch(
            forward_mode=mode, input_ids=ints(input_ids), positions=ints(positions),
            out_cache_loc=to_device(out_cache_loc, dev).contiguous(), req_pool_indices=ints(req_pool_indices),
            seq_lens=ints(seq_lens) if seq_lens_dev is None else seq_lens_dev,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(extend_lens),
            req_to_token_pool=self.memory.req_to_token, kv_pool=self.memory.pool,
            attn_backend=self.attn_backend, return_all_logits=return_all_logits,
            global_forward_mode=global_mode or mode, global_num_tokens=global_num_tokens,
            tbo=tbo)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, float_logits: bool = True) -> torch.Tensor:
        """→ logits [B, V] for each request's last token, or [T, V] if return_all_logits; float32,
        or with float_logits=False the model dtype: greedy decoding reads those as they are (the
        upcast is exact and keeps the order), which saves writing B×V floats per step (1 ms on a
        CPU core for 16 × 129k)."""
        logits = self._graph_logits(fb)
        if logits is None:
            logits = self.model.compute_logits(self.forward_hidden(fb))
        return logits.float() if float_logits else logits

    @torch.inference_mode()
    def forward_greedy(self, fb: ForwardBatch) -> torch.Tensor:
        """→ the greedy next token of each request [B] (int64): through the fused greedy LM head
        where it applies (`greedy_head`), else the argmax of the model-dtype logits."""
        logits = self._graph_logits(fb)
        if logits is not None:
            return greedy(logits)
        return self.greedy_of_hidden(self.forward_hidden(fb))

    @torch.inference_mode()
    def greedy_of_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy next token [B] of final hidden states [B, H], as forward_greedy picks it
        (the fused greedy LM head where it applies); callers that also keep the hidden states
        (the NextN trainer's data) use it after forward_hidden."""
        if self.greedy_head is not None:
            ids = self.cpu_kernels.greedy_head(hidden, self.greedy_head, self.hf_config.vocab_size)
            if ids is not None:
                return ids
        return greedy(self.model.compute_logits(hidden))  # also where some logit is NaN

    @torch.inference_mode()
    def forward_with_hidden(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-shaped step → (logits [B, V] in the model dtype, final hidden states [B, H]),
        replayed from a CUDA graph where one is captured (speculative decoding's passes)."""
        graphs = self.graph_runner
        bs = graphs.bucket_of_step(fb) if graphs is not None else None
        if bs is not None:
            logits, hidden = graphs.replay(fb, bs, with_hidden=True)
            if self.recorder is not None:
                self.recorder.step()
            return logits, hidden
        hidden = self.forward_hidden(fb)
        return self.model.compute_logits(hidden), hidden

    def _graph_logits(self, fb: ForwardBatch) -> torch.Tensor | None:
        """The step's logits [B, V] from a replayed CUDA graph, or None where it runs eager."""
        graphs = self.graph_runner
        bs = graphs.bucket_of_step(fb) if graphs is not None else None
        if bs is None:
            return None
        logits = graphs.replay(fb, bs)
        if self.recorder is not None:
            self.recorder.step()
        return logits

    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden states that get logits: [B, H] (each request's last token), or [T, H]
        if return_all_logits."""
        if fb.tbo:  # two micro-batches, each with its own attention metadata
            timeline = self.tbo_timeline
            hidden = forward_two_batches(self.model.model, fb, timeline if timeline is not None
                                         and timeline.recording else None)
        else:
            if self.mla_policy is not None and fb.forward_mode in MHA_FORM_MODES and \
                    self.mla_policy.use_mha(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu):
                fb.mla_mha_chunk = self.mla_policy.chunk_tokens  # MHA steps run eager
            if self.sdpa_policy is not None:  # SDPA steps run eager too
                fb.sdpa_prefill = self.sdpa_policy.step(
                    fb.forward_mode, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
            graphs = self.extend_graphs
            bucket = graphs.bucket_of_step(fb) if graphs is not None and not (
                fb.mla_mha_chunk or fb.sdpa_prefill is not None) else None
            if bucket is not None:
                hidden = graphs.run(fb, bucket)  # [T, H], a view of the graph's output
                if fb.return_all_logits:
                    hidden = hidden.clone()  # callers keep it past the next replay
            else:
                self.attn_backend.init_forward_metadata(fb)
                hidden = self.model(fb)
        if self.recorder is not None:
            self.recorder.step()
        if fb.forward_mode.is_decode():
            return hidden[: fb.batch_size]  # one token per request (a view, no index op)
        if not fb.return_all_logits:
            return hidden[fb.last_token_indices()]
        return hidden


# steps MLA may run in the MHA form: prefill chunks and MIXED steps (decode and speculative
# verify steps stay absorbed: one or a few queries per decompressed key)
MHA_FORM_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)


def mla_form_policy(cfg: MoeserveConfig, hf_config) -> MlaFormPolicy:
    a, c = cfg.attention, hf_config
    return MlaFormPolicy(a.mla_form, a.mla_mha_min_tokens, a.mla_mha_chunk_tokens,
                         MlaShape(c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                  c.v_head_dim, c.kv_lora_rank))


def sdpa_prefill_policy(cfg: MoeserveConfig, backend, mla: bool) -> SdpaPrefillPolicy | None:
    """Fresh prefill through SDPA where configured, for the Triton backend's GQA/MHA models."""
    a = cfg.attention
    if a.sdpa_prefill_min_tokens is None or mla or not backend.reads_sdpa_prefill:
        return None
    return SdpaPrefillPolicy(a.sdpa_prefill_min_tokens, a.sdpa_prefill_backend)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights for benchmarking real shapes without a checkpoint (norms stay at 1)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.dtype == torch.float8_e4m3fn:  # QuantPlan.init_dummy fills these
            continue
        if "norm" in name:
            p.data.fill_(1.0)
            continue
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        p.data.normal_(0.0, 0.02, generator=gen)  # on the device: full-size models init fast
