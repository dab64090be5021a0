"""TreeSpecDecoder: the round of SpecDecoder with a draft tree (spec.topk = k > 1; tree.py).

The same three forwards as the chain, with the tree's nodes in place of the chain's positions:
  1. the draft expands the tree level by level: the draft extend left each request's top k after
     its last token (level 1); pass d runs the draft on the nodes of level d that have children,
     each with its parent's draft hidden state, and a child of rank r is the r-th of its parent's
     top k (N - 1 passes);
  2. the target verifies [x_L and every node] in one decode-shaped pass, node i at position
     L + depth(i) attending over the prefix, then its own ancestors (tree attention);
  3. the draft extend runs over the same nodes with the target's hidden states and writes the
     draft's KV at each node's slot; the request keeps the output at its last accepted node.

Tree attention without a masked kernel: each node is a one-token query of its own "virtual
request" whose table row (a scratch row of the ReqToTokenPool, never handed to requests) holds
the request's prefix slots and then its ancestors' slots. The draft's rows lag the target's by
one position (the draft reads at position p the token after p), so before the chain the rows hold
[prefix, ancestors at depth 1..d] and before the verify [prefix, x_L, ancestors at 1..d].

After the verify the accepted path's slots become the request's positions L + 1 .. L + a in its
own row, and the scheduler (`SpecPolicy.settle`, from `ForwardOutput.spec_paths`) keeps exactly
those slots and frees every other node's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.core import ForwardMode
from moeserve.runtime.step import ForwardInput, ForwardOutput
from moeserve.spec_mtp.decoder import SpecDecoder
from moeserve.spec_mtp.tree import TreeShape, greedy_tree_accept, tree_rejection_accept

if TYPE_CHECKING:
    from moeserve.runtime.model_runner import ModelRunner


class TreeSpecDecoder(SpecDecoder):
    def __init__(self, runner: ModelRunner, worker, shape: TreeShape):
        super().__init__(runner, worker, shape.depth)
        self.shape, self.m = shape, shape.nodes
        table, dev = runner.memory.req_to_token, runner.device
        self.next_draft = torch.zeros(table.size, shape.topk, dtype=torch.int64, device=dev)
        self.scratch_base, self.scratch_rows = table.size, table.scratch
        self.depths = shape.depths()  # [M + 1], host
        self.depth_dev = torch.tensor(self.depths, device=dev)
        anc = shape.ancestors()[1:]  # [M, N]: each node's ancestors by depth
        node, col = (anc >= 0).nonzero(as_tuple=True)  # the (node, depth) pairs that exist
        self.anc_node, self.anc_col = node.to(dev), col.to(dev)
        self.anc_of = anc[node, col].to(dev)  # index of that ancestor
        self.levels = self._draft_plan(dev)

    def _draft_plan(self, dev: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """Per draft pass d = 1 .. N-1: (the depth-d nodes that have children, each one's parent
        among the previous pass's nodes (the root for d = 1), the depth-(d+1) nodes, each one's
        parent among this pass's nodes, its rank). Level 1 comes from the draft extend; a node
        without children is not run."""
        shape, plan, prev = self.shape, [], [0]
        for d in range(1, self.n):
            run = [i for i in shape.level(d) if shape.children(i)]
            src = [prev.index(shape.parent[i]) for i in run]
            kids = [c for i in run for c in shape.children(i)]
            kid_src = [run.index(shape.parent[c]) for c in kids]
            plan.append(tuple(torch.tensor(x, dtype=torch.int64, device=dev)
                              for x in (run, src, kids, kid_src, [shape.rank[c] for c in kids])))
            prev = run
        return plan

    def _first_drafts(self, logits: torch.Tensor) -> torch.Tensor:
        return self.draft.topk_tokens(logits, self.shape.topk)

    # ---- geometry -------------------------------------------------------------------------------
    def _geometry(self, fi: ForwardInput):
        """(rows [B], starts [B] = L, positions [B, M+1] = L + depth, slots [B, M+1], scratch
        rows [B, M]); the root's slot goes to position L of the request row and every node's
        scratch row gets the request's prefix."""
        dev, b, w = self.runner.device, len(fi.rows), self.m + 1
        if b * self.m > self.scratch_rows:
            raise RuntimeError(f"a draft tree verify of {b} requests needs {b * self.m} scratch "
                               f"rows, the table has {self.scratch_rows}")
        host = torch.empty((2, b), dtype=torch.int64)
        host[0], host[1] = torch.tensor(fi.rows), torch.tensor(fi.prefix_lens)
        rows, starts = host.to(dev).unbind(0)
        positions = starts[:, None] + self.depth_dev
        slots = fi.out_cache_loc.to(dev).view(b, w)
        tab = self.runner.memory.req_to_token.req_to_token
        tab[rows, starts] = slots[:, 0]
        scratch = self.scratch_base + torch.arange(b * self.m, device=dev).view(b, self.m)
        longest = max(fi.prefix_lens)
        tab[scratch.view(-1), :longest] = tab[rows.repeat_interleave(self.m), :longest]
        return rows, starts, positions, slots, scratch

    def _fill_rows(self, geo, target: bool) -> None:
        """Each node's scratch row past the prefix: its ancestors' slots (depth 1 .. its own),
        from position L (the draft's layout) or L + 1 after x_L's slot (the target's)."""
        rows, starts, _, slots, scratch = geo
        tab = self.runner.memory.req_to_token.req_to_token
        off = int(target)
        tab[scratch[:, self.anc_node], starts[:, None] + off + self.anc_col] = \
            slots[:, self.anc_of]
        if target:
            tab[scratch, starts[:, None].expand_as(scratch)] = slots[:, :1].expand_as(scratch)

    # ---- the round ------------------------------------------------------------------------------
    def _draft_chain(self, fi: ForwardInput, geo) -> torch.Tensor:
        """→ node tokens [B, M+1] (the root's entry is filled by the verify)."""
        rows, starts, _, slots, scratch = geo
        b, k = len(fi.rows), self.shape.topk
        tokens = torch.zeros((b, self.m + 1), dtype=torch.int64, device=rows.device)
        first = self.shape.level(1)
        ranks = [self.shape.rank[i] for i in first]
        tokens[:, first.start: first.stop] = self.next_draft[rows][:, ranks]
        self._fill_rows(geo, target=False)
        hidden = self.hidden[rows][:, None]  # [B, 1, H]: the root's draft state
        for d, (run, src, kids, kid_src, kid_rank) in enumerate(self.levels, start=1):
            count = len(run)
            pos = (starts + (d - 1)).repeat_interleave(count)
            fb = self.runner.make_batch(
                ForwardMode.DECODE, tokens[:, run].reshape(-1), pos, slots[:, run].reshape(-1),
                scratch[:, run - 1].reshape(-1),
                [p + d - 1 for p in fi.prefix_lens for _ in range(count)], [1] * (b * count),
                global_mode=ForwardMode.DECODE, seq_lens_dev=pos + 1)
            logits, out = self._draft_step(fb, hidden[:, src].reshape(b * count, -1))
            top = self.draft.topk_tokens(logits, k).view(b, count, k)
            tokens[:, kids] = top[:, kid_src, kid_rank]
            hidden = out.view(b, count, -1)
        return tokens

    def _verify(self, fi: ForwardInput, geo, tokens: torch.Tensor):
        rows, starts, positions, slots, scratch = geo
        b, w, n, runner = len(fi.rows), self.m + 1, self.n, self.runner
        table = runner.memory.req_to_token.token_ids
        tokens[:, 0] = table[rows, starts]
        self._fill_rows(geo, target=True)
        flat = positions.reshape(-1)
        fb = runner.make_batch(ForwardMode.DECODE, tokens.view(-1), flat, slots.reshape(-1),
                               torch.cat([rows[:, None], scratch], 1).view(-1),
                               [p + d for p in fi.prefix_lens for d in self.depths], [1] * (b * w),
                               False, fi.global_mode, fi.global_num_tokens, seq_lens_dev=flat + 1)
        self._share_prefix(fb, fi.prefix_lens, w)
        logits, scored, hidden, target_ids = self._verify_forward(fi, fb, None)
        target_ids = target_ids.view(b, w)
        path, accepted = greedy_tree_accept(self.shape, tokens, target_ids)
        on_path = torch.cat([torch.zeros_like(path[:, :1]), path], 1)  # [B, N+1], root first
        emit = torch.zeros((b, n + 1), dtype=torch.int64, device=rows.device)
        emit[:, :n] = tokens.gather(1, path)
        emit.scatter_(1, accepted[:, None],
                      target_ids.gather(1, on_path.gather(1, accepted[:, None])))
        sampled = [i for i, p in enumerate(fi.sampling) if not p.is_greedy]
        if sampled:
            self._resample_tree(fi, scored.view(b, w, -1), tokens, path, accepted, emit, sampled)
            on_path = torch.cat([torch.zeros_like(path[:, :1]), path], 1)
        last = on_path.gather(1, accepted[:, None])  # [B, 1]: the last accepted node
        steps = torch.arange(n + 1, device=rows.device)
        table[rows[:, None], starts[:, None] + 1 + steps] = emit
        req_tab = runner.memory.req_to_token.req_to_token
        req_tab[rows[:, None], starts[:, None] + 1 + steps[:n]] = slots.gather(1, path)
        # the draft extend reads the token after each node: the emitted one along the path
        draft_ids = target_ids.clone()
        for j in range(n + 1):
            idx = on_path[:, j: j + 1]
            keep = draft_ids.gather(1, idx)
            draft_ids.scatter_(1, idx, torch.where(accepted[:, None] >= j, emit[:, j: j + 1], keep))
        host = torch.cat([accepted[:, None], path, emit], 1).tolist()  # one device -> host copy
        spec_tokens = [r[1 + n: 2 + n + r[0]] for r in host]
        out = ForwardOutput([t[0] for t in spec_tokens], spec_tokens=spec_tokens,
                            spec_paths=[r[1: 1 + r[0]] for r in host])
        if any(x >= 0 for x in fi.top_logprobs_nums):
            picked = logits.view(b, w, -1).gather(
                1, on_path[:, :, None].expand(b, n + 1, logits.shape[-1]))
            self._logprobs(out, fi, picked, spec_tokens)
        pick = torch.arange(b, device=rows.device) * w + last[:, 0]
        return out, fb, hidden, draft_ids.view(-1), pick

    def _resample_tree(self, fi: ForwardInput, logits: torch.Tensor, tokens: torch.Tensor,
                       path: torch.Tensor, accepted: torch.Tensor, emit: torch.Tensor,
                       rows: list[int]) -> None:
        """Sampled requests: the tree's rejection rule (tree.py) replaces their greedy walk in
        path / accepted / emit (in place)."""
        host_tokens = tokens[rows].tolist()
        for i, node_tokens in zip(rows, host_tokens):
            emitted, nodes = tree_rejection_accept(self.shape, logits[i], node_tokens,
                                                   fi.sampling[i], fi.generators[i])
            dev = path.device
            path[i] = 0
            if nodes:
                path[i, : len(nodes)] = torch.tensor(nodes, device=dev)
            accepted[i] = len(nodes)
            emit[i, : len(emitted)] = torch.tensor(emitted, device=dev)
