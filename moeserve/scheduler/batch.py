"""ScheduledBatch: the requests of one step and what processing its result needs."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.core import ForwardMode, Req
from moeserve.runtime.prompt_logprobs import PromptSpan, span_of
from moeserve.runtime.step import ForwardInput


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    epochs: list[int]  # req.epoch at scheduling time; a mismatch later means "drop this result"
    partial: list[bool]  # EXTEND: the request's prompt is not complete after this chunk
    kv_ends: list[int]  # each request's kv_len once this step has run
    forward_input: ForwardInput

    @classmethod
    def idle(cls) -> ScheduledBatch:
        return cls(ForwardMode.IDLE, [], [], [], [], ForwardInput.idle())

    def record_prompt_scores(self, scores) -> None:
        """A finished step's prompt logprobs (ForwardOutput.prompt_scores) into its requests,
        unless a request finished, aborted or was retracted since (its epoch moved on)."""
        for span, got in zip(self.forward_input.prompt_spans, scores or ()):
            req = self.reqs[span.index]
            if req.epoch == self.epochs[span.index] and req.prompt_logprobs is not None:
                req.prompt_logprobs.record(got.first, got.values, got.ranks, got.tops)

    @property
    def num_tokens(self) -> int:
        return sum(self.forward_input.extend_lens)

    @classmethod
    def build(cls, mode: ForwardMode, reqs: list[Req], extend_lens: list[int], slots,
              partial: list[bool], riders: int = 0) -> ScheduledBatch:
        """Assign the new tokens' slots, advance kv_len/device_len and describe the step.

        MIXED: the last `riders` requests are running decodes riding along with the prefills
        (one token each); their input tokens were sampled on the device and are already in the
        token table (the host may not know them yet), so only the prefills' tokens travel."""
        prefix_lens = [r.kv_len for r in reqs]
        new_ids, history, after, spans = None, [], [], []
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            spans = _prompt_spans(reqs[: len(reqs) - riders], extend_lens)
            fills = list(zip(reqs[: len(reqs) - riders], extend_lens))
            new_ids = [t for r, n in fills for t in r.fill_ids[r.kv_len : r.kv_len + n]]
            history = [(r.req_pool_idx, r.fill_ids[: r.kv_len]) for r, _ in fills
                       if r.kv_len and r.sampling.has_penalties]
            # the token after each chunk (a speculating draft's input there), -1 after a prompt
            after = [r.fill_ids[r.kv_len + n] if r.kv_len + n < len(r.fill_ids) else -1
                     for r, n in fills] + [-1] * riders
        offset, slot_list = 0, slots.tolist()  # one conversion, not one per request
        for r, n, part in zip(reqs, extend_lens, partial):
            r.kv_slots.extend(slot_list[offset : offset + n])
            offset += n
            r.kv_len += n
            if not part:
                r.device_len = r.kv_len + 1  # the token this step samples
        fi = ForwardInput(
            mode=mode, rows=[r.req_pool_idx for r in reqs], prefix_lens=prefix_lens,
            extend_lens=list(extend_lens), out_cache_loc=slots, new_token_ids=new_ids,
            sampling=[r.sampling for r in reqs], generators=[r.generator for r in reqs],
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else -1 for r in reqs],
            prompt_lens=[len(r.input_ids) for r in reqs], history=history,
            grammars=[r.grammar for r in reqs] if any(r.grammar for r in reqs) else [],
            next_prompt_ids=after, prompt_spans=spans)
        return cls(mode, list(reqs), [r.epoch for r in reqs], list(partial),
                   [r.kv_len for r in reqs], fi)


def _prompt_spans(reqs: list[Req], extend_lens: list[int]) -> list[PromptSpan]:
    """The prompt positions this step scores for requests still missing prompt logprobs (called
    before kv_len advances: each chunk starts at its request's kv_len)."""
    spans, row = [], 0
    for i, (r, n) in enumerate(zip(reqs, extend_lens)):
        lp = r.prompt_logprobs
        if lp is not None and not lp.done:
            span = span_of(i, row, r.kv_len, n, r.input_ids, lp.start, lp.top)
            if span is not None:
                spans.append(span)
        row += n
    return spans
