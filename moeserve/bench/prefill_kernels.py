"""`python -m moeserve.bench.prefill_kernels`: the two kernels that hold a Qwen3-30B-A3B prefill
step back (issue 44), each launch config against the matmul peak that the same run measures.

A 4096-token Qwen3-30B-A3B prefill step on an H100 (docs/gpu_decode.md): fused-MoE GEMMs 47.3 ms
(313 TFLOP/s), the Triton extend attention 23.5 ms (280 TFLOP/s), against a 782 TFLOP/s 8192^3
bf16 matmul. Both are tiles reading operands from L2 at a rate near its limit; this bench times
the tiles that would read less per FLOP, so one device call can choose the defaults:

- fused MoE (`fused_moe`, the whole call: align, gate/up GEMM with silu * up, down GEMM, top-k
  sum), Qwen3's experts (E 128, H 2048, I 768, top-8), random routing: the shape heuristic
  (`default_config`, what a GPU without a tuned table runs), each shipped table's entry for this
  token count (tuned on another GPU), PREFILL_SPACE (`--moe-space swap` leaves it out) and
  SWAP_SPACE, swap-AB tiles (`SWAP_AB`: weights x tokens, 16-64-token blocks; fused_moe.py); `pad`
  is the share of rows that the expert blocks of BLOCK_SIZE_M add (they are multiplied like real
  rows). Each token count ends with a line comparing the best swap-AB row with today's config
  (`get_moe_config`: this GPU's shipped table, else the heuristic); `--swap-table DIR` writes
  today's table with those best swap-AB configs at the benched token counts (a moe.config_dir for
  `bench.one_batch --compare-with`);
- extend attention (`extend_attention`): one prompt of T new tokens (plus a cached prefix with
  --prefix) of Qwen3's heads (32 query, 4 KV, D 128), by (BLOCK_M, BLOCK_N, warps, stages).

Every config's output is checked against the first row's (and the first row against torch) before
it is timed; rows that do not compile, do not fit or disagree are listed as skipped. TFLOP/s
counts the useful FLOPs (routed pairs, causal pairs); % peak divides by the measured matmul
rate; the MoE's % floor divides its floor (the larger of the FLOPs at that rate and the touched
experts' bytes at the measured copy bandwidth) by its time: `--tokens 1344` is a served MIXED
step's size, whose fused MoE issue 44 puts at 450 µs against a 286 µs byte floor. Each call is
timed replayed in a CUDA graph (as the extend graphs run prefill chunks). `--out FILE` writes
every row as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages[, down
# (BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages)]): 64- and 128-row blocks with
# tiles from the heuristic's 64 x 64 (x 2 for gate and up) up to 128 x 128 (x 2) and down tiles
# of 128-256 columns; all fit the H100's shared memory in bf16 (scripts/sm90_compile.py)
PREFILL_SPACE = [
    (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 8, 3, (256, 64, 8, 8, 3)), (64, 256, 64, 8, 8, 3),
    (128, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 4), (128, 64, 128, 8, 8, 3),
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 1, 8, 3),
    (128, 128, 64, 16, 8, 3), (128, 128, 128, 8, 8, 2),
    (128, 128, 64, 8, 8, 3, (256, 64, 8, 8, 3)), (128, 128, 64, 8, 8, 3, (128, 64, 8, 8, 4)),
    (128, 128, 64, 8, 8, 3, (128, 128, 8, 8, 3)), (128, 64, 64, 8, 8, 4, (256, 64, 8, 8, 3)),
]
# swap-AB: (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages,
# SWAP_AB[, down (..., SWAP_AB)]); BLOCK_SIZE_N is the weight side (the MMA's 64-row M per
# warpgroup), BLOCK_SIZE_M the tokens'. At 1344 tokens an expert has ~84 pairs (16-row blocks pad
# ~9%, 128-row ones ~52%), at 4096 ~256 (32: ~6%, 128: ~24%).
SWAP_SPACE = [
    (16, 128, 64, 8, 4, 4, 1), (16, 128, 128, 8, 4, 3, 1), (16, 256, 64, 8, 8, 3, 1),
    (32, 128, 64, 8, 4, 4, 1), (32, 128, 64, 8, 8, 3, 1), (32, 256, 64, 8, 8, 3, 1),
    (64, 128, 64, 8, 4, 4, 1), (64, 128, 64, 8, 8, 3, 1), (64, 256, 64, 8, 8, 3, 1),
    (32, 128, 64, 8, 4, 4, 1, (128, 64, 8, 8, 3, 0)), (64, 256, 64, 8, 8, 3, 1, (256, 64, 8, 8, 3)),
]
# (BLOCK_M, BLOCK_N, num_warps, num_stages, split_causal): first today's default (every key
# block masked; the diagonal-only mask ran slower at this tile), then the split-mask variants
# and the 128-row tiles; torch SDPA's rows follow (`bench_sdpa`)
ATTENTION_TILES = [(64, 64, 4, 2, False), (64, 64, 4, 2, True), (64, 128, 4, 2, True),
                   (64, 64, 8, 2, True), (128, 64, 8, 2, False), (128, 64, 8, 2, True),
                   (128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 32, 8, 3, True)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _time_ms(fn) -> float:
    """Median ms of fn replayed in a CUDA graph: eager, the host's launches of the fused-MoE
    call (~0.1-0.2 ms each, docs/gpu_decode.md) would leave the GPU idle between kernels."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _config(row: tuple) -> dict:
    """KEYS from the row's first 6 values; then an int is SWAP_AB, a tuple the down entry
    (DOWN_KEYS, then optionally its own SWAP_AB)."""
    from moeserve.kernels.triton.moe_config import DOWN_KEYS, KEYS, SWAP_KEY

    cfg = dict(zip(KEYS, row[:6]))
    for extra in row[6:]:
        if isinstance(extra, tuple):
            cfg["down"] = dict(zip(DOWN_KEYS + (SWAP_KEY,), extra))
        else:
            cfg[SWAP_KEY] = extra
    return cfg


