"""Offline Engine: load a model and generate in-process, no HTTP and no extra processes."""

from __future__ import annotations

import itertools
from typing import Any

from moeserve.config import compose
from moeserve.core import Req, SamplingParams


def _quote(value: str) -> str:
    """Quote a value for a Hydra override (paths may hold characters the grammar reserves)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class Engine:
    """`Engine(model_path=None, overrides=[...])`; model_path None serves the embedded SmolLM2.

    Overrides are Hydra override strings, e.g. "model.dtype=float32", "device=cpu".
    """

    def __init__(self, model_path: str | None = None, overrides: list[str] | tuple = ()):
        from transformers import AutoTokenizer

        from moeserve.models.embedded import embedded_model_path
        from moeserve.runtime.generator import StaticBatchGenerator
        from moeserve.runtime.model_runner import ModelRunner

        overrides = list(overrides)
        if model_path is not None:
            overrides.append(f"model.path={_quote(model_path)}")
        self.config = compose(overrides)
        self.model_path = self.config.model.path or embedded_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.runner = ModelRunner(self.config, self.model_path)
        self._generator = StaticBatchGenerator(self.runner, self._eos_ids(), self._decode)
        self._rid = itertools.count()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.runner.hf_config, getattr(self.tokenizer, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt ending with the assistant turn's opening."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def generate(self, prompts: list[str] | str | None = None,
                 input_ids: list[list[int]] | None = None,
                 sampling_params: dict | list[dict] | None = None) -> list[dict[str, Any]]:
        """One result per prompt: {"text", "output_ids", "meta": {prompt_tokens, completion_tokens,
        finish_reason}}. Exactly one of prompts / input_ids."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts or input_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = input_ids if input_ids is not None else [
            self.tokenizer(p)["input_ids"] for p in prompts]
        params = self._params(sampling_params, len(ids))
        reqs = [Req(str(next(self._rid)), list(x), p) for x, p in zip(ids, params)]
        if any(not r.input_ids for r in reqs):
            raise ValueError("empty prompt")
        self._generator.run(reqs)
        return [self._result(r) for r in reqs]

    @staticmethod
    def _params(sampling_params: dict | list[dict] | None, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            return [SamplingParams.from_dict(d) for d in sampling_params]
        return [SamplingParams.from_dict(sampling_params)] * n

    def _result(self, r: Req) -> dict[str, Any]:
        text = self._decode(r.output_ids)
        if r.finish is not None and isinstance(r.finish.matched, str):
            text = text[: text.index(r.finish.matched)]  # OpenAI semantics: stop string excluded
        return {"text": text, "output_ids": list(r.output_ids),
                "meta": {"prompt_tokens": len(r.input_ids), "completion_tokens": len(r.output_ids),
                         "finish_reason": r.finish.to_openai() if r.finish else None}}

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
