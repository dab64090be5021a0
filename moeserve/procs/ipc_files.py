"""The ipc:// socket files of one deployment's ZMQ endpoints: ZMQ leaves them behind, so whoever
started the processes removes them once they are stopped."""

from __future__ import annotations

import os

from moeserve.ipc.queues import Endpoints


def remove_ipc_files(endpoints: Endpoints) -> None:
    addresses = (endpoints.scheduler_in, endpoints.detokenizer_in, endpoints.manager_in,
                 *endpoints.rank_in, endpoints.controller_in or "")
    for address in addresses:
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://"):])
            except OSError:
                pass
