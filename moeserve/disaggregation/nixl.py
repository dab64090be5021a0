"""NIXL as a KVTransfer (PyPI `nixl` with its CUDA build `nixl-cu12`, which also loads and moves
host memory on machines without CUDA), over its UCX backend.

Peers find each other as Mooncake's do, with no metadata server: each agent runs NIXL's listen
thread on a port of its own, and its address is name@host:port. The first write to a peer fetches
that peer's metadata (its registered memory) from there; NIXL then writes all ranges as one
transfer. Only writes are used: the peer learns that they ended from the role's control message.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid

from moeserve.config import DisaggregationConfig
from moeserve.disaggregation.transfer import KVTransfer, TransferBackendMissing, TransferError

logger = logging.getLogger(__name__)

INSTALL_HINT = ("disaggregation.transfer_backend=nixl needs NIXL: `pip install nixl` "
                "(with nixl-cu12, ~240 MB)")
METADATA_TIMEOUT_S = 10.0  # a peer's metadata must arrive this soon after the first write asks
WRITE_TIMEOUT_S = 60.0


def load_agent_api():
    """(nixl_agent, nixl_agent_config), or TransferBackendMissing naming what is absent."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransferBackendMissing(f"{INSTALL_HINT} ({e})") from e
    return nixl_agent, nixl_agent_config


def free_port(host: str) -> int:
    """A port free now on `host` (NIXL's listen thread does not report the one it got for 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NixlTransfer(KVTransfer):
    name = "nixl"

    def __init__(self, cfg: DisaggregationConfig, device_kind: str = "cpu"):
        agent_cls, config_cls = load_agent_api()
        self.host, self.port = cfg.host, free_port(cfg.host)
        self.agent_name = f"moeserve-{uuid.uuid4().hex[:12]}"
        try:
            self.agent = agent_cls(self.agent_name, config_cls(
                backends=["UCX"], enable_listen_thread=True, listen_port=self.port))
        except Exception as e:  # the bindings raise their own exception types
            raise TransferError(f"NIXL agent did not start on port {self.port}: {e}") from e
        self.mem_type, self.dev_id = ("VRAM", _cuda_device()) if device_kind == "cuda" else (
            "DRAM", 0)
        self._peers: dict[str, str] = {}  # address → agent name, metadata loaded
        self._regs = []  # registration handles, kept alive until close
        logger.info("NIXL agent %s at %s (UCX, %s)", self.agent_name, self.address,
                    self.mem_type)

    def register(self, ptr: int, nbytes: int) -> None:
        descs = self.agent.get_reg_descs([(ptr, nbytes, self.dev_id, "")], self.mem_type)
        reg = self.agent.register_memory(descs)
        if reg is None:
            raise TransferError(f"NIXL could not register {nbytes} bytes")
        self._regs.append(reg)

    @property
    def address(self) -> str:
        return f"{self.agent_name}@{self.host}:{self.port}"

    def _peer(self, peer: str) -> str:
        """The peer's agent name, its metadata fetched from its listen thread on first use."""
        name = self._peers.get(peer)
        if name is not None:
            return name
        name, _, hostport = peer.partition("@")
        host, _, port = hostport.rpartition(":")
        self.agent.fetch_remote_metadata(name, host, int(port))
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        while not self.agent.check_remote_metadata(name):
            if time.monotonic() > deadline:
                raise TransferError(f"no NIXL metadata from {peer} within "
                                    f"{METADATA_TIMEOUT_S:.0f} s")
            time.sleep(0.001)
        self._peers[peer] = name
        return name

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        name = self._peer(peer)
        local = self.agent.get_xfer_descs(
            [(s, n, self.dev_id) for s, n in zip(src, lengths)], self.mem_type)
        # the peer's device ids are not known here: NOTE same-index GPUs assumed (one per rank)
        remote = self.agent.get_xfer_descs(
            [(d, n, self.dev_id) for d, n in zip(dst, lengths)], self.mem_type)
        try:
            handle = self.agent.initialize_xfer("WRITE", local, remote, name)
        except Exception as e:
            raise TransferError(f"NIXL write to {peer} was refused: {e}") from e
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + WRITE_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL write of {sum(lengths)} bytes to {peer} did not "
                                        f"end within {WRITE_TIMEOUT_S:.0f} s")
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"NIXL write of {sum(lengths)} bytes to {peer} failed")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs = []


def _cuda_device() -> int:
    import torch

    return torch.cuda.current_device()
