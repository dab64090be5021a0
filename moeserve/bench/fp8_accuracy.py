"""FP8 accuracy, measured: mean KL and top-1 agreement of the FP8 path against the dequantized
model, next to the float64 emulation of the same arithmetic (layers/fp8_emulation.py).

    python -m moeserve.bench.fp8_accuracy [--models tiny_v3_fp8 tiny_v3_wide_fp8 tiny_v2 smollm2]
        [--device cuda|cpu] [--lengths 1 4 12 40 96] [--greedy 16]

Each model loads with `model.quantization=fp8` (FP8 checkpoints as stored, float ones quantized
into 128 x 128 blocks at load) twice: in bf16 on --device and in float32 on the CPU. The FP8
modules then switch backends on the same weights: `torch` (the dequantized model: the weights
dequantized to the activation dtype, nothing quantized), `emulate` and, on CUDA, `triton` (the
kernels that serve). Every prompt runs as its own prefill (M = its length: lengths 1 / <= 16 /
more take the W8A16 GEMV / fused / GEMM paths, and the small / sorted fused MoE), all-position
logits; then `--greedy` tokens decoded as one batch (M = the prompt count). Rows, each against
a reference on the same weights:
- bf16 dequantized vs fp32 dequantized: bf16's own noise (no FP8 arithmetic);
- fp32 emulation vs fp32 dequantized: what FP8 activations cost by themselves;
- bf16 emulation / bf16 FP8 kernels vs bf16 dequantized: that cost in the served dtype;
- bf16 FP8 kernels vs bf16 emulation: the kernels' gap beyond the emulation; it must stay
  within bf16's noise (tests/gpu/test_fp8_accuracy.py), a larger one is a kernel bug.
KL is KL(reference || row) in nats, averaged over positions; "greedy" is the identical-prefix
length of the decoded tokens, summed over prompts. Models: tiny_v3_fp8 is the FP8 checkpoint of
issue 44's finding (make_tiny deepseek_v3 --fp8, seed 3, intermediate 200: hidden 64),
tiny_v3_wide_fp8 the same arch at hidden 320 (partial blocks in K), tiny_v2 a float DeepSeek-V2
quantized at load, smollm2 the embedded SmolLM2-135M quantized at load (where installed); or
a checkpoint directory.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass

import torch

from moeserve.config import compose
from moeserve.core import ForwardMode
from moeserve.layers.fp8_moe import set_fp8_backend
from moeserve.runtime.model_runner import ModelRunner

TINY = {  # name -> (arch, make_tiny keywords)
    "tiny_v3_fp8": ("deepseek_v3", {"seed": 3, "fp8": True, "intermediate_size": 200}),
    "tiny_v3_wide_fp8": ("deepseek_v3", {"seed": 1, "fp8": True, "hidden_size": 320,
                                         "intermediate_size": 600, "moe_intermediate_size": 200,
                                         "q_lora_rank": 200}),
    "tiny_v2": ("deepseek_v2", {"seed": 2}),
}


@dataclass
class Logits:
    """One variant's outputs: per-prompt all-position logits (float32, CPU), greedy tokens."""

    logits: list[torch.Tensor]
    greedy: list[list[int]]


@dataclass
class Row:
    model: str
    variant: str
    reference: str
    kl: float
    top1: float
    rel_err: float
    greedy_prefix: int
    greedy_total: int


def model_path(name: str, workdir: str) -> str:
    if name in TINY:
        from moeserve.tools.make_tiny import make_tiny

        arch, kw = TINY[name]
        return make_tiny(arch, os.path.join(workdir, name), **kw)
    if name == "smollm2":
        from moeserve.models.embedded import embedded_model_path

        return embedded_model_path()
    return name


def make_runner(path: str, device: str, dtype: str) -> ModelRunner:
    """FP8 resident, eager (no CUDA graphs: the backends switch between calls)."""
    return ModelRunner(compose([f"device={device}", f"model.dtype={dtype}",
                                "model.quantization=fp8", "cuda_graph.enabled=false"]), path)


def run_variant(runner: ModelRunner, backend: str, prompts: list[list[int]],
                greedy: int) -> Logits:
    set_fp8_backend(runner.model, backend)
    logits = [_forward(runner, [p], ForwardMode.EXTEND)[0] for p in prompts]
    return Logits(logits, _greedy(runner, prompts, greedy) if greedy else [])


