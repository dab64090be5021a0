"""host_copy: stream-ordered host<->device copies, and the worker's deferred step outputs."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from moeserve.host_copy import PendingHost, to_device
from moeserve.runtime.step import ForwardOutput
from moeserve.scheduler.worker import SubmittedStep


def test_to_device_on_cpu_is_the_tensor():
    t = torch.arange(5)
    assert torch.equal(to_device(t, torch.device("cpu")), t)


class _Later:
    """A pending copy whose tokens are known only when waited for."""

    def __init__(self, ids):
        self.ids, self.waited = ids, 0

    def wait(self):
        self.waited += 1
        return list(self.ids)


def test_submitted_step_resolves_pending_tokens_once():
    pending = _Later([4, 5, 6])
    fut: Future = Future()
    fut.set_result(ForwardOutput([], pending=pending))
    out = SubmittedStep(fut).result()
    assert out.next_token_ids == [4, 5, 6] and out.pending is None
    assert out.resolved().next_token_ids == [4, 5, 6] and pending.waited == 1
    plain = ForwardOutput([1, 2])
    assert plain.resolved() is plain and plain.next_token_ids == [1, 2]


@pytest.mark.gpu
def test_pending_copy_reads_the_values_of_its_point_in_the_stream():
    """Work queued after the copy (here: a long matmul chain, then overwriting the source) must
    not leak into what the host reads; to_device copies arrive intact."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    ids = torch.arange(1000, device=dev)
    pending = PendingHost.start(ids)
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(20):
        a = a @ a / 2048**0.5
    ids.fill_(-1)
    assert pending.wait() == list(range(1000))
    host = torch.arange(10_000).view(100, 100)
    assert torch.equal(to_device(host, dev).cpu(), host)
