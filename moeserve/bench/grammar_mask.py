"""Grammar engines side by side (issue 18): xgrammar (runtime/grammar.py's) and llguidance, on one
tokenizer and the e2e test's 20 JSON schemas (bench/grammar_schemas.py).

    python -m moeserve.bench.grammar_mask [--tokenizer smollm2|deepseek] [--steps 200]

- compile: cold (schema → a ready matcher), cached (xgrammar: its compiler cache + a new matcher;
  llguidance has no cache: a deep copy of a compiled matcher) and a fresh matcher's first mask;
- per decode step, B matchers in lockstep along valid token sequences (each schema's instance,
  tokenized, + EOS; row i follows schema i mod 20, staggered, restarted when done): filling the
  [B, ceil(V/32)] int32 bitmask the batched way each engine offers (xgrammar
  BatchGrammarMatcher, llguidance fill_next_token_bitmask_par), and accepting one token per row.
Both get the same grammar: separators ", " and ": ", no extra properties (xgrammar's strict_mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from moeserve.bench.grammar_schemas import instance, schemas

LLG_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    if name == "deepseek":
        from moeserve.tools.make_tiny import deepseek_tokenizer_dir

        return AutoTokenizer.from_pretrained(deepseek_tokenizer_dir())
    from moeserve.models.embedded import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


def strict(schema: dict) -> dict:
    """`schema` with additionalProperties: false on every object (xgrammar's strict_mode)."""
    out = {k: strict(v) if k == "items" else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int, threads: int | None = None):
        import xgrammar as xgr

        self.xgr, self.stop = xgr, [tok.eos_token_id]
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab))
        self.batch = xgr.BatchGrammarMatcher(threads or "auto")

    def compile(self, schema: dict, cold: bool = True) -> Any:
        if cold:
            self.compiler.clear_cache()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop)

    def fill(self, matchers: list, bits: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bits)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]

    done = staticmethod(lambda m: m.is_terminated())


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int, threads: int | None = None):
        try:
            import llguidance
            import llguidance.hf
            import llguidance.torch
        except ImportError:
            raise RuntimeError("llguidance is not installed: pip install llguidance") from None
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(threads)
        self._cache: dict[str, Any] = {}  # llguidance has none: what a server would keep

    def compile(self, schema: dict, cold: bool = True) -> Any:
        key = json.dumps(schema)
        if not cold and key in self._cache:
            return self._cache[key]
        grammar = self.llg.LLMatcher.grammar_from_json_schema(strict(schema), defaults=LLG_JSON)
        m = self._cache[key] = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list, bits: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, list(zip(matchers, range(
            len(matchers)))), bits)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return [m.consume_token(t) for m, t in zip(matchers, tokens)]

    done = staticmethod(lambda m: m.is_stopped())


ENGINES = {"xgrammar": Xgrammar, "llguidance": Llguidance}


def sequences(tok: Any, specs: list[dict]) -> list[list[int]]:
    """Per schema: its instance as the grammar formats it (", ", ": "), tokenized, then EOS."""
    return [tok.encode(json.dumps(instance(s)), add_special_tokens=False) + [tok.eos_token_id]
            for s in specs]


def allowed(bits: torch.Tensor, vocab: int) -> np.ndarray:
    """[B, words] int32 bitmask → [B, vocab] bool (bit j of word w: token 32 w + j)."""
    return np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab] == 1


