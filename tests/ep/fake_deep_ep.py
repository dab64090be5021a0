"""An emulation of DeepEP's `deep_ep.Buffer` API on torch.distributed (gloo), for adapter tests.

Same class and method names, argument names, return tuples and tensor layouts as DeepEP's
documented Python API (README usage and `deep_ep/buffer.py` docstrings), recalled from the docs —
NOT a copy of its code and never compared against the real package. Emulated:
- normal mode: `get_dispatch_layout`, `dispatch` (each token once per destination rank; received
  tokens grouped by source rank; recv_topk_idx holds LOCAL expert indices, -1 elsewhere, with those
  weights 0; `num_recv_tokens_per_expert_list` a Python list), `combine` (sums the copies per
  token; weights are applied by the caller before combine);
- low-latency mode: `low_latency_dispatch` (each (token, expert) pair sent once; packed [E_local,
  max_tokens * ranks, H] + counts [E_local]; with return_recv_hook=True the returned tensors are
  only filled when hook() is called, as on a GPU) and `low_latency_combine` (applies topk_weights);
- `EventOverlap.current_stream_wait()` waits for the async gloo work: tensors read earlier are
  stale;
- `Buffer.capture()` (an EventOverlap of the current stream: nothing to wait for here) and the
  stream options of the normal-mode calls (previous_event, async_finish, allocate_on_comm_stream),
  checked as DeepEP checks them and logged in `Buffer.stream_options` for tests.

Not emulated: FP8 casting (use_fp8 must be False), internode RDMA ranks, cached-handle dispatch,
expert_alignment > 1, CUDA streams/SMs; dtypes are not restricted to bf16 as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Config:
    def __init__(self, num_sms: int = 20, *sizes: int):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 1 << 20

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class EventOverlap:
    """Stands for a CUDA event; here it holds the gloo works that must finish first."""

    def __init__(self, event: Any = None, extra_tensors: Any = None):
        self.event = event if event is not None else []
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        for work in self.event:
            work.wait()
        self.event = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False):
        self.group, self.rank = group, dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.calls: list[str] = []  # for tests: the sequence of public calls
        # for tests: (call, async_finish, previous_event given, allocate_on_comm_stream)
        self.stream_options: list[tuple[str, bool, bool, bool]] = []

    def _options(self, call: str, previous_event: Any, async_finish: bool,
                 allocate_on_comm_stream: bool) -> None:
        if allocate_on_comm_stream:  # DeepEP asserts the same
            assert previous_event is not None and async_finish, \
                "allocate_on_comm_stream needs previous_event and async_finish"
        self.stream_options.append((call, async_finish, previous_event is not None,
                                    allocate_on_comm_stream))

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream; on CPU there is nothing to wait for."""
        return EventOverlap()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * 2 * num_experts

    # ---- normal mode -------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """→ (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank None (intranode),
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)."""
        self.calls.append("get_dispatch_layout")
        self._options("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
        per_rank = num_experts // self.group_size
        valid = topk_idx >= 0
        owner = torch.where(valid, topk_idx // per_rank, self.group_size)
        in_rank = torch.zeros(topk_idx.shape[0], self.group_size + 1, dtype=torch.bool)
        in_rank = in_rank.scatter_(1, owner, True)[:, : self.group_size]
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: torch.Tensor, handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """→ (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)."""
        self.calls.append("dispatch")
        self._options("dispatch", previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None or expert_alignment != 1 or isinstance(x, tuple):
            raise NotImplementedError("fake_deep_ep: cached-handle / aligned / FP8 dispatch")
        e_local = num_tokens_per_expert.numel() // self.group_size
        first = self.rank * e_local
        send_token = is_token_in_rank.t().nonzero()[:, 1]  # [S] grouped by destination rank
        send_counts = is_token_in_rank.sum(0).tolist()
        recv_counts = _exchange(is_token_in_rank.sum(0), self.group)
        n = sum(recv_counts)
        srcs = (x, topk_idx, topk_weights)
        outs = [s.new_empty((n, *s.shape[1:])) for s in srcs]
        works = [dist.all_to_all_single(o, s[send_token].contiguous(), recv_counts, send_counts,
                                        group=self.group, async_op=True)
                 for o, s in zip(outs, srcs)]
        recv_x, recv_idx, recv_w = outs
        # DeepEP's kernels write local indices; emulated on the host once the data has landed.
        event = EventOverlap([*works, _Finish(lambda: _to_local(recv_idx, recv_w, first, e_local))])
        if not async_finish:
            event.current_stream_wait()
        # NOTE: the CPU learns the per-expert counts before returning (DeepEP busy-waits for them).
        per_expert = _exchange_expert_counts(num_tokens_per_expert, self.group, e_local)
        handle = (send_token, send_counts, recv_counts, x.shape[0])
        return recv_x, recv_idx, recv_w, per_expert, handle, event

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: Any = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """x [N_recv, H] → (combined_x [T, H] summed over ranks, combined_topk_weights, event)."""
        self.calls.append("combine")
        self._options("combine", previous_event, async_finish, allocate_on_comm_stream)
        send_token, send_counts, recv_counts, num_tokens = handle
        back = x.new_empty((send_token.numel(), x.shape[1]))
        work = dist.all_to_all_single(back, x.contiguous(), send_counts, recv_counts,
                                      group=self.group, async_op=True)
        combined = x.new_zeros((num_tokens, x.shape[1]))

        def reduce() -> None:
            acc = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
            combined.copy_(acc.index_add_(0, send_token, back.float()))

        event = EventOverlap([work, _Finish(reduce)])
        if not async_finish:
            event.current_stream_wait()
        return combined, None, event

    # ---- low-latency mode --------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self.calls.append("clean_low_latency_buffer")
        dist.barrier(group=self.group)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """→ (recv_x [E_local, M*R, H], recv_count [E_local] int32, handle, event, hook)."""
        self.calls.append("low_latency_dispatch")
        assert self.low_latency_mode, "Buffer was not built with low_latency_mode=True"
        if use_fp8:
            raise NotImplementedError("fake_deep_ep: FP8 low-latency dispatch")
        m, r = num_max_dispatch_tokens_per_rank, self.group_size
        e_local = num_experts // r
        t, hidden = x.shape
        assert t <= m, f"{t} tokens > num_max_dispatch_tokens_per_rank {m}"
        # Send slots [dest rank, local expert, source token]: DeepEP's per-expert receive buffer.
        send = x.new_zeros((r, e_local, m, hidden))
        send_mask = torch.zeros(r, e_local, m, dtype=torch.bool)
        tok, k = (topk_idx >= 0).nonzero(as_tuple=True)
        e = topk_idx[tok, k]
        send[e // e_local, e % e_local, tok] = x[tok]
        send_mask[e // e_local, e % e_local, tok] = True
        recv, recv_mask = torch.empty_like(send), torch.empty_like(send_mask)
        works = [dist.all_to_all_single(recv, send, group=self.group, async_op=True),
                 dist.all_to_all_single(recv_mask, send_mask, group=self.group, async_op=True)]
        recv_x = x.new_zeros((e_local, m * r, hidden))
        recv_count = torch.zeros(e_local, dtype=torch.int32)
        src = torch.full((e_local, m * r), -1, dtype=torch.int64)  # src rank * m + src token

        def unpack() -> None:
            for w in works:
                w.wait()
            for le in range(e_local):
                slots = recv_mask[:, le].flatten().nonzero()[:, 0]  # [n] rank-major, token order
                recv_x[le, : slots.numel()] = recv[:, le].reshape(r * m, hidden)[slots]
                src[le, : slots.numel()] = slots
                recv_count[le] = slots.numel()

        handle = (src, recv_count, m, hidden, num_experts)
        return _ll_return((recv_x, recv_count, handle), unpack, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None):
        """x [E_local, M*R, H] expert outputs → (combined_x [T, H] = sum_k w*out_k, event, hook)."""
        self.calls.append("low_latency_combine")
        src, recv_count, m, hidden, num_experts = handle
        r, e_local = self.group_size, num_experts // self.group_size
        send = x.new_zeros((r * m, e_local, hidden))  # back to [source rank * M + token, expert]
        for le in range(e_local):
            n = int(recv_count[le])
            send[src[le, :n], le] = x[le, :n]
        send = send.view(r, m, e_local, hidden).transpose(1, 2).contiguous()  # [R, E_local, M, H]
        recv = torch.empty_like(send)  # [owner rank, local expert, my token, H] = [E, M, H]
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        t = topk_idx.shape[0]
        combined = out if out is not None else x.new_empty((t, hidden))

        def reduce() -> None:
            work.wait()
            per_expert = recv.view(num_experts, m, hidden)
            picked = per_expert[topk_idx.clamp(min=0), torch.arange(t)[:, None]]  # [T, K, H]
            w = torch.where(topk_idx >= 0, topk_weights.float(), 0.0)
            combined.copy_((picked.float() * w[..., None]).sum(1))

        return _ll_return((combined,), reduce, async_finish, return_recv_hook)


class _Finish:
    """A host step that runs when an EventOverlap is waited, after the works before it."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def wait(self) -> None:
        if self.fn is not None:
            self.fn()
            self.fn = None


