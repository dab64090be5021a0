"""Experiment (docs/gpu_decode.md, 2026-12-07 H200 section): why the fused-MoE GEMMs took 656 us a
layer inside one_batch's 4096-token prefill but 824 us alone with random data and routing, and
whether B_TMA's kernel gain holds on the model's own inputs. `python3 scripts/exp_moe_routing.py
MODEL_DIR` on a GPU (a config-only Qwen3-30B-A3B from tools.make_random; dummy weights).
Captures the MoE inputs of a one_batch prefill of 4096 tokens, prints each layer's routing, then
times the two GEMMs (CUDA graphs) on: the model's (x, ids), the model's x with uniform ids, randn
x with the model's ids, randn x + weights with uniform ids; pointer loads vs TMA; PDL off/on;
the align alone; and fused_moe over all 48 captured layers eagerly, as the step runs it. (The
run quoted in the doc also timed the align of the commit before e540157 and a tl.histogram count
kernel, which failed to compile on triton 3.6; those rows are left out here.)"""
import sys

import torch
from triton.testing import do_bench_cudagraph

import moeserve.kernels.triton.fused_moe as fm
from moeserve.bench.one_batch import bench_moeserve
from moeserve.config import compose
from moeserve.kernels.triton.moe_align import moe_align_block_size
from moeserve.kernels.triton.moe_config import down_config, get_moe_config
from moeserve.runtime.model_runner import ModelRunner

T = 4096
cap = []
orig = fm.fused_moe


def spy(x, w13, w2, ids, tw, *a, **kw):
    if x.shape[0] == T and len(cap) < 48:
        cap.append((x.clone(), w13, w2, ids.clone(), tw.clone(), kw.get("pdl", False)))
    return orig(x, w13, w2, ids, tw, *a, **kw)


def main():
    path = sys.argv[1]
    cfg = compose([f"model.path='{path}'", "model.load_format=dummy", "device=cuda",
                   f"scheduler.chunked_prefill_size={T}", "cache.max_total_tokens=20000",
                   "cuda_graph.max_bs=4"])
    runner = ModelRunner(cfg, path)
    bench_moeserve(runner, 1, T, 2)  # warm
    fm.fused_moe = spy
    bench_moeserve(runner, 1, T, 2)
    fm.fused_moe = orig
    print(f"captured {len(cap)} MoE calls; pdl={cap[0][5]}")
    x0, w13, w2, ids0, tw0, pdl = cap[24]
    e, two_i, h = w13.shape
    i, k = two_i // 2, ids0.shape[1]
    print(f"w13 std {w13.float().std().item():.3e} w2 std {w2.float().std().item():.3e}")
    for li in (0, 1, 24, 47):
        x, ids = cap[li][0], cap[li][3]
        cnt = torch.bincount(ids.flatten().long(), minlength=e)
        print(f"layer {li}: x std {x.float().std().item():.3e} absmax "
              f"{x.float().abs().max().item():.3e} zeros {(x == 0).float().mean().item():.3f}; "
              f"pairs/expert min {cnt.min().item()} max {cnt.max().item()} "
              f"experts used {(cnt > 0).sum().item()} distinct ids/token "
              f"{ids.sort(1).values.diff(1).ne(0).sum(1).float().mean().item() + 1:.2f}")
    base = get_moe_config(e, h, i, k, x0.dtype, T)
    tma = dict(base, B_TMA=1, num_stages=4)
    tma["down"] = dict(base.get("down", {}), num_stages=4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    uni_ids = torch.topk(torch.rand(T, e, device="cuda", generator=gen), k).indices.to(ids0.dtype)
    rx = torch.randn(T, h, device="cuda", dtype=x0.dtype, generator=gen)
    rw13 = torch.randn(w13.shape, device="cuda", dtype=w13.dtype, generator=gen) * 0.05
    rw2 = torch.randn(w2.shape, device="cuda", dtype=w2.dtype, generator=gen) * 0.05
    cases = [("model x, model ids, model w", x0, ids0, w13, w2),
             ("model x, uniform ids, model w", x0, uni_ids, w13, w2),
             ("randn x, model ids, model w", rx, ids0, w13, w2),
             ("randn x, uniform ids, randn w", rx, uni_ids, rw13, rw2),
             ("model x, model ids, randn w", x0, ids0, rw13, rw2)]
    fg, fd = 2 * T * k * h * 2 * i, 2 * T * k * i * h
    print("| case | config | pdl | gate_up us | down us | fused_moe us | sum+align us |")
    for name, x, ids, a13, a2 in cases:
        w = tw0.float().contiguous().view(-1)
        for cname, c in (("pointer", base), ("tma s4", tma)):
            for p in (False, True) if name == cases[0][0] else (False,):
                sid, eid, npost = moe_align_block_size(ids.contiguous(), c["BLOCK_SIZE_M"], 0, e,
                                                       False)
                inter = x.new_empty((T * k, i))
                y = x.new_empty((T * k, h))
                g = lambda: fm._grouped_gemm(x, a13, inter, None, sid, eid, npost, k, True, c,
                                             pdl=p)
                d = lambda: fm._grouped_gemm(inter, a2, y, w, sid, eid, npost, 1, False,
                                             down_config(c), pdl=p)
                f = lambda: fm.fused_moe(x, a13, a2, ids, tw0, 0, e, c, pdl=p)
                g(); d(); f()
                tg = do_bench_cudagraph(g, rep=100) * 1e3
                td = do_bench_cudagraph(d, rep=100) * 1e3
                tf = do_bench_cudagraph(f, rep=100) * 1e3
                print(f"| {name} | {cname} | {p} | {tg:.1f} ({fg / tg / 1e6:.0f} TF/s) | "
                      f"{td:.1f} ({fd / td / 1e6:.0f} TF/s) | {tf:.1f} | {tf - tg - td:.1f} |",
                      flush=True)
    # align alone, and the MIXED step's token count (1344) on the model's first 1344 rows
    for n in (T, 1344):
        x, ids, tw = x0[:n].contiguous(), ids0[:n].contiguous(), tw0[:n].contiguous()
        c = get_moe_config(e, h, i, k, x0.dtype, n)
        al = lambda: moe_align_block_size(ids, c["BLOCK_SIZE_M"], 0, e, False)
        al()
        print(f"align {n} tokens (BM {c['BLOCK_SIZE_M']}): "
              f"{do_bench_cudagraph(al, rep=100) * 1e3:.1f} us", flush=True)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                al()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8,
                                        max_name_column_width=40), flush=True)
        ct = dict(c, B_TMA=1)
        for cname, cc in (("pointer", c), ("tma", ct), ("tma s4", dict(ct, num_stages=4))):
            for p in (False, True):
                f = lambda: fm.fused_moe(x, w13, w2, ids, tw, 0, e, cc, pdl=p)
                f()
                print(f"fused_moe {n} tokens {cname} pdl={p}: "
                      f"{do_bench_cudagraph(f, rep=100) * 1e3:.1f} us", flush=True)
    # the same GEMMs eagerly in a loop over 48 captured layers, as the step runs them
    for cname, c in (("pointer", base), ("tma s4", tma)):
        for p in (False, True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for rep in range(2):
                start.record()
                for x, a13, a2, ids, tw, _ in cap:
                    fm.fused_moe(x, a13, a2, ids, tw, 0, e, c, pdl=p)
                end.record()
                torch.cuda.synchronize()
            print(f"eager 48 layers {cname} pdl={p}: {start.elapsed_time(end) / 48 * 1e3:.1f} "
                  f"us a layer (fused_moe incl. align + sum)", flush=True)


if __name__ == "__main__":
    main()