def mask_differences(x: Xgrammar, ll: Llguidance, spec: dict, seq: list[int]) -> dict:
    """Walk one matcher of each engine along `seq`; → the steps where their allowed sets differ,
    per class (docs/structured_outputs.md): xgrammar only, "forced" (a prefix of the forced text;
    llguidance keeps its canonical tokenization) and "raw" (raw control bytes / DEL / tokens
    llguidance calls special, in strings); llguidance only, "escape" (a backslash in a
    length-bounded string); "other": anything else, a real disagreement."""
    vocab = ll.tok.vocab_size
    xm, lm = x.matcher(x.compile(spec, cold=False)), ll.matcher(ll.compile(spec))
    raw = lambda t: ll.tok.decode_bytes([t])  # noqa: E731
    bits = torch.empty((2, (vocab + 31) // 32), dtype=torch.int32)
    out: dict[str, list[int]] = {"forced": [], "raw": [], "escape": [], "other": []}
    for step, t in enumerate(seq):
        forced = lm.compute_ff_bytes()
        x.fill([xm], bits[:1]), ll.fill([lm], bits[1:])
        ok = allowed(bits, vocab)
        if not (ok[0, t] and ok[1, t]):
            out["other"].append(step)  # the valid sequence's own token must be allowed
        x_only = np.flatnonzero(ok[0] & ~ok[1]).tolist()
        l_only = np.flatnonzero(ok[1] & ~ok[0]).tolist()
        kinds = {"forced" if forced.startswith(raw(u)) else "raw"
                 if ll.tok.is_special_token(u) or any(c < 0x20 or c == 0x7F for c in raw(u))
                 else "other" for u in x_only}
        kinds |= {"escape" if b"\\" in raw(u) else "other" for u in l_only}
        for k in kinds:
            out[k].append(step)
        if not (x.accept([xm], [t])[0] and ll.accept([lm], [t])[0]):
            raise AssertionError(f"token {t} at step {step} rejected")
    if not (x.done(xm) and ll.done(lm)):
        raise AssertionError("a matcher did not complete at the end of the sequence")
    return out


def _us(ns: list[int]) -> tuple[float, float]:
    """Mean and p99 in µs."""
    us = sorted(n / 1e3 for n in ns)
    return statistics.fmean(us), us[min(len(us) - 1, int(0.99 * len(us)))]


def time_compile(engine: Any, specs: list[dict], vocab: int) -> dict[str, float]:
    """Mean cold and cached compile (ms) and first-mask (µs) over the schemas."""
    cold, cached, first = [], [], []
    bits = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    for s in specs:
        t0 = time.perf_counter_ns()
        m = engine.matcher(engine.compile(s, cold=True))
        t1 = time.perf_counter_ns()
        engine.fill([m], bits)
        t2 = time.perf_counter_ns()
        engine.matcher(engine.compile(s, cold=False))
        cold.append(t1 - t0), first.append(t2 - t1), cached.append(time.perf_counter_ns() - t2)
    return {"cold_ms": statistics.fmean(cold) / 1e6, "cold_max_ms": max(cold) / 1e6,
            "cached_ms": statistics.fmean(cached) / 1e6, "first_mask_us": _us(first)[0]}


def run_steps(engine: Any, compiled: list, seqs: list[list[int]], batch: int, steps: int,
              warmup: int, vocab: int,
              on_step: Callable[[torch.Tensor, list[int]], None] | None = None) -> dict:
    """B matchers in lockstep for warmup + steps steps; → fill/accept mean and p99 (µs/step).
    on_step(bits, tokens) sees each step's bitmask and the tokens about to be accepted."""
    rows = [i % len(seqs) for i in range(batch)]
    ms = [engine.matcher(compiled[r]) for r in rows]
    pos = [0] * batch
    for i in range(batch):  # stagger rows that share a schema
        skip = (i // len(seqs)) * 5 % (len(seqs[rows[i]]) - 1)
        assert all(engine.accept([ms[i]] * skip, seqs[rows[i]][:skip]))
        pos[i] = skip
    bits = torch.empty((batch, (vocab + 31) // 32), dtype=torch.int32)
    fill, acc, done = [], [], 0
    for step in range(warmup + steps):
        tokens = [seqs[r][p] for r, p in zip(rows, pos)]
        t0 = time.perf_counter_ns()
        engine.fill(ms, bits)
        t1 = time.perf_counter_ns()
        if on_step is not None:
            on_step(bits, tokens)
        t2 = time.perf_counter_ns()
        ok = engine.accept(ms, tokens)
        t3 = time.perf_counter_ns()
        if not all(ok):
            raise AssertionError(f"{engine.name} rejected a valid token at step {step}")
        if step >= warmup:
            fill.append(t1 - t0), acc.append(t3 - t2)
        for i, r in enumerate(rows):
            pos[i] += 1
            if pos[i] == len(seqs[r]):
                if not engine.done(ms[i]):
                    raise AssertionError(f"{engine.name}: schema {r} not complete after EOS")
                ms[i], pos[i], done = engine.matcher(compiled[r]), 0, done + 1
    (fm, fp), (am, ap) = _us(fill), _us(acc)
    return {"fill_mean": fm, "fill_p99": fp, "accept_mean": am, "accept_p99": ap,
            "completed": done}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", choices=["smollm2", "deepseek"], default="smollm2")
    p.add_argument("--engines", default="xgrammar,llguidance")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="fill threads (default: engine's)")
    a = p.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(a.tokenizer)
    vocab, specs = len(tok), schemas()
    seqs = sequences(tok, specs)
    print(f"tokenizer {a.tokenizer} (V={vocab}), {len(specs)} schemas, sequences of "
          f"{min(map(len, seqs))}-{max(map(len, seqs))} tokens, {a.steps} steps after "
          f"{a.warmup} warm-up, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    compile_rows, step_rows = [], []
    for name in a.engines.split(","):
        try:
            t0 = time.perf_counter()
            engine = ENGINES[name](tok, vocab, a.threads)
            setup = time.perf_counter() - t0
        except RuntimeError as e:
            print(f"skipping {name}: {e}")
            continue
        c = time_compile(engine, specs, vocab)
        compile_rows.append(f"| {name} | {setup:.2f} | {c['cold_ms']:.1f} | {c['cold_max_ms']:.1f}"
                            f" | {c['cached_ms']:.3f} | {c['first_mask_us']:.0f} |")
        compiled = [engine.compile(s, cold=False) for s in specs]
        for b in map(int, a.batch.split(",")):
            r = run_steps(engine, compiled, seqs, b, a.steps, a.warmup, vocab)
            step_rows.append(f"| {name} | {b} | {r['fill_mean']:.0f} | {r['fill_p99']:.0f} | "
                             f"{r['fill_mean'] / b:.1f} | {r['accept_mean']:.0f} | "
                             f"{r['accept_p99']:.0f} | {r['completed']} |")
    print("\n| engine | tokenizer setup s | compile cold ms (mean) | cold max ms | cached ms |"
          " first mask µs |\n|---|---|---|---|---|---|")
    print("\n".join(compile_rows))
    print("\n| engine | B | fill µs/step mean | fill p99 | fill µs/row | accept µs/step mean |"
          " accept p99 | sequences completed |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(step_rows))


if __name__ == "__main__":
    main()
