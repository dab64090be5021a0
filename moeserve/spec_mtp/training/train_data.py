"""Self-distillation data for the NextN trainer: the target's own greedy answers and hidden states.

The head must agree with the target's greedy tokens, so the labels are the target's generations,
not human text: each chat prompt is answered greedily by the target, and h at every position of
prompt + answer comes from the passes that made the answer (or, with `--generator hf`, a forward
hooked during transformers' generate). Records are cached as shards under
DIR/data/ (tokens, prompt length, float32 hidden states) with a manifest that pins the model,
prompts and lengths, so a resumed or repeated run reuses them instead of generating again.

Measured on the 2-core CPU: transformers' batched `generate` (float32, hidden states hooked out
of the final norm) made 230 tok/s on a quiet AVX-512 machine and 30-60 on a busy one. The
project's runner in serving's dtype is faster and gives the states serving sees: `EngineGenerator`
runs the greedy loop on it and keeps each pass's hidden states (on an AVX2 machine, 256 prompts:
281 tok/s for answers and states together, where the Engine's generate plus a second EXTEND pass
for the states made 133). So it is the default, `generate_hf` the option (`--generator hf`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable

import torch

SHARD_PROMPTS = 128  # prompts per cached shard: the unit of work lost when a run is interrupted
TOPK = 16  # the target's top tokens kept per position: the trainer's hard negatives


def resolve_target(model: str | None, out: str) -> str:
    """An HF checkpoint folder for --model: the embedded SmolLM2 when None; a .gguf file is
    converted once (as the embedded model is) into DIR/target/."""
    from moeserve.models import embedded

    if model is None:
        return embedded.embedded_model_path()
    if model.endswith(".gguf"):
        target = os.path.join(out, "target")
        if not os.path.isfile(os.path.join(target, "config.json")):
            embedded._convert(model, target)
        return target
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"--model {model}: not a .gguf file or a folder with config.json")
    return model


def load_target(path: str):
    """The frozen float32 target (eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each user message in the tokenizer's chat template, assistant turn opened."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


class EngineGenerator:
    """Greedy answers and hidden states from the project's runner in the dtype serving uses
    (model.dtype=auto: bfloat16 where bf16 linears are fast, resolve_dtype), started once
    through the offline Engine and kept for every shard. `generate_with_hidden` runs the greedy
    loop on the runner itself and keeps the final (post-norm) hidden state of every position it
    computes: the prompt's from the prefill, each answer token's from the decode step that reads
    it. The answers are the served target's own (greedy_of_hidden is forward_greedy's choice),
    and the hidden states are the ones the passes that made them computed, so no second pass
    is needed: on an AVX2 CPU (bf16 through the C linear kernel, 256 prompts, ~30k answer
    tokens) the old way, the Engine's generate and then an EXTEND pass over prompt + answer for
    the hidden states, took 128 s + 90 s, and this one 107 s."""

    def __init__(self, model_path: str, max_new: int, concurrency: int,
                 dtype: str = "auto", prefill_tokens: int = 2048):
        self.model_path, self.max_new, self.concurrency = model_path, max_new, concurrency
        self.dtype, self.prefill_tokens = dtype, prefill_tokens  # tokens per prefill pass
        self.tag = f"engine-{dtype}"  # in the data cache's fingerprint
        self.engine: Any = None

    def __call__(self, prompt_ids: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
        if self.engine is None:
            from moeserve import Engine

            overrides = ["device=cpu", f"model.dtype={self.dtype}",
                         f"cache.max_running_requests={self.concurrency}",
                         f"cache.max_total_tokens={self.concurrency * (self.max_new + 256)}"]
            self.engine = Engine(self.model_path, overrides=overrides)
        eos = self.engine.scheduler.stop.eos_token_ids
        capacity = self.engine.runner.memory.allocator.available_size()
        out, i = [], 0
        while i < len(prompt_ids):  # groups of `concurrency` rows whose KV fits the pool
            j, need = i, 0
            while (j < len(prompt_ids) and j - i < self.concurrency
                   and (j == i or need + len(prompt_ids[j]) + self.max_new <= capacity)):
                need += len(prompt_ids[j]) + self.max_new
                j += 1
            out += generate_with_hidden(self.engine.runner, prompt_ids[i:j], self.max_new, eos,
                                        self.prefill_tokens)
            i = j
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


@torch.inference_mode()
def generate_with_hidden(runner, prompts: list[list[int]], max_new: int, eos: set[int],
                         prefill_tokens: int = 2048) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers (cut after the first `eos` id or `max_new` tokens, the EOS kept, as the
    scheduler emits them) and float32 final hidden states [len(prompt + answer), H], by prefill
    passes of at most `prefill_tokens` tokens (one prompt at least) and then decode steps over
    the unfinished rows. A finished answer's last token is still fed once, for its hidden state.
    Uses `runner`'s KV pools directly: the scheduler must be idle."""
    from moeserve.core import ForwardMode

    mem, n = runner.memory, len(prompts)
    lens = [len(p) for p in prompts]
    rows = mem.req_to_token.alloc(n)
    slots = mem.allocator.alloc(sum(lens) + n * max_new) if rows is not None else None
    if slots is None:
        if rows is not None:
            mem.req_to_token.free(rows)
        raise RuntimeError("the KV pool cannot hold the generation batch: lower --concurrency")
    try:
        per_seq = list(slots.split([m + max_new for m in lens]))
        for row, s in zip(rows, per_seq):
            mem.req_to_token.write(row, 0, s)
        hidden: list[list[torch.Tensor]] = [[] for _ in range(n)]
        answers: list[list[int]] = [[] for _ in range(n)]
        i = 0
        while i < n:  # prefill: every prompt position's hidden state, the first answer token
            j, tokens = i + 1, lens[i]
            while j < n and tokens + lens[j] <= prefill_tokens:
                tokens, j = tokens + lens[j], j + 1
            group = range(i, j)
            fb = runner.make_batch(
                ForwardMode.EXTEND, [t for g in group for t in prompts[g]],
                [p for g in group for p in range(lens[g])],
                torch.cat([per_seq[g][: lens[g]] for g in group]), [rows[g] for g in group],
                [0] * len(group), [lens[g] for g in group], return_all_logits=True)
            h = runner.forward_hidden(fb)
            for g, part in zip(group, h.split([lens[g] for g in group])):
                hidden[g].append(part.to(torch.float32, copy=True))  # not a view of h
            last = torch.tensor(lens[i:j]).cumsum(0) - 1  # each prompt's last row in h
            for g, tok in zip(group, runner.greedy_of_hidden(h[last]).tolist()):
                answers[g].append(int(tok))
            i = j
        fed = [0] * n
        while active := [g for g in range(n) if fed[g] < len(answers[g])]:
            pos = [lens[g] + fed[g] for g in active]
            fb = runner.make_batch(
                ForwardMode.DECODE, [answers[g][fed[g]] for g in active], pos,
                torch.stack([per_seq[g][p] for g, p in zip(active, pos)]),
                [rows[g] for g in active], pos, [1] * len(active))
            h = runner.forward_hidden(fb)
            toks = runner.greedy_of_hidden(h).tolist()
            for k, g in enumerate(active):
                hidden[g].append(h[k: k + 1].to(torch.float32, copy=True))
                fed[g] += 1
                if answers[g][-1] not in eos and len(answers[g]) < max_new:
                    answers[g].append(int(toks[k]))
        return [(a, torch.cat(hs)) for a, hs in zip(answers, hidden)]
    finally:
        mem.allocator.free(slots)
        mem.req_to_token.free(rows)


@torch.no_grad()
def generate_hf(model, tokenizer, prompt_ids: list[list[int]], max_new: int,
                batch: int) -> list[tuple[list[int], torch.Tensor | None]]:
    """Greedy answers from transformers' batched generate (left padding), cut after EOS, with
    the hidden states the generation computed anyway (a hook on the final norm), so no second
    forward is needed. One extra token is generated and dropped: the step that feeds the last
    kept token in is the one that computes its hidden state. None: not captured (every row
    ended early), the caller runs the forward."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.append(o))
    results: list[tuple[list[int], torch.Tensor | None]] = []
    try:
        for i in range(0, len(prompt_ids), batch):
            chunk = prompt_ids[i: i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
            captured.clear()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new + 1,
                                 do_sample=False, pad_token_id=pad)
            hidden = torch.cat(captured, dim=1)  # [B, width + steps, H] over padded positions
            for b, row in enumerate(out[:, width:].tolist()):
                cut = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
                answer = row[: min(cut, max_new)]
                end = width + len(answer)
                h = hidden[b, width - len(chunk[b]): end] if end <= hidden.shape[1] else None
                results.append((answer, None if h is None else h.contiguous()))
    finally:
        hook.remove()
    return results


@torch.no_grad()
def hidden_states(model, tokens: list[int]) -> torch.Tensor:
    """The target's post-norm final hidden states [L, H] (transformers' hidden_states[-1])."""
    ids = torch.tensor([tokens])
    return model.model(input_ids=ids).last_hidden_state[0].contiguous()


@torch.no_grad()
def target_topk(model, hidden: torch.Tensor, k: int = TOPK) -> torch.Tensor:
    """The target's k most likely next tokens at every position, int32 [L, k] (column 0 is its
    greedy token)."""
    weight = model.get_output_embeddings().weight
    return torch.cat([(h @ weight.T).topk(k, dim=-1).indices.int()
                      for h in hidden.split(1024)])


def model_fingerprint(model_path: str) -> str:
    """The checkpoint's identity for the data cache: its weight/config files' sizes and times."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_path)):
        if name.endswith((".safetensors", "config.json")):
            st = os.stat(os.path.join(model_path, name))
            h.update(f"{name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


class SplitCache:
    """DIR/data/{split}-NNNN.pt shards + {split}.json: each shard's fingerprint (model, its
    prompts, max_new_tokens). A shard is reused only when its fingerprint matches, so growing
    the prompt count keeps the shards already made and another model regenerates them all."""

    def __init__(self, out: str, split: str):
        self.dir = os.path.join(out, "data")
        self.split = split
        os.makedirs(self.dir, exist_ok=True)
        self.manifest: dict[str, str] = {}
        if os.path.exists(self._manifest_path()):
            with open(self._manifest_path()) as f:
                self.manifest = json.load(f).get("shards", {})

    def _manifest_path(self) -> str:
        return os.path.join(self.dir, f"{self.split}.json")

    def shard_path(self, i: int) -> str:
        return os.path.join(self.dir, f"{self.split}-{i:04d}.pt")

    def has(self, i: int, fp: str) -> bool:
        return self.manifest.get(str(i)) == fp and os.path.exists(self.shard_path(i))

    def save(self, i: int, fp: str, records: list[dict[str, Any]]) -> None:
        tmp = self.shard_path(i) + ".tmp"
        torch.save(records, tmp)
        os.replace(tmp, self.shard_path(i))
        self.manifest[str(i)] = fp
        with open(self._manifest_path() + ".tmp", "w") as f:
            json.dump({"shards": self.manifest}, f, indent=1)
        os.replace(self._manifest_path() + ".tmp", self._manifest_path())

    def load(self, i: int, model, topk: bool = True) -> list[dict[str, Any]]:
        records = torch.load(self.shard_path(i), weights_only=True)
        for r in records:  # shards written without the top-k field
            if topk and "topk" not in r:
                r["topk"] = target_topk(model, r["hidden"])
        return records


def make_records(model, chunk: list[list[int]], generated: list[tuple],
                 topk: bool = True) -> list[dict]:
    """`topk`: keep the target's top-K per position (the candidate loss's negatives; a draft
    vocabulary's loss scores all of its tokens and needs none)."""
    records = []
    for p, (a, hidden) in zip(chunk, generated, strict=True):
        if hidden is None:
            hidden = hidden_states(model, p + a)
        r = {"tokens": torch.tensor(p + a, dtype=torch.int32), "prompt_len": len(p),
             "hidden": hidden}
        if topk:
            r["topk"] = target_topk(model, hidden)
        records.append(r)
    return records


def build_split(out: str, split: str, model_path: str, model, tokenizer, prompts: list[str],
                max_new: int, generate: Callable[[list[list[int]]], list[tuple]],
                log: Callable[[str], None] = print, deadline: float | None = None,
                max_shards: int | None = None, topk: bool = True) -> list[dict[str, Any]]:
    """Records {"tokens" int32 [L], "prompt_len", "hidden" float32 [L, H], "topk" int32 [L, K]
    (only with `topk`)}
    for the prompts, shard by shard, generating the shards that are not cached. Once `deadline`
    (time.time()) has passed, no new shard is started (at least one is made), so a slow CPU
    trains on less data instead of overrunning the budget; `max_shards` caps the shards used."""
    prompt_ids = chat_ids(tokenizer, prompts)
    cache = SplitCache(out, split)
    model_fp = model_fingerprint(model_path)
    n_shards = (len(prompt_ids) + SHARD_PROMPTS - 1) // SHARD_PROMPTS
    tag = getattr(generate, "tag", "hf")
    if max_shards is not None:
        n_shards = min(n_shards, max_shards)
    records: list[dict[str, Any]] = []
    for i in range(n_shards):
        chunk = prompt_ids[i * SHARD_PROMPTS: (i + 1) * SHARD_PROMPTS]
        key = [model_fp, chunk, max_new] + ([tag] if tag != "hf" else [])  # which generator
        fp = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        if cache.has(i, fp):
            records += cache.load(i, model, topk)
            continue
        if deadline is not None and records and time.time() > deadline:
            log(f"{split}: data budget spent, using {i} of {n_shards} shards")
            break
        t0 = time.time()
        generated = generate(chunk)
        t1 = time.time()
        shard = make_records(model, chunk, generated, topk)
        cache.save(i, fp, shard)
        records += shard
        n_gen = sum(len(a) for a, _ in generated)
        log(f"{split} shard {i + 1}/{n_shards}: {len(chunk)} prompts, {n_gen} answer tokens, "
            f"generated in {t1 - t0:.0f}s ({n_gen / max(t1 - t0, 1e-9):.0f} tok/s), "
            f"records {time.time() - t1:.0f}s")
    return records


def supervised_positions(records: list[dict[str, Any]]) -> int:
    """Answer tokens that serve as step-1 labels (t_{i+2} inside the answer)."""
    return sum(max(0, len(r["tokens"]) - r["prompt_len"] - 1) for r in records)
