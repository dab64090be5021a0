"""Which PD role and which KV transfer engine a config asks for.

The one module that knows every implementation, so that the interfaces the implementations build
on (role.py, transfer.py) import none of them. Implementations are imported on demand: a
colocated server never loads them, and a missing transfer library is reported by name.
"""

from __future__ import annotations

from moeserve.config import DisaggregationConfig, MoeserveConfig
from moeserve.disaggregation.role import RoleHost
from moeserve.disaggregation.transfer import KVTransfer


def make_transfer(cfg: DisaggregationConfig, device_kind: str) -> KVTransfer:
    """The configured backend; TransferBackendMissing when its library is absent."""
    if cfg.transfer_backend == "mooncake":
        from moeserve.disaggregation.mooncake import MooncakeTransfer

        return MooncakeTransfer(cfg, device_kind)
    if cfg.transfer_backend == "nixl":
        from moeserve.disaggregation.nixl import NixlTransfer

        return NixlTransfer(cfg, device_kind)
    raise ValueError(f"unknown transfer backend {cfg.transfer_backend!r}")


def make_role(cfg: MoeserveConfig, host: RoleHost, device_kind: str):
    """The configured role (None for a colocated server). Starts the transfer engine: a missing
    library raises TransferBackendMissing naming it, before the server reports ready."""
    mode = cfg.disaggregation.mode
    if mode is None:
        return None
    transfer = make_transfer(cfg.disaggregation, device_kind)
    if mode == "prefill":
        from moeserve.disaggregation.prefill import PrefillRole

        return PrefillRole(cfg.disaggregation, host, transfer)
    from moeserve.disaggregation.decode import DecodeRole

    return DecodeRole(cfg.disaggregation, host, transfer, cfg.cache.max_running_requests)
