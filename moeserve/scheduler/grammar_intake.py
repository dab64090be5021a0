"""GrammarIntake: structured-output requests wait off the scheduler's loop while they compile.

A grammar compiled before (the usual case: a service sends the same few schemas) is attached at
once from the compiler's cache. A new one compiles on the compiler's helper thread (a JSON schema
takes milliseconds, a long regex up to a second) while the loop goes on running the other
requests; the request is parked here and joins the waiting queue once its grammar is ready.
"""

from __future__ import annotations

from concurrent.futures import Future, wait

from moeserve.core import Req
from moeserve.runtime.grammar import GrammarCompiler, GrammarMatch

PARKED = "parked"  # attach(): the request waits for its compile


class GrammarIntake:
    def __init__(self, compiler: GrammarCompiler | None, eos_token_ids: set[int]):
        self.compiler = compiler
        self.eos_token_ids = eos_token_ids
        self.parked: list[tuple[Req, Future]] = []

    def attach(self, req: Req) -> str | None:
        """Give `req` its matcher; → None (done or not needed), PARKED (compiling), or an error
        message (no compiler)."""
        spec = req.sampling.grammar
        if spec is None:
            return None
        if self.compiler is None:
            return "this scheduler has no grammar compiler (structured outputs are off)"
        compiled = self.compiler.cached(spec)
        if compiled is not None:
            self._match(req, compiled)
            return None
        self.parked.append((req, self.compiler.compile_async(spec)))
        return PARKED

    def ready(self, wait_s: float = 0.0) -> list[tuple[Req, str | None]]:
        """Parked requests whose compile ended (after waiting up to `wait_s` for one when none
        has), each with None (matcher attached) or the error; requests finished (aborted)
        meanwhile are dropped."""
        if wait_s > 0 and self.parked:
            wait([f for _, f in self.parked], timeout=wait_s, return_when="FIRST_COMPLETED")
        out, parked = [], []
        for req, fut in self.parked:
            if not fut.done():
                parked.append((req, fut))
                continue
            if req.finished:
                continue
            try:
                self._match(req, fut.result())
                out.append((req, None))
            except ValueError as e:
                out.append((req, str(e)))
        self.parked = parked
        return out

    def _match(self, req: Req, compiled) -> None:
        sp = req.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids)
        req.grammar = GrammarMatch(compiled, sorted(stops))
