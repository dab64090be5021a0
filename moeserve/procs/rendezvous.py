"""Where the processes meet: free TCP ports, the torch.distributed rendezvous address
(`parallel.dist_init_addr`) and a node's place in a multi-node deployment. The config is frozen,
so each helper returns a new one for the children."""

from __future__ import annotations

import dataclasses
import random
import socket

from moeserve.config import MoeserveConfig


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_block(host: str, count: int, attempts: int = 50) -> int:
    """A base port with `count` consecutive free ports on host."""
    for _ in range(attempts):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def with_rendezvous(cfg: MoeserveConfig) -> MoeserveConfig:
    """cfg with `parallel.dist_init_addr` set to a free loopback port when several ranks need a
    rendezvous and none was given (passed to the children; cfg itself is frozen)."""
    p = cfg.parallel
    if p.world_size == 1 or p.dist_init_addr is not None:
        return cfg
    addr = f"127.0.0.1:{free_tcp_port()}"
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dist_init_addr=addr))


def with_node(cfg: MoeserveConfig, node_rank: int, dist_init_addr: str,
              zmq_base_port: int) -> MoeserveConfig:
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, node_rank=node_rank,
                                          dist_init_addr=dist_init_addr),
        cluster=dataclasses.replace(cfg.cluster, zmq_base_port=zmq_base_port))
