"""A colocated server under a closed-loop benchmark, simulated step by step: what
`bench.serving --max-concurrency C --num-prompts N` measures (output tok/s, median TTFT and ITL),
from the step model.

The scheduler is moeserve's on a GPU: prefill first, each step admitting waiting prompts up to
`chunk` new tokens (a longer prompt is cut), with the running requests riding along one token
each (MIXED steps); with nothing waiting, a decode step. A client sends its next request when
its previous one finishes. Lengths are drawn as the benchmark's random dataset draws them
(uniform in [1, max]).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, replace

from moeserve.planner.arch import ModelShape
from moeserve.planner.costs import CostModel
from moeserve.planner.deploy import Role
from moeserve.planner.step import StepInput, step


@dataclass(frozen=True)
class ServingRun:
    requests: int = 512
    concurrency: int = 256
    input_max: int = 256
    output_max: int = 128
    chunk: int = 2048
    seed: int = 0


@dataclass(frozen=True)
class ServingResult:
    output_tok_s: float
    ttft_ms: float  # median
    itl_ms: float  # median
    mean_decode_batch: float
    steps: int


@dataclass
class _Req:
    prompt: int
    output: int
    sent: float
    done_prompt: int = 0
    made: int = 0
    last: float = 0.0


def step_ms(s: ModelShape, c: CostModel, role: Role, dtype: str, prompt_tokens: int,
            prompts: int, riders: int, context: float) -> float:
    """One step: `prompt_tokens` new tokens of `prompts` prompts plus `riders` decodes."""
    if prompt_tokens == 0:
        x = StepInput("decode", riders, riders, context, logits=riders)
        return step(s, c, role, x, dtype).total_us / 1e3
    new = prompt_tokens / max(prompts, 1)
    x = StepInput("prefill", prompt_tokens + riders, prompts, 0.0, new=new,
                  logits=prompts + riders)
    us = step(s, c, role, x, dtype).total_us
    if riders:  # the prefill step priced the prompts' attention; add the riders'
        us += c.attn_decode(s, riders, context).us * s.layers
    return us / 1e3


def simulate(s: ModelShape, c: CostModel, role: Role, dtype: str, run: ServingRun
             ) -> ServingResult:
    rng = random.Random(run.seed)
    lengths = [(rng.randint(1, run.input_max), rng.randint(1, run.output_max))
               for _ in range(run.requests)]
    graphs = replace(role, graphs=True)  # one GPU: decode and extend steps replay graphs
    now, nxt = 0.0, 0
    waiting: list[_Req] = []
    running: list[_Req] = []
    ttft, gaps, batches, steps, out_tokens = [], [], [], 0, 0
    for _ in range(min(run.concurrency, run.requests)):
        waiting.append(_Req(*lengths[nxt], now))
        nxt += 1
    while waiting or running:
        budget, chunk, admitted = run.chunk, [], 0
        for r in waiting:
            if budget <= 0:
                break
            take = min(r.prompt - r.done_prompt, budget)
            chunk.append((r, take))
            budget -= take
            admitted += take
        riders = len(running)
        ctx = statistics.fmean([r.prompt + r.made for r in running]) if running else 0.0
        now += step_ms(s, c, graphs, dtype, admitted, len(chunk), riders, ctx)
        steps += 1
        batches.append(riders)
        finished = []
        for r in running:  # each rider makes one token
            r.made += 1
            out_tokens += 1
            gaps.append(now - r.last)
            r.last = now
            if r.made >= r.output:
                finished.append(r)
        for r, take in chunk:
            r.done_prompt += take
            if r.done_prompt == r.prompt:  # prefill done: its first token
                waiting.remove(r)
                r.made, r.last = 1, now
                out_tokens += 1
                ttft.append(now - r.sent)
                (finished if r.made >= r.output else running).append(r)
        for r in finished:
            if r in running:
                running.remove(r)
            if nxt < run.requests:  # the client sends its next request
                waiting.append(_Req(*lengths[nxt], now))
                nxt += 1
    return ServingResult(out_tokens / now * 1e3, statistics.median(ttft),
                         statistics.median(gaps) if gaps else 0.0,
                         statistics.fmean(batches), steps)
