"""Membership generations and liveness, in a TCPStore hosted by the launcher.

The launcher's store outlives every rank, so a group can be re-formed whichever rank died
(torch's default rendezvous lives in rank 0, which may be the one lost). Generation g's
process groups meet under the store prefix `g{g}/`, so a new generation never reads an old
one's keys.

Keys (prefix `elastic/`):
  gen                  latest generation number
  gen/{g}              json {ranks, cause, event_time}: the members of generation g
  hb/{rank}            a counter the rank's heartbeat thread bumps (liveness)
  fail/{g}/{rank}      why a collective of generation g failed on that rank
  ready/{rank}         a relaunched rank has loaded its weights and waits to join
  first_step/{g}/{r}   wall time of rank r's first step on generation g
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field

from torch.distributed import TCPStore

P = "elastic/"


@dataclass(frozen=True)
class Membership:
    generation: int
    ranks: tuple[int, ...]  # global ranks, ascending; index in this tuple = rank in the group
    cause: str = ""  # why this generation was published
    event_time: float = 0.0  # time.time() of the event that caused it
    joining: tuple[int, ...] = field(default=())  # relaunched ranks that join in it

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


def connect_store(addr: str, timeout_s: float = 60.0, master: bool = False) -> TCPStore:
    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=master, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


class MembershipStore:
    """Typed access to the keys above (one instance per thread: a TCPStore client is not
    meant to be shared between threads)."""

    def __init__(self, store: TCPStore):
        self.store = store

    def _get(self, key: str) -> str | None:
        if not self.store.check([P + key]):
            return None
        return self.store.get(P + key).decode()

    # ---- generations ----
    def publish(self, m: Membership) -> None:
        doc = {"ranks": list(m.ranks), "cause": m.cause, "event_time": m.event_time,
               "joining": list(m.joining)}
        self.store.set(f"{P}gen/{m.generation}", json.dumps(doc))
        self.store.set(P + "gen", str(m.generation))

    def latest(self) -> Membership | None:
        g = self._get("gen")
        return None if g is None else self.read(int(g))

    def read(self, generation: int) -> Membership:
        doc = json.loads(self._get(f"gen/{generation}") or "{}")
        return Membership(generation, tuple(doc["ranks"]), doc.get("cause", ""),
                          doc.get("event_time", 0.0), tuple(doc.get("joining", ())))

    def wait_newer(self, generation: int, timeout_s: float, poll_s: float = 0.02) -> Membership:
        """The latest membership once its generation exceeds `generation`."""
        deadline = time.monotonic() + timeout_s
        while True:
            g = self._get("gen")
            if g is not None and int(g) > generation:
                return self.read(int(g))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no membership newer than generation {generation} within "
                                   f"{timeout_s:.0f} s")
            time.sleep(poll_s)

    # ---- liveness ----
    def beat(self, rank: int) -> None:
        self.store.add(f"{P}hb/{rank}", 1)

    def beats(self, rank: int) -> int:
        return self.store.add(f"{P}hb/{rank}", 0)

    def report_failure(self, generation: int, rank: int, cause: str) -> None:
        self.store.set(f"{P}fail/{generation}/{rank}", cause)

    def failure(self, generation: int, rank: int) -> str | None:
        return self._get(f"fail/{generation}/{rank}")

    # ---- rejoin and recovery timing ----
    def mark_ready(self, rank: int, ready: bool = True) -> None:
        self.store.set(f"{P}ready/{rank}", "1" if ready else "0")

    def is_ready(self, rank: int) -> bool:
        return self._get(f"ready/{rank}") == "1"

    def first_step(self, generation: int, rank: int, when: float) -> None:
        self.store.set(f"{P}first_step/{generation}/{rank}", repr(when))

    def first_step_of(self, generation: int, rank: int) -> float | None:
        v = self._get(f"first_step/{generation}/{rank}")
        return None if v is None else float(v)
