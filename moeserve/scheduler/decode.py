"""Decode-side policy: which running requests step next, and retraction when KV runs out."""

from __future__ import annotations

from moeserve.core import Req


def decodable(running: list[Req], context_len: int) -> list[Req]:
    """Running requests that still need tokens (the overlap loop may not have seen them finish)."""
    return [r for r in running if not r.finished
            and r.num_generated_on_device < r.sampling.max_new_tokens
            and r.device_len < context_len]


def pick_retractions(reqs: list[Req], available: int, per_request: int = 1) -> list[Req]:
    """Victims so that the rest get `per_request` slots each (a verify step takes num_steps + 1):
    least progress first, then longest prompt."""
    order = sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
    victims: list[Req] = []
    while order and available < per_request * (len(reqs) - len(victims)):
        victim = order.pop(0)
        victims.append(victim)
        available += victim.kv_len - victim.prefix_len  # its own slots come back
    return victims


class NewTokenRatio:
    """Share of running requests' remaining max_new_tokens reserved when admitting prefills: starts
    optimistic, decays towards the minimum each decode step, jumps up after a retraction."""

    def __init__(self, init: float, minimum: float, decay: float):
        self.init, self.minimum, self.decay = init, minimum, decay
        self.value = init

    def step(self) -> None:
        self.value = max(self.value - self.decay, self.minimum)

    def on_retract(self) -> None:
        self.value = min(1.0, self.value + 0.3)
