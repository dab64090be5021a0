"""Workloads of the multi-rank tests and their single-process reference outputs' inputs: shared by
test_dp, test_tbo_dp, test_spec_dp (the reference fixture in conftest.py computes each model's
outputs once per session, the HTTP tests' chat texts included)."""

from __future__ import annotations

import random

DP2 = ["parallel.tp_size=2", "parallel.dp_size=2"]
DP4 = ["parallel.tp_size=4", "parallel.dp_size=4"]
GREEDY = {"temperature": 0, "ignore_eos": True}


def workload(seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """8 prompts: shared prefixes (one long, one short), lengths 3..70, max_new_tokens 1..20."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 3000) for _ in range(40)]
    prompts = []
    for i in range(8):
        own = [rng.randrange(100, 3000) for _ in range(rng.randrange(3, 30))]
        prompts.append(own if i % 4 == 3 else (system if i % 2 == 0 else system[:20]) + own)
    lens = [1, 20, 5, 12, 3, 17, 8, 2]
    return prompts, [{**GREEDY, "max_new_tokens": n} for n in lens]


def skew_long_short(seed: int = 1) -> tuple[list[list[int]], list[dict], list[int]]:
    """One long prompt on rank 0 (many prefill chunks) while three short ones decode on rank 1."""
    rng = random.Random(seed)
    long = [rng.randrange(100, 3000) for _ in range(150)]
    short = [[rng.randrange(100, 3000) for _ in range(rng.randrange(2, 6))] for _ in range(3)]
    params = [{**GREEDY, "max_new_tokens": 4}] + [{**GREEDY, "max_new_tokens": 24}] * 3
    return [long] + short, params, [0, 1, 1, 1]


def staggered(seed: int = 2) -> tuple[list[list[int]], list[dict]]:
    """Requests finishing at different steps on both ranks."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 3000) for _ in range(5 + i)] for i in range(6)]
    return prompts, [{**GREEDY, "max_new_tokens": n} for n in (1, 9, 2, 30, 4, 16)]


ONE = ([[11, 12, 13, 14, 15]], [{**GREEDY, "max_new_tokens": 12}])


def constrained(seed: int = 3) -> tuple[list[list[int]], list[dict]]:
    """Structured outputs beside plain requests: a regex that completes, the same regex with a
    stop string inside its reply, a JSON schema and an EBNF grammar (pinned to both ranks by the
    policy's spread over 6 requests)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 3000) for _ in range(4 + i)] for i in range(6)]
    regex = ("regex", "(yes|no), [a-z]{2,8}")
    schema = ("json_schema", '{"type": "object", "properties": {"n": {"type": "integer", '
                             '"minimum": 0, "maximum": 999}}, "required": ["n"]}')
    ebnf = ("ebnf", 'root ::= ("cat" | "dog") " " [0-9]+ "."')
    params = [{"temperature": 0, "max_new_tokens": 20, "grammar": regex},
              {"temperature": 0, "max_new_tokens": 20, "grammar": regex, "stop": [", "]},
              {"temperature": 0, "max_new_tokens": 20, "grammar": schema},
              {"temperature": 0, "max_new_tokens": 20, "grammar": ebnf},
              {**GREEDY, "max_new_tokens": 9}, {**GREEDY, "max_new_tokens": 14}]
    return [prompts[0], prompts[0]] + prompts[2:], params


# the HTTP tests' concurrent chats (test_dp, test_tbo_dp) and their token counts
QUESTIONS = [f"Question {i}: {'tell me something ' * (i % 3 + 1)}" for i in range(8)]
CHAT_LENS = [4 + 3 * (i % 4) for i in range(8)]


def ids_of(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def ep_overrides(backend: str) -> list[str]:
    return [f"parallel.a2a_backend={backend}"]  # ep_size defaults to tp_size: real EP
