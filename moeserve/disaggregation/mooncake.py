"""The Mooncake transfer engine as a KVTransfer (PyPI `mooncake-transfer-engine`, or its
`-non-cuda` build on machines without CUDA).

Peers find each other by P2P handshake (no metadata server): an engine listens on an RPC port and
its address is host:port. The transport is RDMA where an RDMA device is present (or asked for) and
TCP otherwise; the engine also needs Debian's `libibverbs1` even for TCP.
"""

from __future__ import annotations

import logging
import os

from moeserve.config import DisaggregationConfig
from moeserve.disaggregation.transfer import KVTransfer, TransferBackendMissing, TransferError

logger = logging.getLogger(__name__)

BATCH_RANGES = 1024  # byte ranges per batched write

INSTALL_HINT = ("disaggregation.transfer_backend=mooncake needs the Mooncake transfer engine: "
                "`pip install mooncake-transfer-engine` (CUDA) or "
                "`pip install mooncake-transfer-engine-non-cuda` (CPU), and Debian's libibverbs1 "
                "(`apt-get install -y libibverbs1`)")


def load_engine_class():
    """mooncake.engine.TransferEngine, or TransferBackendMissing naming what is absent."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # also a missing libibverbs.so.1 (an ImportError of the .so)
        raise TransferBackendMissing(f"{INSTALL_HINT} ({e})") from e
    return TransferEngine


def pick_protocol(cfg: DisaggregationConfig) -> str:
    if cfg.protocol != "auto":
        return cfg.protocol
    return "rdma" if os.path.isdir("/sys/class/infiniband") and os.listdir(
        "/sys/class/infiniband") else "tcp"


class MooncakeTransfer(KVTransfer):
    name = "mooncake"

    def __init__(self, cfg: DisaggregationConfig, device_kind: str = "cpu"):
        engine_cls = load_engine_class()
        self.engine = engine_cls()
        self.protocol = pick_protocol(cfg)
        rc = self.engine.initialize(cfg.host, "P2PHANDSHAKE", self.protocol, cfg.ib_device or "")
        if rc != 0:
            raise TransferError(f"Mooncake engine did not start on {cfg.host} over "
                                f"{self.protocol} (code {rc})")
        self._address = f"{cfg.host}:{self.engine.get_rpc_port()}"
        logger.info("Mooncake transfer engine at %s (%s, %s memory)", self._address,
                    self.protocol, device_kind)

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes (code {rc})")

    @property
    def address(self) -> str:
        return self._address

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        # NOTE: one batch of thousands of ranges overflows the TCP transport's lane queue (the
        # write then fails with -1: 61 layers x 128 runs did); batches of BATCH_RANGES do not
        for i in range(0, len(src), BATCH_RANGES):
            j = i + BATCH_RANGES
            rc = self.engine.batch_transfer_sync_write(peer, src[i:j], dst[i:j], lengths[i:j])
            if rc != 0:
                raise TransferError(f"Mooncake write of {sum(lengths[i:j])} bytes to {peer} "
                                    f"failed (code {rc})")