def _label(cfg: dict) -> str:
    """'MxNxK gG wW sS' (+ ' swap', ' tma'), then the down tile's where it has one."""
    from moeserve.kernels.triton.moe_config import b_tma, down_config, swap_ab

    def flags(c: dict) -> str:
        return (" swap" if swap_ab(c) else "") + (" tma" if b_tma(c) else "")

    s = "x".join(str(cfg[k]) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))
    s += f" g{cfg['GROUP_SIZE_M']} w{cfg['num_warps']} s{cfg['num_stages']}" + flags(cfg)
    d = cfg.get("down")
    if not d:
        return s
    d = down_config(cfg)
    return s + (f" down {d['BLOCK_SIZE_N']}x{d['BLOCK_SIZE_K']} w{d['num_warps']}"
                f" s{d['num_stages']}" + flags(d))


def _flip_tma(cfg: dict) -> tuple[str, dict]:
    """Today's tiles the other way: B_TMA off at both levels where today sets it ("pointer
    loads"), else on at both with 4 stages ("TMA"; the stages its 2026-12-07 rows used)."""
    from moeserve.kernels.triton.moe_config import b_tma, down_config

    if b_tma(cfg) or b_tma(down_config(cfg)):
        out = {k: v for k, v in cfg.items() if k not in ("B_TMA", "down")}
        if "down" in cfg:
            out["down"] = {k: v for k, v in cfg["down"].items() if k != "B_TMA"}
        return "pointer loads", out
    out = dict(cfg, B_TMA=1, num_stages=4)
    if "down" in cfg:
        out["down"] = dict(cfg["down"], B_TMA=1, num_stages=4)
    return "TMA", out


