"""Build a Scheduler (model runner, tokenizer, EOS ids) for a config; shared by Engine and process."""

from __future__ import annotations

import json
import os

from moeserve.config import MoeserveConfig
from moeserve.distributed import ParallelMesh
from moeserve.runtime.grammar import GrammarCompiler
from moeserve.runtime.model_runner import ModelRunner
from moeserve.scheduler.scheduler import Scheduler, SchedulerIO
from moeserve.tokenizer.loading import LazyTokenizer, declared_eos_id


def resolve_model_path(cfg: MoeserveConfig) -> str:
    if cfg.model.path is not None:
        return cfg.model.path
    from moeserve.models.embedded import embedded_model_path

    return embedded_model_path()


def eos_token_ids(model_path: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, merged."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
        elif value is not None:
            ids.add(int(value))

    add(getattr(hf_config, "eos_token_id", None))
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    declared = declared_eos_id(model_path)  # what the tokenizer says, without loading it
    add(declared if declared is not None else tokenizer.eos_token_id)
    return ids


def build_scheduler(cfg: MoeserveConfig, io: SchedulerIO, mesh: ParallelMesh | None = None):
    """→ (Scheduler, tokenizer) for one rank (single-rank mesh by default); the tokenizer is a
    LazyTokenizer, loaded once stop strings or a grammar need it."""
    path = resolve_model_path(cfg)
    tokenizer = LazyTokenizer(path)
    runner = ModelRunner(cfg, path, mesh)
    eos = eos_token_ids(path, runner.hf_config, tokenizer)

    def decode_text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    grammars = GrammarCompiler(tokenizer, getattr(runner.hf_config, "vocab_size", None)
                               or len(tokenizer))
    return Scheduler(cfg, runner, io, eos, decode_text, runner.mesh, grammars), tokenizer
