"""Offline Engine: the real Scheduler with in-process I/O (one rank), or the DP controller and
scheduler processes driven over ZMQ (several ranks, `engine_client.py`)."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from moeserve.config import MoeserveConfig, compose
from moeserve.core import SamplingParams, spec_meta
from moeserve.ipc.messages import AbortReq, ControlReply, ControlReq, GenerateReq, TokenOutput


def quote_override(value: str) -> str:
    """Quote a value for a Hydra override (paths may hold characters the grammar reserves)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class InProcessIO:
    """SchedulerIO over Python lists: the Engine pushes requests and collects token outputs."""

    def __init__(self) -> None:
        self.inbox: deque = deque()
        self.outputs: dict[str, list[TokenOutput]] = {}
        self.control_replies: list[tuple[ControlReq, bool, dict]] = []

    def recv(self, timeout_ms: int) -> list[GenerateReq | AbortReq | ControlReq]:
        msgs = list(self.inbox)
        self.inbox.clear()
        return msgs

    def send_outputs(self, outputs: list[TokenOutput], stop_strings: dict) -> None:
        for o in outputs:
            self.outputs.setdefault(o.rid, []).append(o)

    def send_control(self, req: ControlReq, ok: bool, data: dict) -> None:
        self.control_replies.append((req, ok, data))


class InProcessCore:
    """One rank in this process: the real Scheduler over InProcessIO."""

    def __init__(self, cfg: MoeserveConfig):
        from moeserve.scheduler.setup import build_scheduler
        from moeserve.tokenizer.loading import loaded

        self.io = InProcessIO()
        self.scheduler, tokenizer = build_scheduler(cfg, self.io)
        self.tokenizer = loaded(tokenizer)  # the Engine tokenizes and renders chats

    def run(self, reqs: list[GenerateReq]) -> dict[str, list[TokenOutput]]:
        self.io.inbox.extend(reqs)
        self.scheduler.run_forever(should_stop=lambda: all(self._done(r.rid) for r in reqs))
        return {r.rid: self.io.outputs.pop(r.rid) for r in reqs}

    def _done(self, rid: str) -> bool:
        outs = self.io.outputs.get(rid)
        return bool(outs) and outs[-1].finish_reason is not None

    def control(self, op: str, args: dict | None = None) -> list[ControlReply]:
        self.scheduler.control(ControlReq(cid=0, op=op, args=args or {}))
        _, ok, data = self.io.control_replies.pop()
        return [ControlReply(cid=0, rank=0, ok=ok, data=data)]

    def shutdown(self) -> None:
        from moeserve.scheduler.shutdown import release_rank

        release_rank(self.scheduler)


