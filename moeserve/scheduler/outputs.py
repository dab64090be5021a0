"""A request's sampled tokens: appended with their logprobs and checked for a finish, then sent
as a TokenOutput of what the client has not seen yet (the scheduler and PD's decode side)."""

from __future__ import annotations

from moeserve.core import FinishReason, Req
from moeserve.ipc.messages import TokenOutput
from moeserve.scheduler.stop import StopChecker


def append_token(stop: StopChecker, req: Req, token: int, logprobs, top_logprobs,
                 k: int) -> FinishReason | None:
    """One sampled token into the request (with its logprobs, entry k of the lists given);
    → why it finishes now, if it does."""
    req.output_ids.append(token)
    if logprobs and req.return_logprob:
        req.logprobs.append(logprobs[k])
        req.top_logprobs.append(top_logprobs[k])
    finish = stop.check(req)
    done_at = req.grammar.done_at if req.grammar is not None else None
    if finish is None and done_at is not None and len(req.output_ids) >= done_at:
        finish = FinishReason("stop", req.output_ids[-1])  # the grammar is complete
    return finish


def token_output(req: Req, draft_nodes: int) -> TokenOutput:
    """The tokens (and logprobs) not sent yet, and the prompt's logprobs once, when complete;
    marks them sent. draft_nodes: tokens a verify step proposes (spec.draft_nodes)."""
    new = req.output_ids[req.sent_len :]
    lp = req.logprobs[req.sent_len :] if req.return_logprob else None
    top = req.top_logprobs[req.sent_len :] if req.return_logprob else None
    req.sent_len = len(req.output_ids)
    f, plp = req.finish, req.prompt_logprobs
    prompt = plp is not None and plp.done and not plp.sent
    if prompt:
        plp.sent = True
    return TokenOutput(rid=req.rid, new_ids=new, finish_reason=f.type if f else None,
                       finish_matched=f.matched if f else None,
                       prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
                       cached_tokens=req.cached_tokens, logprobs=lp, top_logprobs=top,
                       spec_verify_steps=req.spec_verify_steps,
                       spec_draft_tokens=req.spec_verify_steps * draft_nodes,
                       spec_accepted_tokens=req.spec_accepted_tokens,
                       input_logprobs=plp.values if prompt else None,
                       input_top_logprobs=plp.tops if prompt and plp.top else None,
                       input_ranks=plp.ranks if prompt else None)