def _forward(runner: ModelRunner, prompts: list[list[int]], mode: ForwardMode,
             rows=None, slots=None, prefix: list[int] | None = None) -> list[torch.Tensor]:
    """EXTEND of whole prompts into fresh KV (all-position logits per prompt), or (rows, slots,
    prefix given) one step of the prompts' tokens over their cached prefixes."""
    mem = runner.memory
    lens = [len(p) for p in prompts]
    own = rows is None
    if own:
        rows = mem.req_to_token.alloc(len(prompts))
        slots = mem.allocator.alloc(sum(lens))
        offset = 0
        for row, n in zip(rows, lens):
            mem.req_to_token.write(row, 0, slots[offset: offset + n])
            offset += n
        prefix = [0] * len(prompts)
    try:
        positions = [prefix[i] + j for i, n in enumerate(lens) for j in range(n)]
        fb = runner.make_batch(mode, [t for p in prompts for t in p], positions, slots, rows,
                               prefix, lens, return_all_logits=mode == ForwardMode.EXTEND)
        with torch.no_grad():
            out = runner.forward(fb).float().cpu()
        return list(out.split(lens))
    finally:
        if own:
            mem.allocator.free(slots)
            mem.req_to_token.free(rows)


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt prefilled alone, then `steps` tokens decoded for all of them as one batch."""
    mem = runner.memory
    rows = mem.req_to_token.alloc(len(prompts))
    seqs = [mem.allocator.alloc(len(p) + steps) for p in prompts]
    try:
        toks = []
        for row, p, s in zip(rows, prompts, seqs):
            mem.req_to_token.write(row, 0, s)
            last = _forward(runner, [p], ForwardMode.EXTEND, [row], s[: len(p)], [0])[0][-1]
            toks.append([int(last.argmax())])
        for step in range(steps - 1):
            pos = [len(p) + step for p in prompts]
            slots = torch.stack([s[q] for s, q in zip(seqs, pos)])
            out = _forward(runner, [[t[-1]] for t in toks], ForwardMode.DECODE, rows, slots, pos)
            for t, o in zip(toks, out):
                t.append(int(o[-1].argmax()))
        return toks
    finally:
        for s in seqs:
            mem.allocator.free(s)
        mem.req_to_token.free(rows)


def compare(model: str, variant: str, reference: str, a: Logits, ref: Logits) -> Row:
    kl, top1, num, den, n = 0.0, 0.0, 0.0, 0.0, 0
    for x, r in zip(a.logits, ref.logits):
        lr, lx = r.double().log_softmax(-1), x.double().log_softmax(-1)
        kl += float((lr.exp() * (lr - lx)).sum(-1).sum())
        top1 += float((x.argmax(-1) == r.argmax(-1)).sum())
        num += float((x.double() - r.double()).norm() ** 2)
        den += float(r.double().norm() ** 2)
        n += x.shape[0]
    prefix = sum(next((i for i, (u, v) in enumerate(zip(g, h)) if u != v), len(g))
                 for g, h in zip(a.greedy, ref.greedy))
    total = sum(len(g) for g in ref.greedy) if a.greedy else 0
    return Row(model, variant, reference, kl / n, top1 / n, (num / den) ** 0.5, prefix, total)


def measure(name: str, path: str, device: str, lengths: list[int], greedy: int,
            kernels: bool | None = None) -> list[Row]:
    """The rows of one model (module docstring). `kernels`: run the `triton` backend (default:
    on CUDA; on CPU only in Triton's interpreter, where the float32 runner runs it)."""
    kernels = device == "cuda" if kernels is None else kernels
    lp = make_runner(path, device, "bfloat16")
    g = torch.Generator().manual_seed(5)
    vocab = min(lp.hf_config.vocab_size, 30000)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    dec = [p for p in prompts if len(p) >= 4][:4]  # the greedy batch
    v = {"bf16 dequantized": run_variant(lp, "torch", prompts, 0),
         "bf16 emulation": run_variant(lp, "emulate", prompts, 0)}
    if kernels and device == "cuda":
        v["bf16 FP8 kernels"] = run_variant(lp, "triton", prompts, 0)
    for k, b in (("bf16 dequantized", "torch"), ("bf16 emulation", "emulate"),
                 ("bf16 FP8 kernels", "triton")):
        if k in v:
            v[k].greedy = run_variant(lp, b, dec, greedy).greedy if greedy else []
    del lp
    f32 = make_runner(path, "cpu", "float32")
    v["fp32 dequantized"] = run_variant(f32, "torch", prompts, 0)
    v["fp32 emulation"] = run_variant(f32, "emulate", prompts, 0)
    if kernels and device != "cuda":
        v["fp32 FP8 kernels"] = run_variant(f32, "triton", prompts, 0)
    for k, b in (("fp32 dequantized", "torch"), ("fp32 emulation", "emulate")):
        v[k].greedy = run_variant(f32, b, dec, greedy).greedy if greedy else []
    pairs = [("bf16 dequantized", "fp32 dequantized"), ("fp32 emulation", "fp32 dequantized"),
             ("bf16 emulation", "bf16 dequantized"), ("bf16 FP8 kernels", "bf16 dequantized"),
             ("bf16 FP8 kernels", "bf16 emulation"), ("fp32 FP8 kernels", "fp32 emulation")]
    return [compare(name, a, b, v[a], v[b]) for a, b in pairs if a in v and b in v]


def print_table(rows: list[Row]) -> None:
    print("| model | variant | against | mean KL (nats) | top-1 agree | logits rel err "
          "| greedy prefix |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        greedy = f"{r.greedy_prefix}/{r.greedy_total}" if r.greedy_total else "-"
        print(f"| {r.model} | {r.variant} | {r.reference} | {r.kl:.3e} | {100 * r.top1:.1f}% "
              f"| {r.rel_err:.2e} | {greedy} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[*TINY, "smollm2"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", nargs="+", type=int, default=[1, 4, 12, 40, 96])
    p.add_argument("--greedy", type=int, default=16, help="decoded tokens (0: none)")
    args = p.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            try:
                path = model_path(name, workdir)
            except RuntimeError as e:  # the embedded model's package is not installed
                print(f"[fp8 accuracy] {name}: skipped ({e})", flush=True)
                continue
            rows += measure(name, path, args.device, args.lengths, args.greedy)
            print_table([r for r in rows if r.model == name])
    print(f"\n[fp8 accuracy] device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print_table(rows)


if __name__ == "__main__":
    main()