class Engine:
    """`Engine(model_path=None, overrides=[...])`; model_path None serves the embedded SmolLM2.

    Overrides are Hydra override strings, e.g. "model.dtype=float32", "device=cpu". Requests are
    continuously batched by the same Scheduler the server uses: in this process with one rank,
    in a DP controller and one scheduler process per rank when parallel.tp_size > 1.
    """

    def __init__(self, model_path: str | None = None, overrides: list[str] | tuple = ()):
        overrides = list(overrides)
        if model_path is not None:
            overrides.append(f"model.path={quote_override(model_path)}")
        self.config = compose(overrides)
        self._core: Any = None
        if self.config.parallel.world_size > 1:
            self._core = _multi_rank_core(self.config)
        else:
            self._core = InProcessCore(self.config)
        self.tokenizer = self._core.tokenizer
        self._rid = itertools.count()

    @property
    def scheduler(self):
        """The in-process Scheduler (single-rank engines only)."""
        scheduler = getattr(self._core, "scheduler", None)
        if scheduler is None:
            raise AttributeError("engine.scheduler exists only for a running single-rank engine")
        return scheduler

    @property
    def runner(self):
        return self.scheduler.runner

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt ending with the assistant turn's opening."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def generate(self, prompts: list[str] | str | None = None,
                 input_ids: list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 dp_ranks: list[int | None] | None = None,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0) -> list[dict[str, Any]]:
        """One result per prompt: {"text", "output_ids", "meta": {prompt_tokens, completion_tokens,
        cached_tokens, finish_reason}}. Exactly one of prompts / input_ids. `dp_ranks` pins
        prompts to data-parallel ranks (multi-rank engines). `return_logprob`: meta also holds
        "output_logprobs", each output token's logprob under the raw distribution.
        `logprob_start_len` >= 0: meta also holds "input_logprobs", the prompt tokens' logprobs
        from that position on (None at position 0), and with `top_logprobs_num`,
        "input_top_logprobs" ((id, logprob) pairs per position)."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts or input_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = input_ids if input_ids is not None else [
            self.tokenizer(p)["input_ids"] for p in prompts]
        params = self._params(sampling_params, len(ids))
        if any(not x for x in ids):
            raise ValueError("empty prompt")
        pins = dp_ranks if dp_ranks is not None else [None] * len(ids)
        reqs = [GenerateReq(rid=f"engine-{next(self._rid)}", input_ids=list(x), sampling=p,
                            dp_rank=pin, return_logprob=return_logprob,
                            top_logprobs_num=top_logprobs_num,
                            logprob_start_len=logprob_start_len,
                            input_top_logprobs_num=top_logprobs_num)
                for x, p, pin in zip(ids, params, pins, strict=True)]
        outputs = self._core.run(reqs)
        return [self._result(outputs[r.rid]) for r in reqs]

    def server_info(self) -> list[dict[str, Any]]:
        """Per-rank load and counters ({"rank", "running", "waiting", "used_tokens", ...})."""
        return [{"rank": r.rank, **r.data} for r in self._core.control("server_info")]

    def control(self, op: str, args: dict | None = None) -> list[dict[str, Any]]:
        """A control op on every rank (the server's: expert_record_start / _stop / _dump,
        flush_cache, ...): one {"rank", "ok", **reply} per rank, by rank."""
        return [{"rank": r.rank, "ok": r.ok, **r.data} for r in self._core.control(op, args)]

    @staticmethod
    def _params(sampling_params: dict | list[dict] | None, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            return [SamplingParams.from_dict(d) for d in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n

    def _result(self, outs: list[TokenOutput]) -> dict[str, Any]:
        last = outs[-1]
        if last.error:
            raise ValueError(last.error)
        output_ids = [t for o in outs for t in o.new_ids]
        text = self._decode(output_ids)
        if isinstance(last.finish_matched, str) and last.finish_matched in text:
            text = text[: text.index(last.finish_matched)]  # OpenAI: the stop string is excluded
        meta = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "cached_tokens": last.cached_tokens,
                "finish_reason": "length" if last.finish_reason == "length" else "stop"}
        if any(o.logprobs is not None for o in outs):
            meta["output_logprobs"] = [lp for o in outs for lp in (o.logprobs or [])]
        prompt = next((o for o in outs if o.input_logprobs is not None), None)
        if prompt is not None:
            meta["input_logprobs"] = prompt.input_logprobs
            if prompt.input_top_logprobs is not None:
                meta["input_top_logprobs"] = prompt.input_top_logprobs
        if last.spec_verify_steps:
            meta.update(spec_meta(last.spec_verify_steps, last.spec_draft_tokens,
                                  last.spec_accepted_tokens))
        return {"text": text, "output_ids": output_ids, "meta": meta}

    def shutdown(self) -> None:
        if self._core is not None:
            self._core.shutdown()
            self._core = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _multi_rank_core(cfg: MoeserveConfig):
    from moeserve.engine_client import MultiRankCore
    from moeserve.scheduler.setup import resolve_model_path
    from moeserve.tokenizer.loading import load_tokenizer

    path = resolve_model_path(cfg)
    return MultiRankCore(cfg, path, load_tokenizer(path))
