"""Finish conditions: EOS / stop token ids, stop strings (on the decoded tail), max_new_tokens."""

from __future__ import annotations

from collections.abc import Callable

from moeserve.core import FinishReason, Req

_TAIL_SLACK = 8  # extra tokens decoded beyond the longest stop string


class StopChecker:
    def __init__(self, eos_token_ids: set[int], decode_text: Callable[[list[int]], str]):
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode_text

    def check(self, req: Req) -> FinishReason | None:
        tok, sp = req.output_ids[-1], req.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            return FinishReason("stop", tok)
        if sp.stop:
            tail = self.decode_text(req.output_ids[-(max(map(len, sp.stop)) + _TAIL_SLACK):])
            for s in sp.stop:
                if s in tail:
                    return FinishReason("stop", s)
        if len(req.output_ids) >= sp.max_new_tokens:
            return FinishReason("length")
        return None
