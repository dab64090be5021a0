"""The shared vocabulary: sampling parameters, forward modes and finish reasons.

Dependency-free apart from the standard library so every layer (server, runtime, model) can import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill (possibly on top of a cached prefix)
    DECODE = 2  # one new token per request
    MIXED = 3  # extend + decode requests in one batch
    IDLE = 4  # no tokens on this rank; still joins every collective
    TARGET_VERIFY = 5  # speculative verification of draft tokens

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped: 'stop' (eos, stop token or stop string), 'length' or 'abort'."""

    type: str
    matched: int | str | None = None  # the stop token id or stop string that ended it

    def to_openai(self) -> str:
        return "length" if self.type == "length" else "stop"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI: logit -= count × frequency + (count > 0) × presence, over the generated tokens
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # transformers/vLLM: seen (prompt or generated) tokens' logits divided (>0) or multiplied by it
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # structured output: (kind, source), kind json_object | json_schema | regex | ebnf
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # normalise before use; still frozen
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.grammar is not None:
            object.__setattr__(self, "grammar", tuple(self.grammar))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Penalties need the request's token history at every sampling step."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def edits_logits(self) -> bool:
        """The raw logits are not what is sampled (greedy must see the edited ones too)."""
        return self.has_penalties or bool(self.logit_bias)

    def validate(self) -> None:
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias),
             "logit_bias values must be in [-100, 100]"),
            (self.grammar is None or len(self.grammar) == 2, "grammar must be (kind, source)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {unknown}")
        return cls(**d)


def spec_meta(verify_steps: int, draft_tokens: int, accepted_tokens: int) -> dict[str, Any]:
    """A request's speculative-decoding counts; accept length = tokens per verify pass."""
    return {"spec_verify_steps": verify_steps, "spec_draft_tokens": draft_tokens,
            "spec_accepted_tokens": accepted_tokens,
            "spec_accept_length": round(accepted_tokens / max(verify_steps, 1), 3)}


@dataclass
class PromptLogprobs:
    """A request's prompt logprobs: entry j is log p(prompt[start + j] | prompt[: start + j])
    (None for position 0, which has no context), with the top-`top` alternatives and the token's
    rank. Filled by position as prefill chunks finish, so a chunk scored twice (a retracted
    request prefilled again) overwrites instead of appending."""

    start: int  # first prompt position returned
    prompt_len: int
    top: int = 0
    values: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    sent: bool = False

    def __post_init__(self) -> None:
        n = self.prompt_len - self.start
        self.values, self.tops, self.ranks = [None] * n, [None] * n, [None] * n
        self._missing = set(range(max(self.start, 1), self.prompt_len))

    @property
    def done(self) -> bool:
        return not self._missing

    def first_missing(self) -> int:
        """The earliest prompt position still without its logprob (prompt_len when done)."""
        return min(self._missing, default=self.prompt_len)

    def record(self, first: int, values: list[float], ranks: list[int],
               tops: list[list[tuple[int, float]]] | None) -> None:
        """Logprobs of prompt positions first, first + 1, …"""
        for k, v in enumerate(values):
            j = first + k - self.start
            self.values[j], self.ranks[j] = v, ranks[k]
            self.tops[j] = tops[k] if tops else []
            self._missing.discard(first + k)


@dataclass(eq=False)
class Req:
    """All state of one request on a scheduler rank.

    Token bookkeeping (the overlap loop schedules step N+1 before step N's tokens are known):
    - `output_ids`: sampled tokens the scheduler has seen (processed results);
    - `device_len`: tokens whose ids are, or will be once in-flight steps finish, in the device token
      table (prompt + every token a launched step samples);
    - `kv_len`: tokens whose KV is written or being written (slots in req_to_token[req_pool_idx]);
    - `prefix_len`: leading tokens whose KV slots belong to the prefix cache (locked via last_node).
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    kv_slots: list[int] = field(default_factory=list)  # host copy of the row's slots [kv_len]
    device_len: int = 0
    prefix_len: int = 0
    last_node: Any = None  # radix node locked by this request (TYPE: kvcache.radix.TreeNode)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    epoch: int = 0  # bumped on finish/retract/abort so in-flight results for the old state are dropped
    finish: FinishReason | None = None
    sent_len: int = 0  # output_ids already sent to the detokenizer
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: Any = None  # torch.Generator for seeded sampling
    grammar: Any = None  # runtime.grammar.GrammarMatch of a structured-output request
    retractions: int = 0
    spec_verify_steps: int = 0  # speculative decoding: verify passes this request took part in
    spec_accepted_tokens: int = 0  # tokens they produced (accepted drafts + the target's token)
    prompt_logprobs: PromptLogprobs | None = None  # asked for: filled while the prompt prefills

    @property
    def fill_ids(self) -> list[int]:
        """Tokens that must be in the KV cache before the next token can be sampled."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_generated_on_device(self) -> int:
        return self.device_len - len(self.input_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def max_cached_prefix(self) -> int | None:
        """The longest cached prefix admission may reuse: prompt logprobs still to compute need
        the hidden state before each of their tokens, which a cache hit would skip."""
        lp = self.prompt_logprobs
        return None if lp is None or lp.done else lp.first_missing() - 1
