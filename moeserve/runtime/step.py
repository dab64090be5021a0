"""ForwardInput / ForwardOutput: the host-side description of one step and what it produced.

Shared by the scheduler (which builds inputs and reads outputs) and the runtime pieces that run a
step (scheduler/worker.py, spec_mtp/decoder.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from moeserve.core import ForwardMode, SamplingParams
from moeserve.runtime.prompt_logprobs import PromptSpan, SpanScores


@dataclass
class ForwardInput:
    """Host-side description of one step; `prefix_lens[i]` is where request i's new tokens start."""

    mode: ForwardMode
    rows: list[int]  # req_pool_idx per request
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # [T] slots for the new tokens
    new_token_ids: list[int] | None  # EXTEND/MIXED: the prefills' new ids; decodes: in the table
    sampling: list[SamplingParams]
    generators: list[torch.Generator | None]
    top_logprobs_nums: list[int]  # -1: no logprobs for this request
    return_all_logits: bool = False
    global_mode: ForwardMode | None = None  # set after the DP sync
    global_num_tokens: list[int] | None = None  # every rank's token count, from the DP sync
    tbo: bool = False  # two micro-batches (the DP sync's agreed answer)
    prompt_lens: list[int] = field(default_factory=list)  # penalties: where generated ids start
    # EXTEND, penalised requests: (row, ids of positions [0, prefix_len)), since a prefix served
    # from the radix cache left those positions of the token table stale
    history: list[tuple[int, list[int]]] = field(default_factory=list)
    grammars: list = field(default_factory=list)  # GrammarMatch | None per request, or empty
    global_modes: list[int] | None = None  # every rank's mode value (DP sync; 0: no batch)
    # speculative decoding, EXTEND: the token after each request's chunk (the draft's input at the
    # chunk's last position), -1 where the chunk completes the prompt (the sampled token is)
    next_prompt_ids: list[int] = field(default_factory=list)
    # EXTEND/MIXED: prompt positions scored for prompt logprobs (runtime/prompt_logprobs.py)
    prompt_spans: list[PromptSpan] = field(default_factory=list)

    def greedy_only(self) -> bool:
        """Only greedy next tokens are needed (no sampling, logprobs, edits, grammars or returned
        logits)."""
        return (not self.return_all_logits and all(n < 0 for n in self.top_logprobs_nums)
                and not any(self.grammars)
                and all(p.is_greedy and not p.edits_logits for p in self.sampling))

    @classmethod
    def idle(cls) -> ForwardInput:
        """Zero tokens: joins every collective of a forward that other ranks run."""
        return cls(ForwardMode.IDLE, [], [], [], torch.empty(0, dtype=torch.int64), [], [], [],
                   [])


@dataclass
class ForwardOutput:
    next_token_ids: list[int]  # [B]; filled by `resolved()` while `pending`
    logprobs: list[float] | None = None  # of the sampled tokens (raw distribution)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    logits: torch.Tensor | None = None  # only with return_all_logits
    # TARGET_VERIFY: each request's accepted drafts + the target's token (1..num_steps+1), with
    # logprobs per token where asked
    spec_tokens: list[list[int]] | None = None
    spec_logprobs: list[list[float]] | None = None
    spec_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # a draft tree's accepted nodes per request (heap indices, spec_mtp/tree.py): their KV slots
    spec_paths: list[list[int]] | None = None
    # the sampled ids still on their way to the host (host_copy.PendingHost): the worker is free
    # to launch the next step before this one's tokens are read
    pending: object | None = None
    # a Future done once the grammar matchers have accepted this step's tokens (on the
    # grammar_steps helper thread); the scheduler reads a matcher's done_at only after it
    grammar_accepted: Future | None = None
    prompt_scores: list[SpanScores] | None = None  # one per ForwardInput.prompt_spans entry

    def resolved(self) -> ForwardOutput:
        """This output with next_token_ids on the host (waits for the step's copy) and its
        tokens accepted by the requests' grammars."""
        if self.pending is not None:
            self.next_token_ids, self.pending = self.pending.wait(), None
        if self.grammar_accepted is not None:
            self.grammar_accepted.result()
            self.grammar_accepted = None
        return self
