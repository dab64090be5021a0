"""KVTransfer: the one interface the roles move KV bytes through (factory.py picks the backend).

A backend registers this process's KV buffers once, names itself to peers with `address` (what a
peer passes back as `peer` to write into us), and writes lists of local byte ranges into a peer's
registered memory. Writes are one-sided: the peer learns that they ended from a control message the
role sends afterwards (messages.py), never from the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    """A write failed (peer gone, memory not registered, engine error)."""


class TransferBackendMissing(RuntimeError):
    """The configured transfer backend's library is not installed (the message says which)."""


class KVTransfer(ABC):
    name: str

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Make [ptr, ptr + nbytes) of this process readable/writable by peers."""

    @property
    @abstractmethod
    def address(self) -> str:
        """What a peer needs (with our registered pointers) to write into this process."""

    @abstractmethod
    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Copy each local [src[i], src[i] + lengths[i]) to the peer's dst[i]; returns once every
        byte landed, raises TransferError otherwise."""

    def close(self) -> None:
        pass
