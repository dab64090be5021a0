"""SpecDecoder: runs every step of a speculating rank — draft chain, target pass, draft extend.

Every step is the same sequence of forwards on every rank, so that the collectives inside MoE
layers (the MTP layer's too) match under DP attention + EP:
  1. N-1 draft decode forwards, when any rank verifies this step (IDLE on the others);
  2. the target forward: EXTEND (prefill), DECODE (a plain step: the batch stepped aside from
     speculation), TARGET_VERIFY (over [last token, d_1..d_N] per request) or IDLE;
  3. one draft forward over the target pass's positions ("draft extend"), with the target's
     hidden states and the tokens that follow each position, which writes the draft's KV for
     the accepted positions and yields d_1 and its hidden state for the next round.
Shapes never depend on what was accepted: the draft extend after a verify covers all N+1
positions (rows past the accepted ones see only earlier positions, and their KV slots are freed by
the scheduler), and picks each request's output at its last accepted position.

Per request row the decoder keeps d_1 (`next_draft`) and the draft's hidden state (`hidden`),
written by the draft extend and read by the next verify step's chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.runtime.grammar_steps import VerifyMask
from moeserve.runtime.prompt_logprobs import score_spans
from moeserve.runtime.sampler import greedy, logprobs_of
from moeserve.runtime.step import ForwardInput, ForwardOutput
from moeserve.spec_mtp.accept import greedy_accept, rejection_accept

if TYPE_CHECKING:
    from moeserve.runtime.model_runner import ModelRunner

VERIFY = int(ForwardMode.TARGET_VERIFY)


class SpecDecoder:
    def __init__(self, runner: ModelRunner, worker, num_steps: int):
        """`worker`: the ForwardWorker (prepares inputs and samples plain steps)."""
        self.runner, self.worker, self.n = runner, worker, num_steps
        self.draft = runner.draft
        rows, dev = runner.memory.req_to_token.size, runner.device
        self.next_draft = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(rows, runner.hf_config.hidden_size, dtype=runner.dtype,
                                  device=dev)

    @torch.inference_mode()
    def run(self, fi: ForwardInput) -> ForwardOutput:
        if fi.mode == ForwardMode.TARGET_VERIFY:
            geo = self._geometry(fi)
            drafts = self._draft_chain(fi, geo)
            out, fb, hidden, draft_ids, pick = self._verify(fi, geo, drafts)
        else:
            if self._any_verify(fi):
                for _ in range(self.n - 1):
                    self._draft_idle(fi)
            out, fb, hidden, draft_ids, pick = self._target(fi)
        self._draft_extend(fb, hidden, draft_ids, pick, fi.rows)
        return out

    # ---- a request's draft state, moved by PD disaggregation ---------------------------------
    def draft_state(self, row: int) -> tuple[list[int], bytes]:
        """Row `row`'s next proposal(s) and draft hidden state, as the last draft extend left
        them (host copies: on CUDA, call once the step that wrote them ended)."""
        ids = self.next_draft[row].reshape(-1).tolist()
        hidden = self.hidden[row].detach().cpu().contiguous()
        return ids, hidden.view(torch.uint8).numpy().tobytes()

    def set_draft_state(self, row: int, ids: list[int], hidden: bytes) -> str | None:
        """Row `row` starts from another server's draft state (PD: its prefill's); → why not
        when the shapes differ (a different draft, tree or dtype), None when set."""
        want = self.hidden[row].numel() * self.hidden.element_size()
        if len(ids) != self.next_draft[row].numel() or len(hidden) != want:
            return (f"draft state of {len(ids)} ids and {len(hidden)} bytes, this server's is "
                    f"{self.next_draft[row].numel()} ids and {want} bytes")
        dev = self.hidden.device
        self.next_draft[row] = torch.tensor(ids, dtype=torch.int64).view_as(
            self.next_draft[row]).to(dev)
        raw = torch.frombuffer(bytearray(hidden), dtype=torch.uint8)
        self.hidden[row] = raw.view(self.hidden.dtype).to(dev)
        return None

    # ---- DP lockstep ----------------------------------------------------------------------------
    @staticmethod
    def _any_verify(fi: ForwardInput) -> bool:
        return VERIFY in (fi.global_modes or [int(fi.mode)])

    def _chain_counts(self, fi: ForwardInput) -> list[int] | None:
        """Every rank's token count in a draft chain forward: its verifying requests."""
        if fi.global_num_tokens is None:
            return None
        modes = fi.global_modes or [int(fi.mode)] * len(fi.global_num_tokens)
        return [n // (self.n + 1) if m == VERIFY else 0
                for n, m in zip(fi.global_num_tokens, modes)]

    def _draft_idle(self, fi: ForwardInput) -> None:
        empty = torch.empty(0, dtype=torch.int64)
        fb = self.runner.make_batch(ForwardMode.IDLE, empty, empty, empty, [], [], [],
                                    global_mode=ForwardMode.DECODE,
                                    global_num_tokens=self._chain_counts(fi))
        self._draft_forward(fb, fb.input_ids, self.hidden[:0])

    # ---- the verify round -----------------------------------------------------------------------
    def _geometry(self, fi: ForwardInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [B], positions [B, N+1] = L..L+N, slots [B, N+1]) on the device; the slots are
        written into the request rows (the draft chain writes its KV at the first N-1)."""
        dev, b, w = self.runner.device, len(fi.rows), self.n + 1
        host = torch.empty((2, b), dtype=torch.int64)
        host[0], host[1] = torch.tensor(fi.rows), torch.tensor(fi.prefix_lens)
        rows, starts = host.to(dev).unbind(0)
        positions = starts[:, None] + torch.arange(w, device=dev)
        slots = fi.out_cache_loc.to(dev).view(b, w)
        self.runner.memory.req_to_token.req_to_token[rows[:, None], positions] = slots
        return rows, positions, slots

    def _draft_chain(self, fi: ForwardInput, geo) -> torch.Tensor:
        """d_1 (kept from the last draft extend), then d_2..d_N one draft decode each: step k
        reads d_k at position L+k-1 with the previous draft hidden state. → drafts [B, N]."""
        rows, positions, slots = geo
        drafts = torch.empty((len(fi.rows), self.n), dtype=torch.int64, device=rows.device)
        drafts[:, 0] = self.next_draft[rows]
        hidden = self.hidden[rows]
        counts = self._chain_counts(fi)
        for k in range(1, self.n):
            pos = positions[:, k - 1].contiguous()
            fb = self.runner.make_batch(
                ForwardMode.DECODE, drafts[:, k - 1].contiguous(), pos, slots[:, k - 1], rows,
                [p + k - 1 for p in fi.prefix_lens], [1] * len(fi.rows),
                global_mode=ForwardMode.DECODE, global_num_tokens=counts, seq_lens_dev=pos + 1)
            logits, hidden = self._draft_step(fb, hidden)
            drafts[:, k] = self.draft.tokens(logits)
        return drafts

    def _verify(self, fi: ForwardInput, geo, drafts: torch.Tensor):
        """The target over [x_L, d_1..d_N] per request; → (output, batch, hidden, the tokens
        after each position for the draft extend, each request's last accepted row)."""
        rows, positions, slots = geo
        b, w, runner = len(fi.rows), self.n + 1, self.runner
        table = runner.memory.req_to_token.token_ids
        table[rows[:, None], positions[:, 1:]] = drafts
        # B (N+1) one-token queries, query i of a request over its positions [0, L+i]: a decode
        # batch of "virtual requests" sharing the request's row (causal among the drafts), so
        # the decode kernels and CUDA graphs run it; every backend stores the batch's K/V
        # before attending (the CPU kernel reads a request's prefix once: `_share_prefix`).
        flat = positions.reshape(-1)
        fb = runner.make_batch(ForwardMode.DECODE, table[rows[:, None], positions].view(-1), flat,
                               slots.reshape(-1), rows.repeat_interleave(w),
                               [p + i for p in fi.prefix_lens for i in range(w)], [1] * (b * w),
                               False, fi.global_mode, fi.global_num_tokens, seq_lens_dev=flat + 1)
        self._share_prefix(fb, fi.prefix_lens, w)
        grammar = self.worker.grammar
        vmask = grammar.verify_mask(fi, drafts)  # constrained requests: masks along the drafts
        # [B (N+1), V] raw logits (for logprobs), the ones acceptance reads (masked where a
        # grammar applies), [.., H], the argmax of the latter [..]
        logits, scored, hidden, tokens = self._verify_forward(fi, fb, vmask)
        tokens = tokens.view(b, w)  # the target's argmax at every position
        accepted = greedy_accept(tokens, drafts)  # [B]
        sampled = [i for i, p in enumerate(fi.sampling) if not p.is_greedy]
        if sampled:
            self._resample(fi, scored.view(b, w, -1), drafts, tokens, accepted, sampled)
        table[rows[:, None], positions + 1] = tokens
        host = torch.cat([accepted[:, None], tokens], dim=1).tolist()  # one device → host copy
        spec_tokens = [r[1 : r[0] + 2] for r in host]
        if vmask is not None:
            grammar.accept_blocks(vmask, fi.grammars, spec_tokens)
        out = ForwardOutput([t[0] for t in spec_tokens], spec_tokens=spec_tokens)
        if any(n >= 0 for n in fi.top_logprobs_nums):
            self._logprobs(out, fi, logits.view(b, w, -1), spec_tokens)
        pick = torch.arange(b, device=rows.device) * w + accepted
        return out, fb, hidden, tokens.view(-1), pick

    def _share_prefix(self, fb: ForwardBatch, prefix_lens: list[int], w: int) -> None:
        """A verify batch's w rows of a request share its positions [0, L] (the prefix and x_L):
        on CPU the decode kernel then reads them once per request, for the verify and the draft
        extend that reuses the batch."""
        if self.runner.device.type == "cpu":
            fb.shared_prefix = torch.tensor([[0] + [p + 1] * (w - 1) for p in prefix_lens],
                                            dtype=torch.int64).view(-1)

    def _verify_forward(self, fi: ForwardInput, fb: ForwardBatch, vmask: VerifyMask | None):
        """The verify pass → (logits [T, V] or None, the same with `vmask` applied (in place
        unless logprobs need the raw ones), hidden [T, H], argmax of the masked logits [T]).
        Greedy-only batches (no grammar among them) on an eager CPU runner with the fused greedy
        LM head (as plain greedy decode steps use: the argmax without writing T x V logits) get
        no logits."""
        runner = self.runner
        if runner.graph_runner is None and runner.greedy_head is not None and fi.greedy_only():
            hidden = runner.forward_hidden(fb)
            ids = runner.cpu_kernels.greedy_head(hidden, runner.greedy_head,
                                                 runner.hf_config.vocab_size)
            if ids is not None:
                return None, None, hidden, ids
            logits = runner.model.compute_logits(hidden)  # some logit is NaN
        else:
            logits, hidden = runner.forward_with_hidden(fb)
        scored = logits
        if vmask is not None:  # logprobs keep the raw distribution (as plain steps do)
            raw_needed = any(n >= 0 for n in fi.top_logprobs_nums)
            scored = self.worker.grammar.apply(logits, vmask.mask, copy=raw_needed)
        return logits, scored, hidden, greedy(scored)

    @staticmethod
    def _resample(fi: ForwardInput, logits: torch.Tensor, drafts: torch.Tensor,
                  tokens: torch.Tensor, accepted: torch.Tensor, rows: list[int]) -> None:
        """Sampled requests: rejection sampling against the processed target distribution
        (accept.py) replaces their greedy answer in `tokens` / `accepted` (in place)."""
        host_drafts = drafts[rows].tolist()
        for i, d in zip(rows, host_drafts):
            emitted = rejection_accept(logits[i], d, fi.sampling[i], fi.generators[i])
            tokens[i, : len(emitted)] = torch.tensor(emitted, device=tokens.device)
            accepted[i] = len(emitted) - 1

    def _logprobs(self, out: ForwardOutput, fi: ForwardInput, logits: torch.Tensor,
                  spec_tokens: list[list[int]]) -> None:
        """Raw-distribution logprobs of each emitted token at its verified position."""
        out.spec_logprobs, out.spec_top_logprobs = [], []
        for i, toks in enumerate(spec_tokens):
            n = fi.top_logprobs_nums[i]
            if n < 0:
                out.spec_logprobs.append([])
                out.spec_top_logprobs.append([])
                continue
            ids = torch.tensor(toks, device=logits.device)
            chosen, tops = logprobs_of(logits[i, : len(toks)], ids, [n] * len(toks))
            out.spec_logprobs.append(chosen)
            out.spec_top_logprobs.append(tops)

    # ---- plain target steps (prefill, stepped-aside decode, idle) ---------------------------------
    def _target(self, fi: ForwardInput):
        """A step the target samples as without speculation, keeping the hidden states the draft
        extend reads (every position of a prefill chunk)."""
        runner, fb = self.runner, self.worker._prepare(fi)
        extend = fi.mode == ForwardMode.EXTEND
        if not extend and not fi.return_all_logits:  # DECODE, IDLE: CUDA graphs where captured
            logits, hidden = runner.forward_with_hidden(fb)  # [B, V], [B, H]
        else:
            fb.return_all_logits = extend
            hidden = runner.forward_hidden(fb)  # EXTEND: [T, H]
            logits = None
        if fi.mode == ForwardMode.IDLE:
            return ForwardOutput([]), fb, hidden, fb.input_ids, None
        last_idx = fb.last_token_indices() if extend else None
        last = hidden[last_idx] if extend else hidden
        if logits is None:
            logits = runner.model.compute_logits(hidden if fi.return_all_logits else last)
        if not fi.greedy_only() or fi.return_all_logits:
            logits = logits.float()
        out = self.worker.sample_step(fi, fb, logits)
        if fi.prompt_spans:  # EXTEND: hidden holds every position
            out.prompt_scores = score_spans(runner.model.compute_logits, hidden, fi.prompt_spans)
        next_ids = torch.tensor(out.next_token_ids, dtype=torch.int64, device=hidden.device)
        if not extend:
            return out, fb, hidden, next_ids, torch.arange(len(fi.rows), device=hidden.device)
        # the token after each position: the chunk's next one, after its last the next prompt
        # token (a partial chunk) or the sampled one
        after = torch.roll(fb.input_ids, -1)
        nxt = torch.tensor(fi.next_prompt_ids or [-1] * len(fi.rows), dtype=torch.int64,
                           device=hidden.device)
        after[last_idx] = torch.where(nxt >= 0, nxt, next_ids)
        return out, fb, hidden, after, last_idx

    # ---- the draft extend -----------------------------------------------------------------------
    def _draft_extend(self, fb: ForwardBatch, hidden: torch.Tensor, draft_ids: torch.Tensor,
                      pick: torch.Tensor | None, rows: list[int]) -> None:
        """The draft over the target pass's positions (its KV there), then d_1 and the draft
        hidden state of each request from its row `pick`."""
        graphs = self.runner.draft_graphs
        bs = graphs.bucket_of_step(fb) if graphs is not None and fb.batch_size else None
        if bs is not None:  # after a verify or a plain decode step: decode-shaped
            fb.input_ids = draft_ids
            logits, out = graphs.replay_draft(fb, hidden, bs)
            logits = logits[pick] if pick is not None else None
        else:
            out, logits = self._draft_forward(fb, draft_ids, hidden), None
        if pick is None or not rows:
            return
        chosen = out[pick]
        if logits is None:
            logits = self.draft.logits(chosen)
        row_t = torch.tensor(rows, dtype=torch.int64).to(chosen.device)
        self.next_draft[row_t] = self._first_drafts(logits)
        self.hidden[row_t] = chosen

    def _first_drafts(self, logits: torch.Tensor) -> torch.Tensor:
        """What a request keeps from the draft extend for its next round: d_1 (a tree: its
        first level, the top k)."""
        return self.draft.tokens(logits)

    def _draft_step(self, fb: ForwardBatch, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step → (draft logits, draft hidden): replayed where captured."""
        graphs = self.runner.draft_graphs
        bs = graphs.bucket_of_step(fb) if graphs is not None else None
        if bs is not None:
            return graphs.replay_draft(fb, hidden, bs)
        hidden = self._draft_forward(fb, fb.input_ids, hidden)
        return self.draft.logits(hidden), hidden

    def _draft_forward(self, fb: ForwardBatch, input_ids: torch.Tensor,
                       hidden: torch.Tensor) -> torch.Tensor:
        fb.tbo, fb.micro_batch = False, False
        self.runner.attn_backend.init_forward_metadata(fb)
        return self.draft.forward(fb, input_ids, hidden)
