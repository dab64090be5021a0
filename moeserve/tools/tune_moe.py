"""Tune the fused-MoE launch configs of one expert shape on this GPU (CUDA only).

    python -m moeserve.tools.tune_moe --experts 128 --hidden 2048 --intermediate 768 --topk 8 \\
        --dtype bfloat16 --tokens 1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192 --out DIR

Times the whole `fused_moe` call (align + both GEMMs + the top-k sum) replayed in a CUDA graph
(`--timer eager`: do_bench with the L2 flushed) on random inputs, then retiles the down GEMM
alone (its `down` entry; `--no-down` skips that), prints one row per token count with the touched
experts' bytes per second, and writes `E=..,N=..,H=..,dtype=..,device=...json` with the fastest
config of each: the table `moe_config.get_moe_config` reads.

The search space is hand-picked rather than a grid, since compiling dominates (two kernels per
config, ~1-2 s each): BLOCK_SIZE_M 16 configs vary tile width (N 32-128) and pipeline depth (K
64-256, 3-5 stages) because decode only streams weights; mid sizes (M 32-64) and prefill (M
64-128, N 64-256, 8 warps) vary the tile shape of a compute-bound GEMM. SWAP_SPACE holds
swap-AB tiles (`SWAP_AB` 1: the weight rows are the MMA's 64-row side, so token blocks of 16-64
pad each expert less; fused_moe.py); the down GEMM also tries a few tiles with the other SWAP_AB
than the chosen config's. Configs whose M tile is far above the rows per expert (T*K/E) are not
timed for that T. `--quick` keeps 14. `--tma` also times prefill-sized configs (M tile >= 64, or
swap-AB) with their weight tiles by TMA (`B_TMA`) at their stages and one more, and each down
tile both ways (a twin whose stages overflow shared memory is skipped, as any config that does
not compile).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moeserve.kernels.triton.moe_config import (DOWN_KEYS, KEYS, SHIPPED_DIR, SWAP_KEY, TMA_KEY,
                                                config_file_name, default_config, swap_ab)

# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages)
SPACE = [
    (16, 32, 64, 1, 4, 5), (16, 32, 128, 1, 4, 4), (16, 32, 256, 1, 4, 3), (16, 64, 64, 1, 4, 5),
    (16, 64, 128, 1, 4, 4), (16, 64, 128, 1, 4, 3), (16, 64, 256, 1, 4, 3), (16, 128, 64, 1, 4, 4),
    (16, 128, 128, 1, 4, 3), (16, 64, 128, 1, 8, 4), (16, 32, 128, 1, 2, 4),
    (16, 128, 128, 1, 8, 4),
    (32, 32, 128, 1, 4, 4), (32, 64, 64, 8, 4, 4), (32, 64, 128, 8, 4, 3), (32, 128, 64, 8, 4, 4),
    (32, 128, 128, 8, 8, 3), (32, 64, 256, 1, 4, 3),
    (64, 64, 64, 8, 4, 4), (64, 64, 128, 8, 4, 3), (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3),
    (64, 128, 128, 8, 8, 3), (64, 256, 64, 8, 8, 3), (64, 64, 64, 1, 4, 3), (64, 128, 64, 16, 8, 4),
    (128, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3), (128, 64, 64, 1, 4, 4),
    (128, 64, 128, 8, 8, 3), (128, 128, 64, 16, 8, 3),
    (32, 128, 128, 8, 4, 3), (64, 128, 128, 8, 4, 3), (64, 256, 64, 8, 8, 4),
    (64, 64, 64, 16, 4, 4), (128, 256, 64, 8, 8, 3),
]
# swap-AB tiles (..., SWAP_AB=1): token blocks of 16-64 rows (the MMA's N side), weight tiles of
# 64-256 rows (its M side: 64 a warpgroup), 4 or 8 warps; 64 x 256 x 64 bf16 at 3 stages takes
# ~216 KB of shared memory (the non-swapped 64x256x64 g8 w8 s3 ran on an H100)
SWAP_SPACE = [
    (16, 64, 128, 1, 4, 4, 1), (16, 128, 64, 1, 4, 4, 1), (16, 128, 128, 1, 4, 3, 1),
    (16, 256, 64, 1, 8, 3, 1), (32, 64, 128, 8, 4, 4, 1), (32, 128, 64, 8, 4, 4, 1),
    (32, 128, 128, 8, 4, 3, 1), (32, 256, 64, 8, 8, 3, 1), (64, 64, 64, 8, 4, 4, 1),
    (64, 128, 64, 8, 4, 4, 1), (64, 128, 64, 8, 8, 3, 1), (64, 256, 64, 8, 8, 3, 1),
]
SPACE += SWAP_SPACE
QUICK = [SPACE[j] for j in (1, 2, 4, 6, 8, 14, 15, 18, 21, 22, 28, 30)] + [SWAP_SPACE[j]
                                                                         for j in (5, 10)]
# the down GEMM's own tile (BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages):
# N = hidden is wide and K = intermediate short, so wider N tiles and shallower K pipelines
DOWN_SPACE = [
    (32, 128, 1, 4, 4), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3), (64, 128, 8, 4, 4),
    (128, 64, 8, 4, 4), (128, 64, 8, 8, 3), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3),
    (64, 64, 8, 4, 5), (128, 32, 8, 4, 4),
]
# down tiles also tried with the SWAP_AB that the chosen config does not have
DOWN_FLIP_SPACE = [(128, 64, 8, 4, 4), (256, 64, 8, 8, 3), (128, 128, 8, 8, 3)]


def as_config(row: tuple[int, ...]) -> dict:
    """KEYS from the row's first 6 values; a 7th is SWAP_AB."""
    return dict(zip(KEYS + (SWAP_KEY,), row))


