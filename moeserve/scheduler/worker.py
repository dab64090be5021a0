"""ForwardWorker: executes ForwardInput records on the model, in order, inline or on a thread.

Everything that touches device tables (slot map, token table) happens here, in submission order, so
the overlap loop can build step N+1 on the host while step N still runs: step N+1 reads the tokens
step N sampled from the device token table.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
import torch

from moeserve.forward_batch import ForwardBatch
from moeserve.host_copy import PendingHost, to_device
from moeserve.runtime.grammar_steps import GrammarSteps, StepMask
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.penalties import LogitEdits, edit_logits
from moeserve.runtime.prompt_logprobs import score_spans
from moeserve.runtime.sampler import greedy, logprobs_of, sample
from moeserve.runtime.step import ForwardInput, ForwardOutput


class SubmittedStep:
    """A queued step: result() is its ForwardOutput once its tokens are on the host."""

    def __init__(self, future: Future):
        self._future = future

    def result(self) -> ForwardOutput:
        return self._future.result().resolved()


class ForwardWorker:
    def __init__(self, runner: ModelRunner, threaded: bool):
        self.runner = runner
        self.spec = None  # spec_mtp.decoder.SpecDecoder: runs every step when speculating
        if runner.draft is not None:
            from moeserve.spec_mtp.decoder import SpecDecoder
            from moeserve.spec_mtp.tree import tree_shape
            from moeserve.spec_mtp.tree_decoder import TreeSpecDecoder

            spec = runner.cfg.spec
            self.spec = (SpecDecoder(runner, self, spec.num_steps) if spec.topk == 1 else
                         TreeSpecDecoder(runner, self, tree_shape(spec, runner.draft.tree_paths)))
        dev = runner.device
        self._cuda_index = None if dev.type != "cuda" else (
            dev.index if dev.index is not None else torch.cuda.current_device())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="forward",
                                        initializer=self._bind_device) if threaded else None
        self.grammar = GrammarSteps(dev, self._bind_device)  # masks; matchers on a helper thread

    def _bind_device(self) -> None:
        """The CUDA current device is per thread and starts at 0: without this, code that uses
        it (Triton launches, current_stream()) ran rank r's forward-thread work on GPU 0."""
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)

    def submit(self, fi: ForwardInput) -> SubmittedStep:
        """Queue a step; its result() is a ForwardOutput with the tokens on the host."""
        if self._pool is not None:
            return SubmittedStep(self._pool.submit(self.run, fi))
        fut: Future = Future()
        fut.set_result(self.run(fi))
        return SubmittedStep(fut)

    def drain(self) -> None:
        """Wait until every submitted step ended, however it ended (elastic EP: a step whose
        collective failed must be over before its process groups are destroyed)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.grammar.shutdown()

    @torch.inference_mode()
    def run(self, fi: ForwardInput) -> ForwardOutput:
        if self.spec is not None:
            return self.spec.run(fi)
        fb = self._prepare(fi)
        if fi.prompt_spans:
            return self._scoring_step(fi, fb)
        if fi.greedy_only():
            return self.finish_step(fi, fb, self.runner.forward_greedy(fb), None, defer=True)
        logits = self.runner.forward(fb, float_logits=fi.return_all_logits)  # sampling upcasts
        return self.sample_step(fi, fb, logits, defer=True)

    def _scoring_step(self, fi: ForwardInput, fb: ForwardBatch) -> ForwardOutput:
        """A prefill step that also scores prompt positions: the hidden states of every position
        are kept (fb.return_all_logits), the last ones sampled as usual, the spans' rows scored
        by blocks (runtime/prompt_logprobs.py)."""
        fb.return_all_logits = True
        hidden = self.runner.forward_hidden(fb)  # [T, H]
        logits = self.runner.model.compute_logits(hidden[fb.last_token_indices()]).float()
        out = self.sample_step(fi, fb, logits)
        out.prompt_scores = score_spans(self.runner.model.compute_logits, hidden,
                                        fi.prompt_spans)
        return out

    def sample_step(self, fi: ForwardInput, fb: ForwardBatch, logits: torch.Tensor,
                    defer: bool = False) -> ForwardOutput:
        """Next tokens from the step's logits (each request's last token, or every token with
        return_all_logits): edits, grammars, sampling, then `finish_step` (`defer`: see there)."""
        last = logits if not fi.return_all_logits else logits[fb.last_token_indices()]
        mask = None
        if fi.greedy_only():
            next_ids = greedy(last)
        else:
            edited = self._edit(fi, fb, last)
            mask = self.grammar.mask(fi)  # after the forward's launch: the fill overlaps it
            if mask is not None:  # in place unless the raw logits serve logprobs later
                raw_needed = edited is last and any(n >= 0 for n in fi.top_logprobs_nums)
                edited = self.grammar.apply(edited, mask, copy=raw_needed)
            next_ids = sample(edited, fi.sampling, fi.generators)  # [B]
        out = self.finish_step(fi, fb, next_ids, last, mask, defer)
        if fi.return_all_logits:
            out.logits = logits
        return out

    def finish_step(self, fi: ForwardInput, fb: ForwardBatch, next_ids: torch.Tensor,
                    last: torch.Tensor | None, mask: StepMask | None = None,
                    defer: bool = False) -> ForwardOutput:
        """Write the sampled tokens into the token table (the next step reads them there) and
        describe them for the scheduler. `defer` (CUDA; no logprobs to serve): the tokens' copy to
        the host is only started, so this thread can launch the next step before the GPU finishes
        this one; SubmittedStep.result() waits for it. Constrained rows' tokens go to the grammar
        helper thread, which accepts them once they are on the host."""
        self.runner.memory.req_to_token.token_ids[fb.req_pool_indices, fb.seq_lens] = next_ids
        wants_logprobs = last is not None and any(n >= 0 for n in fi.top_logprobs_nums)
        if defer and self._cuda_index is not None and not wants_logprobs:
            out = ForwardOutput([], pending=PendingHost.start(next_ids))
        else:
            out = ForwardOutput(next_ids.tolist())
            if wants_logprobs:
                out.logprobs, out.top_logprobs = logprobs_of(last, next_ids, fi.top_logprobs_nums)
        if mask is not None:
            out.grammar_accepted = self.grammar.after_step(mask, out.pending or out.next_token_ids)
        return out

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
        row_of_tok, positions = to_device(row_of_tok, dev), to_device(positions, dev)
        mem.req_to_token.req_to_token[row_of_tok, positions] = to_device(fi.out_cache_loc, dev)
        if fi.new_token_ids:  # the leading tokens; a MIXED step's decode riders are on the device
            n = len(fi.new_token_ids)
            ids = to_device(torch.tensor(fi.new_token_ids, dtype=torch.int64), dev)
            mem.req_to_token.token_ids[row_of_tok[:n], positions[:n]] = ids
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
        rows, positions, seq_lens, loc = to_device(host, self.runner.device).unbind(0)
        mem.req_to_token.req_to_token[rows, positions] = loc
        input_ids = mem.req_to_token.token_ids[rows, positions]
        return self.runner.make_batch(fi.mode, input_ids, positions, loc, rows, fi.prefix_lens,
                                      fi.extend_lens, fi.return_all_logits, fi.global_mode,
                                      fi.global_num_tokens, seq_lens_dev=seq_lens, tbo=fi.tbo)
