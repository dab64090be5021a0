"""Every cross-process message, one frozen msgspec Struct each, grouped by channel.

Channels (ZMQ PUSH → PULL):
- tokenizer manager → scheduler (`SchedulerInput`): generate requests, aborts, control requests;
- scheduler → detokenizer (`DetokenizerInput`): token outputs per step; control replies pass through;
- detokenizer / scheduler → tokenizer manager (`ManagerInput`): text outputs, control replies, ready.
Payloads are msgpack with a type tag; nothing is ever unpickled.
"""

from __future__ import annotations

from typing import Union

import msgspec

from moeserve.core import SamplingParams


class Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pass


# ---- tokenizer manager → scheduler -------------------------------------------------------------
class Bootstrap(msgspec.Struct, frozen=True):
    """PD disaggregation (SGLang's router adds it): the prefill server's bootstrap server and the
    room that pairs this request's prefill with its decode (docs/disaggregation.md)."""

    host: str
    port: int
    room: int


class GenerateReq(Msg):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    dp_rank: int | None = None  # pin to one data-parallel rank
    # prompt logprobs from this prompt position on (-1: none), with this many alternatives each
    logprob_start_len: int = -1
    input_top_logprobs_num: int = 0
    bootstrap: Bootstrap | None = None
    # elastic EP: tokens a lost rank already streamed; the request continues after them
    resume_ids: list[int] = []
    # PD prefill: the HTTP layer refused the request (this reason); the rank only tells the decode
    # server that waits for the room's KV (disaggregation/prefill.py), nothing runs
    refused: str | None = None


class AbortReq(Msg):
    rid: str


class Wake(Msg):
    """Sent by the DP controller to the ranks that did not get a new request, so that every rank
    leaves its idle wait and joins the next lockstep step promptly."""


class RankDown(Msg):
    """Elastic EP, launcher → DP controller: stop routing to `rank` (it died: `cause`)."""

    rank: int
    cause: str = ""


class RankUp(Msg):
    """Elastic EP, launcher → DP controller: `rank` (relaunched) serves again."""

    rank: int


class Regroup(Msg):
    """Elastic EP, launcher → every serving rank: membership `generation` (a rank rejoining)
    is published; the ranks switch to it at a step they agree on."""

    generation: int


class ControlReq(Msg):
    """A control request; every rank answers with a ControlReply carrying the same `cid`."""

    cid: int
    op: str  # flush_cache | server_info
    args: dict = {}


# ---- scheduler → detokenizer ------------------------------------------------------------------
class TokenOutput(Msg):
    """New tokens of one request since the last output, plus its state if finished."""

    rid: str
    new_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort
    finish_matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None  # of new_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    spec_verify_steps: int = 0  # speculative decoding: verify passes so far
    spec_draft_tokens: int = 0  # drafts proposed so far
    spec_accepted_tokens: int = 0  # tokens those passes produced (accepted drafts + bonus)
    # prompt logprobs (once, with the first output after the prompt's prefill): entry j is for
    # prompt position logprob_start_len + j (None at position 0); ranks are 1 for the argmax
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_ranks: list[int | None] | None = None


class TokenOutputBatch(Msg):
    outputs: list[TokenOutput]
    stop_strings: dict[str, list[str]] = {}  # rid → stop strings, sent once with the first output


# ---- detokenizer → tokenizer manager -----------------------------------------------------------
class TextOutput(Msg):
    rid: str
    text_delta: str
    new_ids: list[int]
    finish_reason: str | None = None
    finish_matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_ranks: list[int | None] | None = None


class TextOutputBatch(Msg):
    outputs: list[TextOutput]


class ControlReply(Msg):
    cid: int
    rank: int
    ok: bool = True
    data: dict = {}


class ReadyMsg(Msg):
    """Sent once by each child process after start-up."""

    role: str  # scheduler | detokenizer
    rank: int = 0
    info: dict = {}  # e.g. max_total_tokens, max_req_len


class RequestsLost(Msg):
    """Elastic EP, DP controller → tokenizer manager: `rids` were routed to `rank`, which died;
    those still running are resumed on other ranks (elastic/retry.py)."""

    rank: int
    rids: list[str]
    cause: str = ""


class LoadReport(Msg):
    """Periodic scheduler load and counters (for /metrics and data-parallel routing)."""

    rank: int
    running: int
    waiting: int
    used_tokens: int  # KV slots held by requests and the prefix cache's locked nodes
    max_total_tokens: int
    cache_hit_tokens: int = 0  # cumulative prompt tokens served from the prefix cache
    prompt_tokens: int = 0  # cumulative prompt tokens admitted
    eplb_balancedness: float = -1.0  # after the last live rebalance (-1: none yet)
    disagg: dict = {}  # PD role: cumulative KV transfer counters (disaggregation/role.py)


SchedulerInput = Union[GenerateReq, AbortReq, ControlReq, Wake, RankDown, RankUp, Regroup]
DetokenizerInput = Union[TokenOutputBatch, ControlReply]
ManagerInput = Union[TextOutputBatch, ControlReply, ReadyMsg, LoadReport, RequestsLost]
