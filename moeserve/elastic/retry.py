"""The tokenizer manager's side of elastic EP: requests of a dead rank resume on another.

The manager remembers each request it sent and the token ids it has received for it. When the
DP controller reports a rank lost (RequestsLost), every request of that rank still running is
sent again with `resume_ids` = the ids received so far: the new rank prefills prompt + those
ids and continues, and the client's stream goes on where it stopped. Outputs of the dead rank
still in flight may overlap the resumed ones; the detokenizer drops repeated stream positions
(tokenizer/detokenizer.py: skip_replayed), so the client sees each token once.

A request that cannot be resumed faithfully ends with an error that names the failure instead:
one pinned to the dead rank (`dp_rank`), a seeded sample (its generator state died with the
rank, so the continuation would not be the sample asked for), or one already resumed
MAX_RESUMES times (a request that keeps killing ranks).
"""

from __future__ import annotations

import logging
from collections import Counter

import msgspec

from moeserve.elastic.metrics import ElasticMetrics
from moeserve.ipc.messages import GenerateReq, RequestsLost, TextOutput

logger = logging.getLogger(__name__)

MAX_RESUMES = 2
RANK_LOST_ERROR = "Rank lost"  # errors that start so are 503s (server/serving_common.py)


class RequestLedger:
    def __init__(self, send, metrics: ElasticMetrics):
        self.send, self.metrics = send, metrics  # send(GenerateReq): to the DP controller
        self.reqs: dict[str, GenerateReq] = {}
        self.ids: dict[str, list[int]] = {}
        self.resumes: Counter = Counter()

    def sent(self, req: GenerateReq) -> None:
        self.reqs[req.rid], self.ids[req.rid] = req, []

    def on_output(self, out: TextOutput) -> None:
        ids = self.ids.get(out.rid)
        if ids is not None:
            ids.extend(out.new_ids)
        if out.finish_reason is not None:
            self.forget(out.rid)

    def forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self.ids.pop(rid, None)
        self.resumes.pop(rid, None)

    def why_not(self, req: GenerateReq) -> str | None:
        if req.dp_rank is not None:
            return "it was pinned to that rank (dp_rank)"
        if req.sampling.temperature > 0 and req.sampling.seed is not None:
            return "a seeded sample cannot be continued on another rank"
        if self.resumes[req.rid] >= MAX_RESUMES:
            return f"it was already resumed {MAX_RESUMES} times"
        return None

    def on_lost(self, msg: RequestsLost, running: set[str] | dict) -> list[tuple[str, str]]:
        """Resume the lost requests still running; → (rid, error) for those that cannot be."""
        failed, resumed = [], 0
        for rid in msg.rids:
            req = self.reqs.get(rid)
            if req is None or rid not in running:
                continue
            why = self.why_not(req)
            if why is not None:
                failed.append((rid, f"{RANK_LOST_ERROR}: rank {msg.rank} died ({msg.cause}) "
                                    f"while serving this request, which cannot be resumed: "
                                    f"{why}"))
                self.forget(rid)
                continue
            self.resumes[rid] += 1
            self.send(msgspec.structs.replace(req, resume_ids=list(self.ids[rid])))
            resumed += 1
        self.metrics.requests_retried.inc(resumed)
        self.metrics.requests_failed.inc(len(failed))
        logger.warning("elastic: rank %d lost (%s): %d request(s) resumed on other ranks, %d "
                       "ended with an error", msg.rank, msg.cause, resumed, len(failed))
        return failed
