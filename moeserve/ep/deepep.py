"""`deepep` backend: an adapter over DeepEP's `deep_ep.Buffer` (NVLink/RDMA kernels).

Written from DeepEP's documented Python API and tested on CPU against the in-repo emulation
`tests/ep/fake_deep_ep.py` (gloo). Against the real package (tag v1.2.1, built from source on the
lent GPUs: scripts/build_deepep.sh) normal mode served a tiny bf16 DeepSeek-V3 on 2xH200
(docs/architecture.md §11); tests/ep/test_deepep_real.py holds this adapter's dispatcher checks
against it (not run yet: `scripts/gpu_check.sh deepep` on 2+ GPUs). The real kernels take bf16
activations only (int64 topk_idx, float32 weights), and the low-latency ones exist for a few hidden
sizes only: `check_supported` refuses other models at start-up, naming the key.

Modes (`parallel.deepep_mode`):
- normal: `get_dispatch_layout` then `dispatch` (each token once per owning rank; standard format)
  and `combine` (sums the weighted partial outputs). DeepEP returns LOCAL expert indices (-1
  elsewhere); the adapter converts them to global ids, our standard-format convention.
- low_latency: `low_latency_dispatch` (each (token, expert) pair; packed [E_local, M*ranks, H] +
  counts) and `low_latency_combine` (applies the top-k weights). At most
  max_dispatch_tokens_per_rank tokens per rank per step; no host sync, CUDA-graph friendly.
- auto: normal for steps with any prefill, low_latency for decode-only steps, from the GLOBAL
  forward mode passed to dispatch (equal on every rank, so every rank picks the same kernels).

Start/wait: normal mode launches with async_finish=True and waits on the returned EventOverlap
(`current_stream_wait`: the stream waits, not the host; the host already waited for the receive
counts inside `dispatch`). Overlapped calls (TBO micro-batches) also pass previous_event (a
`Buffer.capture()` of the compute stream, then the layout's event for the dispatch) and
allocate_on_comm_stream=True, so DeepEP's own communication stream runs the layout, dispatch and
combine kernels while the compute stream goes on with the other micro-batch. Low-latency launches
with return_recv_hook=True: *_start only sends, *_wait calls hook() to receive, so two
micro-batches can overlap without occupying SMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeserve.ep.dispatcher import (
    LOW_LATENCY,
    STANDARD,
    CombineHandle,
    Dispatcher,
    DispatchHandle,
    DispatchOutput,
)

NORMAL = "normal"
MODES = ("auto", NORMAL, LOW_LATENCY)
# DeepEP v1.2.1 compiles its low-latency kernels for these hidden sizes only (SWITCH_HIDDEN in
# csrc/kernels/launch.cuh), and its combine kernels for bf16 only (SWITCH_TYPES).
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)


def check_supported(mode: str, hidden_size: int, dtype: torch.dtype) -> None:
    """Refuse, naming the key, what the real DeepEP kernels would assert on at the first step."""
    if dtype != torch.bfloat16:
        raise ValueError(f"parallel.a2a_backend=deepep: DeepEP moves bfloat16 activations only, "
                         f"this model runs in {dtype}: set model.dtype=bfloat16 or use another "
                         "parallel.a2a_backend")
    if mode != NORMAL and hidden_size not in LOW_LATENCY_HIDDEN_SIZES:
        raise ValueError(f"parallel.deepep_mode={mode}: DeepEP's low-latency kernels exist for "
                         f"hidden sizes {list(LOW_LATENCY_HIDDEN_SIZES)} only, this model's "
                         f"hidden_size is {hidden_size}: set parallel.deepep_mode=normal")


def load_deep_ep(device: torch.device) -> Any:
    """Import `deep_ep`, or explain why parallel.a2a_backend=deepep cannot be used here."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"parallel.a2a_backend=deepep needs CUDA devices (this rank runs on "
                           f"{device}); use parallel.a2a_backend=a2a or allgather")
    try:
        import deep_ep
    except ImportError as e:
        raise RuntimeError("parallel.a2a_backend=deepep: the deep_ep package does not import "
                           f"({e}); install DeepEP or use parallel.a2a_backend=a2a") from e
    return deep_ep


@dataclass
class _DeepEPHandle(DispatchHandle):
    mode: str = NORMAL
    topk_ids: torch.Tensor | None = None  # [T, K] (low-latency combine applies the weights)
    topk_weights: torch.Tensor | None = None
    result: tuple = ()  # what DeepEP returned (valid after the event / hook)
    native: Any = None  # DeepEP's own handle
    done: Any = None  # EventOverlap (normal) or recv hook (low latency)


@dataclass
class _DeepEPCombine(CombineHandle):
    combined: torch.Tensor | None = None
    done: Any = None