def _ll_return(results: tuple, finish: Callable[[], None], async_finish: bool,
               return_recv_hook: bool) -> tuple:
    """Low-latency calls return (*results, event, hook): hook() receives; without one, now."""
    event = EventOverlap([_Finish(finish)] if async_finish and not return_recv_hook else None)
    if return_recv_hook:
        hook = _Finish(finish).wait
    else:
        hook = None
        if not async_finish:
            finish()
    return (*results, event, hook)


def _exchange(send_counts: torch.Tensor, group: Any) -> list[int]:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.tolist()


def _exchange_expert_counts(per_expert: torch.Tensor, group: Any, e_local: int) -> list[int]:
    """num_tokens_per_expert [E] (this rank's tokens) → received tokens per local expert."""
    recv = torch.empty_like(per_expert)
    dist.all_to_all_single(recv, per_expert.contiguous(), group=group)  # [R * E_local]
    return recv.view(-1, e_local).sum(0).tolist()


def _to_local(recv_idx: torch.Tensor, recv_w: torch.Tensor, first: int, e_local: int) -> None:
    """In place: global ids → local index in [0, E_local) or -1; weights of -1 entries → 0."""
    local = (recv_idx >= first) & (recv_idx < first + e_local)
    recv_idx.copy_(torch.where(local, recv_idx - first, -1))
    recv_w.copy_(torch.where(local, recv_w, 0.0))


__all__ = ["Buffer", "Config", "EventOverlap"]