def down_candidates(cfg: dict, tma: bool = False) -> list[dict]:
    """cfg with each `down` tile: DOWN_SPACE's (cfg's SWAP_AB), DOWN_FLIP_SPACE's (the other);
    `tma`: each of them with its weight tiles by TMA and without."""
    flip = 1 - swap_ab(cfg)
    downs = ([dict(zip(DOWN_KEYS, d)) for d in DOWN_SPACE]
             + [dict(zip(DOWN_KEYS, d), SWAP_AB=flip) for d in DOWN_FLIP_SPACE])
    if tma:
        downs = [d | {TMA_KEY: b} for d in downs for b in (0, 1)]
    return [cfg | {"down": d} for d in downs]


def tma_twins(configs: list[dict]) -> list[dict]:
    """configs, then the prefill-sized ones (M tile >= 64, or swap-AB) with B_TMA at their
    stages and at one more (up to 5)."""
    twins = []
    for cfg in configs:
        if cfg["BLOCK_SIZE_M"] >= 64 or swap_ab(cfg):
            for stages in sorted({cfg["num_stages"], min(cfg["num_stages"] + 1, 5)}):
                twins.append(cfg | {TMA_KEY: 1, "num_stages": stages})
    return configs + twins


def describe(cfg: dict) -> str:
    """KEYS (and SWAP_AB / B_TMA where set), then the down entry's."""
    def one(c: dict, keys) -> str:
        return " ".join(f"{key}={c[key]}" for key in keys if key in c)

    down = cfg.get("down")
    return one(cfg, KEYS + (SWAP_KEY, TMA_KEY)) + (
        " down: " + one(down, DOWN_KEYS + (SWAP_KEY, TMA_KEY)) if down else "")


def random_inputs(t: int, e: int, h: int, i: int, k: int, dtype: torch.dtype, seed: int = 0):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (unit-variance outputs), top-k of random logits
    (ids [T, K] and softmax weights), all on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = rand(t, h).to(dtype)
    w13 = (rand(e, 2 * i, h) / h**0.5).to(dtype)
    w2 = (rand(e, h, i) / i**0.5).to(dtype)
    logits, ids = rand(t, e).topk(k, dim=1)
    return x, w13, w2, ids, logits.softmax(1)


