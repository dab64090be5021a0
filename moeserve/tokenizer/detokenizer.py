"""Incremental detokenization with stop-string trimming, and the detokenizer process around it.

Why incremental: decoding each new token alone breaks multi-byte UTF-8 characters split over several
byte-level tokens (emoji, CJK) and loses the spaces that SentencePiece-style decoders attach to the
following token. The prefix-offset / read-offset technique decodes a small window twice (the already
emitted part and the part with the new tokens) and emits only the difference, waiting while the tail
is an incomplete character (U+FFFD). Concatenated deltas equal `tokenizer.decode(all_ids)`.

Stop strings are detected by the scheduler; here the text is cut before the first occurrence
(OpenAI semantics: the stop string and what follows are not returned), and while streaming any tail
that could still become a stop string is held back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from moeserve.ipc.messages import TextOutput, TokenOutput

logger = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"  # what a decoder yields for a partial UTF-8 sequence


@dataclass
class _DecodeState:
    """Decoding window of one request: ids[prefix:read] were emitted, ids[read:] are pending."""

    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    read: int = 0
    text: str = ""  # all decoded text so far (untrimmed)
    sent: int = 0  # characters of `text` already returned to the caller
    count: int = 0  # ids fed so far (stream positions)


class IncrementalDetokenizer:
    """Per-request incremental decoding; one instance serves many requests (keyed by rid)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._states: dict[str, _DecodeState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def add(self, rid: str, stop: Sequence[str] = ()) -> None:
        """Start a request (idempotent: a second add keeps the existing state)."""
        if rid not in self._states:
            self._states[rid] = _DecodeState(stop=tuple(s for s in stop if s))

    def free(self, rid: str) -> None:
        self._states.pop(rid, None)

    def count(self, rid: str) -> int:
        """Token ids fed for `rid` so far (0 when unknown)."""
        st = self._states.get(rid)
        return 0 if st is None else st.count

    def step(self, rid: str, new_ids: Sequence[int], finished: bool = False,
             stop_token: int | None = None) -> str:
        """Feed new ids; returns the text that may be shown now. `finished` flushes everything
        left (cut at a stop string) and frees the state. `stop_token` (a matched stop token id at
        the end of `new_ids`) is not rendered, like an eos."""
        self.add(rid)
        st = self._states[rid]
        ids = list(new_ids)
        st.count += len(ids)
        if finished and stop_token is not None and ids and ids[-1] == stop_token:
            ids.pop()
        st.ids.extend(ids)
        self._advance(st, flush=finished)
        end = self._final_end(st) if finished else self._safe_end(st)
        delta, st.sent = st.text[st.sent:end], max(st.sent, end)
        if finished:
            self.free(rid)
        return delta

    def text_so_far(self, rid: str) -> str:
        """The untrimmed decoded text (for tests and debugging)."""
        return self._states[rid].text

    # ---- decoding -------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, st: _DecodeState, flush: bool) -> None:
        """Append the newly decodable text to st.text and slide the window."""
        if st.read == len(st.ids):
            return
        prefix_text = self._decode(st.ids[st.prefix : st.read])
        full_text = self._decode(st.ids[st.prefix :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_INCOMPLETE) and not flush):
            return  # NOTE: a merge still in progress or an incomplete character; wait for more ids
        st.text += full_text[len(prefix_text) :]
        st.prefix, st.read = st.read, len(st.ids)
        del st.ids[: st.prefix]  # keep only the window: memory stays O(1) per request
        st.read -= st.prefix
        st.prefix = 0

    # ---- stop strings ---------------------------------------------------------------------------
    def _first_stop(self, st: _DecodeState) -> int:
        """Index of the earliest complete stop string in st.text, or len(text) if none."""
        start = max(0, st.sent - max((len(s) for s in st.stop), default=0))
        hits = [i for i in (st.text.find(s, start) for s in st.stop) if i >= 0]
        return min(hits, default=len(st.text))

    def _safe_end(self, st: _DecodeState) -> int:
        """End of the text that can be shown while streaming: before any complete stop string and
        before a tail that is a proper prefix of a stop string."""
        end = self._first_stop(st)
        if end < len(st.text):
            return end
        hold = max((_overlap(st.text, s) for s in st.stop), default=0)
        return max(st.sent, len(st.text) - hold)

    def _final_end(self, st: _DecodeState) -> int:
        return self._first_stop(st)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def skip_replayed(detok: IncrementalDetokenizer, out: TokenOutput) -> TokenOutput:
    """`out` without the ids at stream positions already fed: elastic EP resumes a request
    from the tokens the manager had seen while outputs of the dead rank may still be on their
    way, so both can carry the same positions (equal ids: greedy replays them)."""
    start = out.completion_tokens - len(out.new_ids)
    cut = min(detok.count(out.rid) - start, len(out.new_ids))
    if not out.new_ids or start < 0 or cut <= 0:  # start < 0: no position given
        return out
    return msgspec.structs.replace(
        out, new_ids=out.new_ids[cut:],
        logprobs=None if out.logprobs is None else out.logprobs[cut:],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[cut:])


def to_text_output(detok: IncrementalDetokenizer, out: TokenOutput) -> TextOutput:
    """TokenOutput → TextOutput; frees the request's state when the output is final."""
    out = skip_replayed(detok, out)
    finished = out.finish_reason is not None
    stop_token = out.finish_matched if isinstance(out.finish_matched, int) else None
    delta = detok.step(out.rid, out.new_ids, finished, stop_token)
    return TextOutput(rid=out.rid, text_delta=delta, new_ids=out.new_ids,
                      finish_reason=out.finish_reason, finish_matched=out.finish_matched,
                      prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                      cached_tokens=out.cached_tokens, logprobs=out.logprobs,
                      top_logprobs=out.top_logprobs, error=out.error,
                      spec_verify_steps=out.spec_verify_steps,
                      spec_draft_tokens=out.spec_draft_tokens,
                      spec_accepted_tokens=out.spec_accepted_tokens,
                      input_logprobs=out.input_logprobs,
                      input_top_logprobs=out.input_top_logprobs, input_ranks=out.input_ranks)


# ---- the detokenizer process -------------------------------------------------------------------
def load_decoder(model_path: str) -> Any:
    """Something with `decode(ids, skip_special_tokens=...)` for the model's tokenizer.

    The Rust `tokenizers` object decodes exactly like transformers' fast tokenizer but loads in
    ~0.2 s without importing torch/transformers (seconds of CPU the scheduler needs at start-up);
    transformers is used when there is no tokenizer.json or it post-processes decoded text."""
    import json

    tokenizer_json = os.path.join(model_path, "tokenizer.json")
    try:
        with open(os.path.join(model_path, "tokenizer_config.json")) as f:
            cleanup = bool(json.load(f).get("clean_up_tokenization_spaces"))
    except (OSError, ValueError):
        cleanup = True
    if os.path.isfile(tokenizer_json) and not cleanup:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(tokenizer_json)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def run_detokenizer_process(model_path: str, endpoints: Any) -> None:
    """Process entry: PULL TokenOutputBatch on detokenizer_in, PUSH TextOutputBatch to
    manager_in; a request's state is freed with its final output."""
    import zmq

    from moeserve.ipc.messages import (ControlReply, DetokenizerInput, ReadyMsg, TextOutputBatch,
                                       TokenOutputBatch)
    from moeserve.ipc.queues import PullQueue, PushQueue

    detok = IncrementalDetokenizer(load_decoder(model_path))
    ctx = zmq.Context()
    inbox: PullQueue = PullQueue(ctx, endpoints.detokenizer_in, DetokenizerInput, bind=True)
    outbox = PushQueue(ctx, endpoints.manager_in)

    def on_tokens(batch: TokenOutputBatch) -> None:
        for rid, stop in batch.stop_strings.items():
            detok.add(rid, stop)
        outbox.put(TextOutputBatch(outputs=[to_text_output(detok, o) for o in batch.outputs]))

    handlers: dict[type, Callable[[Any], None]] = {TokenOutputBatch: on_tokens,
                                                   ControlReply: outbox.put}
    outbox.put(ReadyMsg(role="detokenizer", info={"pid": os.getpid()}))
    logger.info("detokenizer ready")
    while True:
        # NOTE: back in Python every 200 ms, so the launcher's stop request (children.py) is
        # taken at once, not after its grace period
        msg = inbox.get(timeout_ms=200)
        if msg is not None:
            handlers[type(msg)](msg)
