"""Host↔device copies that leave the stream running.

A plain `tensor.to("cuda")` from pageable memory waits for everything queued on the stream before
it returns, so a step prepared while the previous one runs would stall the host until the GPU
drains. From pinned memory with non_blocking the copy is only queued (torch's caching host
allocator keeps the pinned block until the copy has run), and the reverse copy of sampled tokens
can be waited for later, through an event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`; from the CPU to CUDA without waiting for the stream."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class PendingHost:
    """A device tensor on its way to pinned host memory; `wait` returns it as a list."""

    host: torch.Tensor
    done: torch.cuda.Event

    @classmethod
    def start(cls, t: torch.Tensor) -> PendingHost:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def wait(self) -> list:
        self.done.synchronize()
        return self.host.tolist()
