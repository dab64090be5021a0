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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # normalise before use; still frozen
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
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


@dataclass
class Req:
    """All state of one request on a scheduler rank."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens whose KV is written (slots owned through req_to_token[req_pool_idx])
    finish: FinishReason | None = None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None
