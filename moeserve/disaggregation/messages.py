"""Control messages between a prefill rank and a decode rank (ZMQ, msgpack; never pickled).

The KV bytes themselves go through the transfer engine (transfer.py); these only say where to
write and that the write ended.
"""

from __future__ import annotations

from typing import Union

import msgspec


class KVDestination(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Decode → prefill: where room `room`'s prompt KV goes. `ptrs[b] + slot * slot_bytes[b]` is
    slot `slot` of the decode rank's buffer b (per layer: K and V, or MLA's latent)."""

    room: int
    engine: str  # the decode rank's KVTransfer.address
    reply_to: str  # the decode rank's control endpoint (tcp://host:port) for KVDone
    ptrs: list[int]
    slot_bytes: list[int]
    slots: list[int]  # one per prompt token, in order


class KVDone(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Prefill → decode: room `room`'s KV is in place (ok) or will never be (error)."""

    room: int
    ok: bool
    error: str | None = None
    first_token: int = -1  # the token the prefill sampled after the prompt
    first_logprob: float | None = None
    first_top_logprobs: list[tuple[int, float]] | None = None  # when the request asked for them
    nbytes: int = 0
    # speculative decoding (MTP): the draft's state after the first token, as the prefill's draft
    # extend left it, so the decode's first verify step drafts as a colocated server's would:
    # its next proposal(s) (d_1; a draft tree: its first level) and its hidden state (raw bytes
    # of the row, the model's dtype)
    draft_tokens: list[int] | None = None
    draft_hidden: bytes | None = None


ControlMsg = Union[KVDestination, KVDone]
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(ControlMsg)
