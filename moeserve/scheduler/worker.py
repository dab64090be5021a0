"""ForwardWorker: executes ForwardInput records on the model, in order, inline or on a thread.

Everything that touches device tables (slot map, token table) happens here, in submission order, so
the overlap loop can build step N+1 on the host while step N still runs: step N+1 reads the tokens
step N sampled from the device token table.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from moeserve.core import ForwardMode, SamplingParams
from moeserve.forward_batch import ForwardBatch
from moeserve.runtime.grammar import accept_tokens, apply_grammars, constrained_rows
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.penalties import LogitEdits, edit_logits
from moeserve.runtime.sampler import sample


@dataclass
class ForwardInput:
    """Host-side description of one step; `prefix_lens[i]` is where request i's new tokens start."""

    mode: ForwardMode
    rows: list[int]  # req_pool_idx per request
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # [T] slots for the new tokens
    new_token_ids: list[int] | None  # EXTEND: ids of the new tokens; DECODE: read from the table
    sampling: list[SamplingParams]
    generators: list[torch.Generator | None]
    top_logprobs_nums: list[int]  # -1: no logprobs for this request
    return_all_logits: bool = False
    global_mode: ForwardMode | None = None  # set after the DP sync
    global_num_tokens: list[int] | None = None  # every rank's token count, from the DP sync
    tbo: bool = False  # two micro-batches (the DP sync's agreed answer)
    prompt_lens: list[int] = field(default_factory=list)  # penalties: where generated ids start
    # EXTEND, penalised requests: (row, ids of positions [0, prefix_len)), since a prefix served
    # from the radix cache left those positions of the token table stale
    history: list[tuple[int, list[int]]] = field(default_factory=list)
    grammars: list = field(default_factory=list)  # GrammarMatch | None per request, or empty

    def greedy_only(self) -> bool:
        """Only greedy next tokens are needed (no sampling, logprobs, edits, grammars or returned
        logits)."""
        return (not self.return_all_logits and all(n < 0 for n in self.top_logprobs_nums)
                and not any(self.grammars)
                and all(p.is_greedy and not p.edits_logits for p in self.sampling))

    @classmethod
    def idle(cls) -> ForwardInput:
        """Zero tokens: joins every collective of a forward that other ranks run."""
        return cls(ForwardMode.IDLE, [], [], [], torch.empty(0, dtype=torch.int64), [], [], [],
                   [])


@dataclass
class ForwardOutput:
    next_token_ids: list[int]  # [B]
    logprobs: list[float] | None = None  # of the sampled tokens (raw distribution)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    logits: torch.Tensor | None = None  # only with return_all_logits