def pad_share(ids: torch.Tensor, experts: int, block_m: int) -> float:
    """Rows the expert blocks add over the routed pairs: sum(ceil(n_e / BM) * BM) / pairs - 1."""
    counts = torch.bincount(ids.flatten().cpu(), minlength=experts)
    return float(((counts + block_m - 1) // block_m * block_m).sum() / counts.sum() - 1)


def bench_moe(tokens: int, peak: float, rows: list[dict], e: int = 128, h: int = 2048,
              i: int = 768, k: int = 8, bandwidth: float | None = None,
              space: str = "all") -> None:
    """`bandwidth`: copy bytes/s; the floor is then the larger of the FLOPs at `peak` and the
    touched experts' bytes at it (a MIXED step's ~1.3k tokens sit near the crossover).
    `space`: "all" (PREFILL_SPACE and SWAP_SPACE), "swap" (SWAP_SPACE only) or "today" (neither);
    the heuristic, the shipped tables and today's config with and without TMA are always timed."""
    from moeserve.kernels.triton.fused_moe import fused_moe
    from moeserve.kernels.triton.moe_config import (SHIPPED_DIR, default_config, get_moe_config,
                                                    load_table, swap_ab)
    from moeserve.tools.tune_moe import random_inputs

    dtype = torch.bfloat16
    x, w13, w2, ids, w = random_inputs(tokens, e, h, i, k, dtype, seed=tokens)
    flops = 6.0 * tokens * k * h * i
    cands = [("heuristic", default_config(e, h, i, k, dtype, tokens))]
    for table_path in sorted(SHIPPED_DIR.glob(f"E={e},N={i},H={h},dtype=bfloat16,*.json")):
        table = load_table(str(table_path))
        near = min(table, key=lambda n: (abs(n - tokens), n))
        cands.append((f"table {table_path.stem.split('device=')[-1]}@{near}", table[near]))
    today = get_moe_config(e, h, i, k, dtype, tokens)  # what this GPU runs now
    if all(cfg != today for _, cfg in cands):
        cands.append(("today", today))
    way, flipped = _flip_tma(today)  # today's tiles with weights by TMA and without
    cands.append((f"today, {way}", flipped))
    cands += [("space", _config(r)) for r in (PREFILL_SPACE if space == "all" else [])]
    cands += [("swap space", _config(r)) for r in (SWAP_SPACE if space != "today" else [])]
    ref = None
    touched = int(torch.unique(ids).numel()) * 3 * h * i * x.element_size()
    floor_ms = max(flops / peak, touched / bandwidth if bandwidth else 0.0) * 1e3
    print(f"\nfused MoE, E {e} H {h} I {i} top-{k}, {tokens} tokens, {flops / 1e9:.0f} GFLOP, "
          f"{touched / 1e9:.2f} GB of touched experts; floor {floor_ms:.3f} ms")
    print("| config | source | ms | TFLOP/s | % peak | % floor | pad |")
    print("|---|---|---|---|---|---|---|")
    for source, cfg in cands:
        def call(cfg=cfg):
            return fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False)
        try:
            out = call()
            _sync()
        except Exception as err:  # noqa: BLE001 - OutOfResources, compile errors: list and go on
            print(f"| {_label(cfg)} | {source} | skipped: {type(err).__name__} | | | | |")
            continue
        if ref is None:
            ref = out
            torch_ref = _moe_torch(x, w13, w2, ids, w)
            err = _rel(out, torch_ref)
            assert err < 2e-2, f"{source} config vs torch experts: {err:.2e}"
        elif (err := _rel(out, ref)) > 2e-2:
            print(f"| {_label(cfg)} | {source} | skipped: differs {err:.1e} | | | | |")
            continue
        ms = _time_ms(call)
        rate = flops / ms / 1e9
        pad = pad_share(ids, e, cfg["BLOCK_SIZE_M"])
        print(f"| {_label(cfg)} | {source} | {ms:.3f} | {rate:.0f} | "
              f"{100 * rate * 1e12 / peak:.1f}% | {100 * floor_ms / ms:.1f}% | "
              f"{100 * pad:.1f}% |", flush=True)
        rows.append({"kernel": "fused_moe", "tokens": tokens, "source": source, "config": cfg,
                     "swap_ab": swap_ab(cfg), "today": cfg == today, "ms": ms, "tflops": rate,
                     "peak_share": rate * 1e12 / peak, "floor_ms": floor_ms, "pad": pad})
    _swap_summary([r for r in rows if r["kernel"] == "fused_moe" and r["tokens"] == tokens])


def _swap_summary(rows: list[dict]) -> None:
    """The best swap-AB row against today's config's row, one line."""
    base = next((r for r in rows if r["today"]), None)
    swaps = [r for r in rows if r["swap_ab"]]
    if base is None or not swaps:
        print("swap-AB: no row to compare (today's config or every swap-AB tile skipped)")
        return
    best = min(swaps, key=lambda r: r["ms"])
    print(f"swap-AB at {best['tokens']} tokens: best {_label(best['config'])} {best['ms']:.3f} ms"
          f" ({100 * best['peak_share']:.1f}% peak, pad {100 * best['pad']:.1f}%) against today's "
          f"{_label(base['config'])} ({base['source']}) {base['ms']:.3f} ms "
          f"({100 * base['peak_share']:.1f}%, pad {100 * base['pad']:.1f}%): "
          f"{base['ms'] / best['ms']:.2f}x", flush=True)


def write_swap_table(rows: list[dict], folder: str, e: int = 128, h: int = 2048,
                     i: int = 768, k: int = 8,
                     dtype: torch.dtype = torch.bfloat16) -> Path | None:
    """Today's table for this GPU (the shipped one, else the heuristic at powers of two up to
    8192) with each benched token count's entry set to its best swap-AB row; the path, or None
    without swap-AB rows."""
    from moeserve.kernels.triton.moe_config import (SHIPPED_DIR, config_file_name,
                                                    default_config, load_table)

    best: dict[int, dict] = {}
    for r in rows:
        if r["kernel"] == "fused_moe" and r["swap_ab"] and (
                r["tokens"] not in best or r["ms"] < best[r["tokens"]]["ms"]):
            best[r["tokens"]] = r
    if not best:
        return None
    name = config_file_name(e, h, i, dtype)
    table = load_table(str(SHIPPED_DIR / name)) or {
        n: default_config(e, h, i, k, dtype, n) for n in (2 ** j for j in range(14))}
    table = {n: dict(cfg) for n, cfg in table.items()} | {t: r["config"] for t, r in best.items()}
    out = Path(folder) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(n): table[n] for n in sorted(table)}, indent=1) + "\n")
    return out