class DeepEPDispatcher(Dispatcher):
    """DeepEP Buffer normal + low-latency dispatch/combine; see the module docstring."""

    def __init__(self, mesh, num_experts: int, hidden_size: int, dtype: torch.dtype,
                 mode: str = "auto", max_dispatch_tokens_per_rank: int = 128,
                 deep_ep_module: Any = None):
        super().__init__(mesh, num_experts, hidden_size, dtype)
        if mode not in MODES:
            raise ValueError(f"parallel.deepep_mode={mode!r}: expected one of {MODES}")
        self.mode, self.max_tokens = mode, max_dispatch_tokens_per_rank
        self.deep_ep = deep_ep_module if deep_ep_module is not None else load_deep_ep(mesh.device)
        if deep_ep_module is None:  # the real package (an injected emulation takes any shape)
            check_supported(mode, hidden_size, dtype)
        self.buffer = self._make_buffer()
        self._last_mode: str | None = None

    def _make_buffer(self) -> Any:
        """Sizes from DeepEP's own hints (README recipe); one Buffer serves both modes (auto)."""
        buf_cls, n = self.deep_ep.Buffer, self.mesh.ep_size
        hidden_bytes = self.hidden_size * max(torch.empty(0, dtype=self.dtype).element_size(), 2)
        nvl = rdma = 0
        if self.mode != LOW_LATENCY:
            for cfg in (buf_cls.get_dispatch_config(n), buf_cls.get_combine_config(n)):
                nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, n))
                rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, n))
        if self.mode == NORMAL:
            return buf_cls(self.group, nvl, rdma)
        rdma = max(rdma, buf_cls.get_low_latency_rdma_size_hint(
            self.max_tokens, self.hidden_size, n, self.num_experts))
        # NOTE: DeepEP's low-latency kernels want one QP per local expert.
        return buf_cls(self.group, nvl, rdma, low_latency_mode=True,
                       num_qps_per_rank=self.num_local)

    def step_mode(self, forward_mode: Any) -> str:
        """normal | low_latency for this step (forward_mode: the GLOBAL ForwardMode or None)."""
        if self.mode != "auto":
            return self.mode
        return LOW_LATENCY if forward_mode is not None and forward_mode.is_decode() else NORMAL

    def dispatch_start(self, x, topk_ids, topk_weights, forward_mode=None,
                       tokens_per_rank=None, overlapped=False) -> DispatchHandle:
        mode = self.step_mode(forward_mode)
        ids, w = topk_ids.long(), topk_weights.float()  # DeepEP: int64 topk_idx, float32 weights
        # NOTE: on_side here means "on DeepEP's communication stream" (its own, not self.comm)
        h = _DeepEPHandle(x.shape[0], x.dtype, mode, ids, w, on_side=overlapped)
        if mode == LOW_LATENCY:
            self._start_low_latency(h, x.contiguous())
        else:
            self._start_normal(h, x.contiguous())
        self._last_mode = mode
        return h

    def _after_compute(self, on: bool) -> Any:
        """previous_event for an overlapped normal-mode call: the compute stream's queue so far."""
        return self.buffer.capture() if on else None

    def _start_normal(self, h: _DeepEPHandle, x: torch.Tensor) -> None:
        on = h.on_side
        n_rank, n_rdma, n_expert, in_rank, layout_done = self.buffer.get_dispatch_layout(
            h.topk_ids, self.num_experts, previous_event=self._after_compute(on),
            async_finish=on, allocate_on_comm_stream=on)
        recv_x, recv_idx, recv_w, per_expert, h.native, h.done = self.buffer.dispatch(
            x, topk_idx=h.topk_ids, topk_weights=h.topk_weights, num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert, previous_event=layout_done if on else None,
            async_finish=True, allocate_on_comm_stream=on)
        h.result = (recv_x, recv_idx, recv_w, per_expert)

    def _start_low_latency(self, h: _DeepEPHandle, x: torch.Tensor) -> None:
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"deepep low-latency: {x.shape[0]} tokens on this rank > "
                             f"max_dispatch_tokens_per_rank={self.max_tokens}")
        if self._last_mode == NORMAL:
            # NOTE: normal mode may have used the RDMA buffer the low-latency kernels expect
            # zeroed; every rank switches at the same step (global mode), so this stays collective.
            self.buffer.clean_low_latency_buffer(self.max_tokens, self.hidden_size,
                                                 self.num_experts)
        recv_x, count, h.native, _, h.done = self.buffer.low_latency_dispatch(
            x, h.topk_ids, self.max_tokens, self.num_experts, use_fp8=False, async_finish=False,
            return_recv_hook=True)
        h.result = (recv_x, count)  # [E_local, M*ranks, H], [E_local]

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchOutput:
        assert isinstance(handle, _DeepEPHandle)
        if handle.mode == LOW_LATENCY:
            handle.done()  # receive
            recv_x, count = handle.result
            return DispatchOutput(LOW_LATENCY, recv_x, count, handle)
        handle.done.current_stream_wait()
        recv_x, recv_idx, recv_w, per_expert = handle.result
        ids = torch.where(recv_idx >= 0, recv_idx + self.first_expert, -1)  # local → global ids
        counts = torch.tensor(per_expert, dtype=torch.int64, device=recv_x.device)
        return DispatchOutput(STANDARD, recv_x, counts, handle, ids, recv_w)

    def _combine_start(self, expert_out, handle) -> CombineHandle:
        assert isinstance(handle, _DeepEPHandle)
        ch = _DeepEPCombine(handle.num_tokens, handle.dtype, on_side=handle.on_side)
        if handle.mode == LOW_LATENCY:
            ch.combined, _, ch.done = self.buffer.low_latency_combine(
                expert_out, handle.topk_ids, handle.topk_weights, handle.native,
                async_finish=False, return_recv_hook=True)
        else:
            on = handle.on_side
            ch.combined, _, ch.done = self.buffer.combine(
                expert_out.to(handle.dtype), handle.native, async_finish=True,
                previous_event=self._after_compute(on), allocate_on_comm_stream=on)
        return ch

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _DeepEPCombine) and handle.combined is not None
        if callable(handle.done):
            handle.done()  # low-latency receive hook
        else:
            handle.done.current_stream_wait()
        return handle.combined.to(handle.dtype)  # [T, H]