class ForwardWorker:
    def __init__(self, runner: ModelRunner, threaded: bool):
        self.runner = runner
        dev = runner.device
        self._cuda_index = None if dev.type != "cuda" else (
            dev.index if dev.index is not None else torch.cuda.current_device())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="forward",
                                        initializer=self._bind_device) if threaded else None

    def _bind_device(self) -> None:
        """The CUDA current device is per thread and starts at 0: without this, code that uses
        it (Triton launches, current_stream()) ran rank r's forward-thread work on GPU 0."""
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)

    def submit(self, fi: ForwardInput) -> Future:
        """Queue a step; its result is a ForwardOutput."""
        if self._pool is not None:
            return self._pool.submit(self.run, fi)
        fut: Future = Future()
        fut.set_result(self.run(fi))
        return fut

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    @torch.inference_mode()
    def run(self, fi: ForwardInput) -> ForwardOutput:
        fb, rows = self._prepare(fi), []
        if fi.greedy_only():
            next_ids, logits = self.runner.forward_greedy(fb), None  # [B]
        else:
            logits = self.runner.forward(fb, float_logits=fi.return_all_logits)  # sampling upcasts
            last = logits if not fi.return_all_logits else logits[fb.last_token_indices()]
            edited, rows = self._edit(fi, fb, last), self._grammar_rows(fi)
            if rows:
                edited = apply_grammars(edited, fi.grammars, rows)
            next_ids = sample(edited, fi.sampling, fi.generators)  # [B]
        self.runner.memory.req_to_token.token_ids[fb.req_pool_indices, fb.seq_lens] = next_ids
        out = ForwardOutput(next_ids.tolist())
        if rows:
            accept_tokens(fi.grammars, rows, out.next_token_ids)
        if any(n >= 0 for n in fi.top_logprobs_nums):
            out.logprobs, out.top_logprobs = _logprobs(last, next_ids, fi.top_logprobs_nums)
        if fi.return_all_logits:
            out.logits = logits
        return out

    @staticmethod
    def _grammar_rows(fi: ForwardInput) -> list[int]:
        """Constrained rows; each one's generated-token count is its known tokens minus prompt."""
        if not any(fi.grammars):
            return []
        gen = [p + e - n for p, e, n in zip(fi.prefix_lens, fi.extend_lens, fi.prompt_lens)]
        return constrained_rows(fi.grammars, gen)

    def _edit(self, fi: ForwardInput, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        """Penalties and logit_bias; logprobs keep reading the raw logits (as vLLM's do)."""
        edits = LogitEdits.build(fi.sampling)
        if edits is None:
            return logits
        dev = logits.device
        known = torch.tensor([p + e for p, e in zip(fi.prefix_lens, fi.extend_lens)],
                             dtype=torch.int64).to(dev)
        prompt = torch.tensor(fi.prompt_lens, dtype=torch.int64).to(dev)
        table = self.runner.memory.req_to_token.token_ids
        return edit_logits(logits, edits, table, fb.req_pool_indices, prompt, known)

    def _write_history(self, fi: ForwardInput) -> None:
        if not fi.history:
            return
        table = self.runner.memory.req_to_token.token_ids
        rows = torch.tensor([r for r, ids in fi.history for _ in ids], dtype=torch.int64)
        pos = torch.cat([torch.arange(len(ids)) for _, ids in fi.history])
        ids = torch.tensor([t for _, ids in fi.history for t in ids], dtype=torch.int64)
        table[rows.to(table.device), pos.to(table.device)] = ids.to(table.device)

    def _prepare(self, fi: ForwardInput) -> ForwardBatch:
        """Write the step's slot map (and, for EXTEND, its token ids) into the request rows, then
        read the input ids back from the token table (decode inputs were sampled on the device)."""
        mem, dev = self.runner.memory, self.runner.device
        if fi.mode.is_decode():
            return self._prepare_decode(fi)
        self._write_history(fi)
        lens = torch.tensor(fi.extend_lens, dtype=torch.int64)  # [B]
        row_of_tok = torch.repeat_interleave(torch.tensor(fi.rows, dtype=torch.int64), lens)
        starts = torch.tensor(fi.prefix_lens, dtype=torch.int64) - (lens.cumsum(0) - lens)
        positions = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts, lens)  # [T]
        row_of_tok, positions = row_of_tok.to(dev), positions.to(dev)
        mem.req_to_token.req_to_token[row_of_tok, positions] = fi.out_cache_loc.to(dev)
        if fi.new_token_ids is not None:
            ids = torch.tensor(fi.new_token_ids, dtype=torch.int64, device=dev)
            mem.req_to_token.token_ids[row_of_tok, positions] = ids
        input_ids = mem.req_to_token.token_ids[row_of_tok, positions]
        return self.runner.make_batch(fi.mode, input_ids, positions, fi.out_cache_loc, fi.rows,
                                      fi.prefix_lens, fi.extend_lens, fi.return_all_logits,
                                      fi.global_mode, fi.global_num_tokens, tbo=fi.tbo)

    def _prepare_decode(self, fi: ForwardInput) -> ForwardBatch:
        """One token per request, at its prefix length: rows, positions, seq lens and KV slots
        travel to the device in one copy (each small host-to-device copy costs ~10 µs of host
        time, and a decode step at batch 256 must stay well under the device's step)."""
        mem = self.runner.memory
        n = len(fi.rows)
        host = torch.empty((4, n), dtype=torch.int64)
        host[0] = torch.tensor(fi.rows, dtype=torch.int64)
        host[1] = torch.tensor(fi.prefix_lens, dtype=torch.int64)
        torch.add(host[1], 1, out=host[2])
        host[3] = fi.out_cache_loc
        rows, positions, seq_lens, loc = host.to(self.runner.device).unbind(0)
        mem.req_to_token.req_to_token[rows, positions] = loc
        input_ids = mem.req_to_token.token_ids[rows, positions]
        return self.runner.make_batch(fi.mode, input_ids, positions, loc, rows, fi.prefix_lens,
                                      fi.extend_lens, fi.return_all_logits, fi.global_mode,
                                      fi.global_num_tokens, seq_lens_dev=seq_lens, tbo=fi.tbo)


def _logprobs(logits: torch.Tensor, next_ids: torch.Tensor, nums: list[int]):
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, next_ids[:, None])[:, 0].tolist()
    k = max(max(nums), 0)
    top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
    tops = [[(int(i), float(v)) for i, v in zip(top_i[b, :n].tolist(), top_v[b, :n].tolist())]
            if k and n > 0 else [] for b, n in enumerate(nums)]
    return chosen, tops
