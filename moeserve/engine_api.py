"""Offline Engine: the real Scheduler with in-process I/O (no HTTP, no extra processes)."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from moeserve.config import compose
from moeserve.core import SamplingParams
from moeserve.ipc.messages import AbortReq, ControlReq, GenerateReq, TokenOutput


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


class Engine:
    """`Engine(model_path=None, overrides=[...])`; model_path None serves the embedded SmolLM2.

    Overrides are Hydra override strings, e.g. "model.dtype=float32", "device=cpu". Requests are
    continuously batched by the same Scheduler the server uses.
    """

    def __init__(self, model_path: str | None = None, overrides: list[str] | tuple = ()):
        from moeserve.scheduler.setup import build_scheduler

        overrides = list(overrides)
        if model_path is not None:
            overrides.append(f"model.path={quote_override(model_path)}")
        self.config = compose(overrides)
        self.io = InProcessIO()
        self.scheduler, self.tokenizer = build_scheduler(self.config, self.io)
        self.runner = self.scheduler.runner
        self._rid = itertools.count()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt ending with the assistant turn's opening."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def generate(self, prompts: list[str] | str | None = None,
                 input_ids: list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None) -> list[dict[str, Any]]:
        """One result per prompt: {"text", "output_ids", "meta": {prompt_tokens, completion_tokens,
        cached_tokens, finish_reason}}. Exactly one of prompts / input_ids."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts or input_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = input_ids if input_ids is not None else [
            self.tokenizer(p)["input_ids"] for p in prompts]
        params = self._params(sampling_params, len(ids))
        if any(not x for x in ids):
            raise ValueError("empty prompt")
        rids = [f"engine-{next(self._rid)}" for _ in ids]
        for rid, x, p in zip(rids, ids, params):
            self.io.inbox.append(GenerateReq(rid=rid, input_ids=list(x), sampling=p))
        self.scheduler.run_forever(should_stop=lambda: all(self._done(r) for r in rids))
        return [self._result(rid) for rid in rids]

    def _done(self, rid: str) -> bool:
        outs = self.io.outputs.get(rid)
        return bool(outs) and outs[-1].finish_reason is not None

    @staticmethod
    def _params(sampling_params: dict | list[dict] | None, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            return [SamplingParams.from_dict(d) for d in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n

    def _result(self, rid: str) -> dict[str, Any]:
        outs = self.io.outputs.pop(rid)
        last = outs[-1]
        if last.error:
            raise ValueError(last.error)
        output_ids = [t for o in outs for t in o.new_ids]
        text = self._decode(output_ids)
        if isinstance(last.finish_matched, str) and last.finish_matched in text:
            text = text[: text.index(last.finish_matched)]  # OpenAI: the stop string is excluded
        return {"text": text, "output_ids": output_ids,
                "meta": {"prompt_tokens": last.prompt_tokens,
                         "completion_tokens": last.completion_tokens,
                         "cached_tokens": last.cached_tokens,
                         "finish_reason": "length" if last.finish_reason == "length" else "stop"}}

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.worker.shutdown()
            self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
_quote = quote_override  # older name