def candidates(space: list[tuple[int, ...]], t: int, k: int, e: int) -> list[dict]:
    """Configs worth timing at T tokens: BLOCK_SIZE_M at most 2x the rows per expert (≥ 16)."""
    rows = max(1, -(-t * k // e))
    cap = max(16, 2 * (1 << (rows - 1).bit_length()))
    return [as_config(r) for r in space if r[0] <= cap]


def time_config(fn, cfg: dict, ref: torch.Tensor, timer: str) -> float | None:
    """Median µs of fn(cfg), or None if it does not compile/launch or disagrees with ref.
    timer "graph": replayed in a CUDA graph, as decode and extend steps run (outside one, a
    Triton launch costs more host time than a mid-size GEMM takes, so eager timing would rank
    configs by noise); "eager": do_bench with the L2 flushed between calls."""
    import triton.testing

    try:
        out = fn(cfg)
        torch.cuda.synchronize()
    except Exception as e:  # OutOfResources (shared memory), compile errors
        print(f"  skip {cfg}: {type(e).__name__}")
        return None
    if not torch.allclose(out.float(), ref.float(), rtol=5e-2, atol=5e-2):
        print(f"  skip {cfg}: wrong result")
        return None
    if timer == "graph":
        return triton.testing.do_bench_cudagraph(lambda: fn(cfg), rep=20,
                                                 return_mode="median") * 1e3
    return triton.testing.do_bench(lambda: fn(cfg), warmup=5, rep=25, return_mode="median") * 1e3


def touched_bytes(ids: torch.Tensor, e: int, h: int, i: int, dtype: torch.dtype) -> int:
    """Bytes of the experts the step routes to (each read once at best): the bandwidth floor."""
    return int(torch.unique(ids).numel()) * 3 * h * i * torch.finfo(dtype).bits // 8


def tune(e: int, h: int, i: int, k: int, dtype: torch.dtype, tokens: list[int],
         space: list[tuple[int, ...]], timer: str = "graph", tune_down: bool = True,
         out: Path | None = None, tma: bool = False) -> dict[str, dict]:
    """Per token count: the fastest whole-call config over `space` (`tma`: and `tma_twins`),
    then (tune_down) the down GEMM's own tile over DOWN_SPACE with that BLOCK_SIZE_M. `out`:
    the JSON, rewritten after every token count so that a run cut short keeps what it
    measured; entries it holds for other token counts are kept."""
    from moeserve.kernels.triton.fused_moe import fused_moe

    kept = out is not None and out.is_file()
    best: dict[str, dict] = json.loads(out.read_text()) if kept else {}
    print(f"{'tokens':>7} {'best µs':>9} {'default µs':>10} {'GB/s':>6}  best config")
    for t in tokens:
        x, w13, w2, ids, w = random_inputs(t, e, h, i, k, dtype, seed=t)
        # the sorted path's configs (small T*K would otherwise take the GEMV path, untuned)
        fn = lambda cfg: fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False)  # noqa: E731
        dflt = default_config(e, h, i, k, dtype, t)
        ref = fn(dflt)
        base = time_config(fn, dflt, ref, timer)
        cands = candidates(space, t, k, e)
        timed = [(us, cfg) for cfg in (tma_twins(cands) if tma else cands)
                 if (us := time_config(fn, cfg, ref, timer)) is not None]
        if base is not None:
            timed.append((base, dflt))
        us, cfg = min(timed, key=lambda p: p[0])
        if tune_down:
            downs = [(d_us, c) for c in down_candidates(cfg, tma)
                     if (d_us := time_config(fn, c, ref, timer)) is not None]
            if downs and min(downs, key=lambda p: p[0])[0] < us:
                us, cfg = min(downs, key=lambda p: p[0])
        best[str(t)] = cfg
        if out is not None:
            out.write_text(json.dumps(best, indent=1) + "\n")
        gbps = touched_bytes(ids, e, h, i, dtype) / (us * 1e3)
        print(f"{t:>7} {us:>9.1f} {base or float('nan'):>10.1f} {gbps:>6.0f}  {describe(cfg)}",
              flush=True)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, required=True, help="experts on one GPU (E_local)")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True, help="per-expert I (w2: [E, H, I])")
    p.add_argument("--topk", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tokens", type=int, nargs="+",
                   default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--out", default=str(SHIPPED_DIR), help="folder of the JSON (moe.config_dir)")
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configs, not {len(SPACE)}")
    p.add_argument("--timer", default="graph", choices=["graph", "eager"],
                   help="time replays of a CUDA graph (as served) or eager calls")
    p.add_argument("--no-down", action="store_true", help="one tile for both GEMMs")
    p.add_argument("--tma", action="store_true",
                   help="also time prefill-sized configs and down tiles with B_TMA")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe needs a CUDA GPU: it times the compiled Triton kernels")
    dtype = getattr(torch, args.dtype)
    out = Path(args.out) / config_file_name(args.experts, args.hidden, args.intermediate, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tune(args.experts, args.hidden, args.intermediate, args.topk, dtype, sorted(args.tokens),
         QUICK if args.quick else SPACE, args.timer, not args.no_down, out, args.tma)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
