"""Elastic EP tells a failed collective (a peer gone or late: recover) from a bug in the step
(raise): `is_comm_failure` (elastic/group.py) against the errors gloo itself raises, in two real
processes whose peer stays silent past the group's timeout. The second error is the one a
dispatcher's pending all-to-all got in a recovery test and which was not recognized (the rank
then exited instead of recovering)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time

import torch
import torch.distributed as dist

from moeserve.elastic.group import is_comm_failure
from moeserve.procs.rendezvous import free_tcp_port


def _rank(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=1))
    if rank == 1:  # alive but silent: takes part in nothing
        time.sleep(2.5)  # past rank 0's 1 s timeout
        os._exit(0)
    pending = dist.irecv(torch.zeros(4), 1)  # like a dispatcher's posted receive
    errors = []
    for call in (lambda: dist.all_reduce(torch.zeros(4)), pending.wait):
        try:
            call()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 -- whatever gloo raises is the subject
            errors.append((type(e).__name__, str(e)))
    out.put(errors)
    out.close()
    out.join_thread()  # flushed before the hard exit
    os._exit(0)  # gloo's teardown with a closed pair may abort: nothing left to check


def test_gloo_timeouts_are_comm_failures():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_tcp_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        timed_out, closed = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert timed_out is not None and "Timed out" in timed_out[1], timed_out
    assert closed is not None and "pair closure" in closed[1], closed
    for name, text in (timed_out, closed):
        assert is_comm_failure(RuntimeError(text)), text
    assert not is_comm_failure(ValueError("expert 3 gate: expected (8, 16), got (8, 32)"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