def _moe_torch(x, w13, w2, ids, w) -> torch.Tensor:
    """The routed experts in float32 torch ops, expert by expert (the reference)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok].float() @ w13[e].float().t()
        y = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].float().t()
        out.index_add_(0, tok, y * w[tok, slot, None].float())
    return out.to(x.dtype)


def bench_attention(tokens: int, prefix: int, peak: float, rows: list[dict], heads: int = 32,
                    kv_heads: int = 4, d: int = 128, device: str = "cuda",
                    dtype: torch.dtype = torch.bfloat16) -> None:
    from moeserve.kernels.triton.attention_extend import extend_attention, extend_blocks

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    seq = prefix + tokens
    q = torch.randn(tokens, heads, d, generator=g, device=dev).to(dtype)
    k_buf = torch.randn(seq + 1, kv_heads, d, generator=g, device=dev).to(dtype)
    v_buf = torch.randn(seq + 1, kv_heads, d, generator=g, device=dev).to(dtype)
    table = torch.arange(1, seq + 1, device=dev, dtype=torch.int32)[None]  # slot 0: the sink
    rows_idx = torch.zeros(1, dtype=torch.int64, device=dev)
    qo = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    pre = torch.tensor([prefix], dtype=torch.int32, device=dev)
    pairs = tokens * prefix + tokens * (tokens + 1) / 2
    flops = 4.0 * pairs * heads * d
    ref = None
    print(f"\nextend attention, {heads} heads / {kv_heads} KV heads, D {d}, {tokens} new tokens "
          f"on a {prefix}-token prefix, causal, {flops / 1e9:.0f} GFLOP")
    print("| BLOCK_M x BLOCK_N | warps | stages | causal mask | ms | TFLOP/s | % peak |")
    print("|---|---|---|---|---|---|---|")
    for bm, bn, warps, stages, split in ATTENTION_TILES:
        mask = "diagonal only" if split else "every block"
        reqs, blocks = extend_blocks([tokens], bm)
        blk_req = torch.tensor(reqs, dtype=torch.int32, device=dev)
        blk_m = torch.tensor(blocks, dtype=torch.int32, device=dev)
        out = torch.full((tokens, heads, d), float("nan"), dtype=dtype, device=dev)

        def call(bm=bm, tile=(bn, warps, stages), blk_req=blk_req, blk_m=blk_m, out=out,
                 split=split):
            extend_attention(q, k_buf, v_buf, table, rows_idx, qo, pre, blk_req, blk_m,
                             d ** -0.5, d, d, out, block_m=bm, tile=tile, split_causal=split)
            return out
        try:
            call()
            _sync()
        except Exception as err:  # noqa: BLE001
            print(f"| {bm} x {bn} | {warps} | {stages} | {mask} | skipped: "
                  f"{type(err).__name__} | | |")
            continue
        if ref is None:
            ref = out.clone()
            err = _rel(out, _attention_torch(q, k_buf[1:], v_buf[1:], prefix))
            assert err < 2e-2, f"extend attention vs torch: {err:.2e}"
        elif (err := _rel(out, ref)) > 2e-2:
            print(f"| {bm} x {bn} | {warps} | {stages} | {mask} | skipped: differs {err:.1e} "
                  "| | |")
            continue
        ms = _time_ms(call)
        rate = flops / ms / 1e9
        print(f"| {bm} x {bn} | {warps} | {stages} | {mask} | {ms:.3f} | {rate:.0f} | "
              f"{100 * rate * 1e12 / peak:.1f}% |", flush=True)
        rows.append({"kernel": "extend_attention", "tokens": tokens, "prefix": prefix,
                     "block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                     "split_causal": split, "ms": ms,
                     "tflops": rate, "peak_share": rate * 1e12 / peak})
    if prefix == 0 and ref is not None:
        bench_sdpa(q, k_buf[1:], v_buf[1:], ref, flops, peak, rows)


def bench_sdpa(q, k, v, ref, flops: float, peak: float, rows: list[dict]) -> None:
    """The runtime's SDPA fresh prefill (attention/sdpa_prefill.py: q [T, H, D] in, [T, H, D]
    out, layout changes included) on the same prompt (no prefix), by
    attention.sdpa_prefill_backend, GQA passed as such and with K/V repeated per query head."""
    from moeserve.attention.sdpa_prefill import sdpa_prefill
    from moeserve.config_schema import SDPA_BACKENDS

    t, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    for backend in SDPA_BACKENDS:
        for gqa in (True, False):
            label = f"{backend} {'gqa' if gqa else 'repeated kv'}"

            def call(backend=backend, gqa=gqa):
                kk, vv = (k, v) if gqa else (k.repeat_interleave(group, 1),
                                             v.repeat_interleave(group, 1))
                return sdpa_prefill(q, kk, vv, [t], d ** -0.5, out, backend)
            try:
                got = call()
                _sync()
                if (err := _rel(got, ref)) > 2e-2:
                    raise ValueError(f"differs {err:.1e}")
                ms = _time_ms(call)
            except Exception as e:  # noqa: BLE001
                why = str(e).splitlines()[0][:60] if str(e) else ""
                print(f"| torch SDPA {label} | | | | skipped: {type(e).__name__} {why} | | |")
                continue
            rate = flops / ms / 1e9
            print(f"| torch SDPA {label} | | | | {ms:.3f} | {rate:.0f} | "
                  f"{100 * rate * 1e12 / peak:.1f}% |", flush=True)
            rows.append({"kernel": "sdpa", "tokens": t, "prefix": 0, "variant": label,
                         "ms": ms, "tflops": rate, "peak_share": rate * 1e12 / peak})


def _attention_torch(q, k, v, prefix) -> torch.Tensor:
    """Causal GQA attention of the new tokens over prefix + new keys, by torch's SDPA."""
    t, h, _ = q.shape
    group = h // k.shape[1]
    kk = k.repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
    vv = v.repeat_interleave(group, 1).transpose(0, 1)
    mask = (torch.arange(k.shape[0], device=q.device)[None, :]
            <= prefix + torch.arange(t, device=q.device)[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv,
                                                           attn_mask=mask)
    return out.transpose(0, 1)


def main(argv: list[str] | None = None) -> None:
    from moeserve.bench.prefill_flops import measure_matmul_peak
    from moeserve.bench.roofline import measure_copy_bandwidth

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before the new ones")
    p.add_argument("--only", choices=["moe", "attention"], default=None)
    p.add_argument("--out", default=None, help="JSON of every row")
    p.add_argument("--moe-space", choices=["all", "swap", "today"], default="all",
                   help="swap: leave PREFILL_SPACE out (time the swap-AB tiles, the heuristic, "
                        "the tables and today's config); today: the swap-AB tiles too")
    p.add_argument("--swap-table", default=None, metavar="DIR",
                   help="write today's MoE table with the best swap-AB configs into DIR")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_kernels times compiled Triton kernels: it needs a CUDA GPU")
    peak = measure_matmul_peak(torch.device("cuda"))
    bw = measure_copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: bf16 8192^3 matmul {peak / 1e12:.0f} TFLOP/s, copy "
          f"{bw / 1e12:.2f} TB/s (read + write)")
    rows: list[dict] = []
    for t in args.tokens:
        if args.only != "attention":
            bench_moe(t, peak, rows, bandwidth=bw, space=args.moe_space)
        if args.only != "moe":
            bench_attention(t, args.prefix, peak, rows)
    if args.swap_table and (path := write_swap_table(rows, args.swap_table)):
        print(f"wrote {path}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                              "peak": peak, "bandwidth": bw, "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
