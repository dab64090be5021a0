"""`python -m moeserve.planner`: predict a deployment, sweep deployments, check the predictions.

    python -m moeserve.planner --model deepseek_v3 --gpu h100 --prefill-nodes 4 --decode-nodes 9 \\
        --tbo --batch 256 --chunk 16384 --redundant 32 --kernels best --input-len 2000
    python -m moeserve.planner --model deepseek_v3 --gpu h200 --sweep --nodes 1 2 4 \\
        --slo itl_ms=50 --plot plan.png --emit-deploy dsv3_planned
    python -m moeserve.planner --model qwen3_30b_a3b --gpu h200 --dtype bf16 --nodes 1 \\
        --gpus-per-node 1 --batch 256 --serving 256
    python -m moeserve.planner --check
"""

from __future__ import annotations

import argparse
import sys

from moeserve.planner.deploy import Deployment, Role, write_deploy
from moeserve.planner.predict import Prediction, RolePrediction, predict
from moeserve.planner.step import PARTS
from moeserve.planner.sweep import (
    SLO,
    SweepSpace,
    best,
    cost_model,
    node_split,
    plot,
    sweep_decode,
    sweep_prefill,
    table,
)
from moeserve.planner.workload import Workload

GRAPHS = {"auto": None, "on": True, "off": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moeserve.planner",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--model", default="deepseek_v3", help="shape name or HF folder")
    p.add_argument("--gpu", default="h100", help="h100 | h200 | h800 | h20 | gb200_nvl72 | FILE")
    p.add_argument("--dtype", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--kernels", default="moeserve", choices=["moeserve", "best"],
                   help="price moeserve's kernels, or the best measured/published per op")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=2000)
    w.add_argument("--output-len", type=int, default=100)
    w.add_argument("--prefix-hit", type=float, default=0.0)
    w.add_argument("--popularity", default="zipf:0.8", help="zipf:S or an EPLB dump file")
    d = p.add_argument_group("deployment (one plan)")
    d.add_argument("--prefill-nodes", type=int, default=None, help="PD disaggregated")
    d.add_argument("--decode-nodes", type=int, default=None)
    d.add_argument("--nodes", type=int, nargs="+", default=[1],
                   help="colocated nodes (one plan), or the node counts a sweep tries")
    d.add_argument("--gpus-per-node", type=int, default=8)
    d.add_argument("--ep", type=int, default=None, help="EP size (default: every GPU of a role)")
    d.add_argument("--batch", type=int, nargs="+", default=[128], help="decode requests/GPU")
    d.add_argument("--chunk", type=int, nargs="+", default=None,
                   help="prefill tokens/GPU/step (default 8192; colocated 2048, as the runtime)")
    d.add_argument("--tbo", action="store_true")
    d.add_argument("--redundant", type=int, default=32)
    d.add_argument("--mtp", type=int, default=0, help="MTP draft steps")
    d.add_argument("--accept-len", type=float, default=1.0)
    d.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                   help="decode CUDA graphs (auto: where moeserve captures them today: ep 1)")
    s = p.add_argument_group("sweep and output")
    s.add_argument("--sweep", action="store_true", help="EP sizes (--nodes) x batch x TBO")
    s.add_argument("--slo", nargs="*", default=[], help="itl_ms=N ttft_ms=N")
    s.add_argument("--plot", default=None, help="PNG of throughput against ITL (sweep)")
    s.add_argument("--emit-deploy", default=None, metavar="NAME",
                   help="write the (best) plan as conf/deploy/NAME*.yaml")
    s.add_argument("--deploy-dir", default=None, help="a conf/ folder other than the package's")
    s.add_argument("--serving", type=int, default=None, metavar="C",
                   help="colocated: simulate bench.serving at C concurrent (2C requests)")
    s.add_argument("--check", action="store_true", help="predicted vs measured/published")
    return p.parse_args(argv)


def describe(p: RolePrediction) -> str:
    r, b = p.role, p.breakdown
    what = "input" if r.kind == "prefill" else "output"
    lat = "TTFT" if r.kind == "prefill" else "ITL"
    parts = ", ".join(f"{k} {b.parts[k] / 1e3:.2f}" for k in PARTS if abs(b.parts[k]) > 1)
    src = ", ".join(f"{n} {k}" for k, n in sorted(b.source_summary().items()))
    return (f"{r.kind}: {r.nodes} node(s) x {r.gpus_per_node}, EP {r.ep_size}, "
            f"{'batch ' + str(r.batch) if r.kind != 'prefill' else 'chunk ' + str(r.chunk)}, "
            f"TBO {'on' if r.tbo else 'off'}, MTP {r.mtp_steps}, balancedness {p.balance:.3f}\n"
            f"  step {p.step_ms:.2f} ms ({parts}) ms\n"
            f"  {what} tok/s: {p.tok_s_gpu:,.0f} per GPU, {p.tok_s_node:,.0f} per node; "
            f"{lat} {p.latency_ms:.1f} ms\n"
            f"  memory per GPU: {p.memory.describe()}{'' if p.fits else '  -> REFUSED'}\n"
            f"  costs: {src}"
            + ("\n  host-bound: eager steps (moeserve captures no EP decode graphs yet); "
               "--graphs on prices graph replay" if b.parts["host"] > 0 else ""))


def provenance(dep: Deployment) -> str:
    c = cost_model(dep.profile, dep.kernels)
    table = c.table.get("device") or "none"
    how = "scaled from " + c.ref.name if c.scaled else "measured on this GPU"
    return (f"{c.profile.gpu}: cost table {table} ({how}); sheet figures: "
            + ", ".join(f"{k} {v}" for k, v in c.profile.sources().items()))


def one_plan(a: argparse.Namespace, w: Workload) -> int:
    colocated = not (a.prefill_nodes and a.decode_nodes)
    chunk = a.chunk[0] if a.chunk else (2048 if colocated else 8192)
    common = dict(gpus_per_node=a.gpus_per_node, ep=a.ep, tbo=a.tbo, redundant=a.redundant,
                  mtp_steps=a.mtp, accept_len=a.accept_len, graphs=GRAPHS[a.graphs])
    if not colocated:
        dep = Deployment(a.model, a.gpu, a.dtype, a.kernels,
                         prefill=Role("prefill", a.prefill_nodes, chunk=chunk, **common),
                         decode=Role("decode", a.decode_nodes, batch=a.batch[0], **common))
    else:
        dep = Deployment(a.model, a.gpu, a.dtype, a.kernels,
                         colocated=Role("colocated", a.nodes[0], batch=a.batch[0],
                                        chunk=chunk, **common))
    pred = predict(dep, w)
    print(provenance(dep))
    for r in pred.roles:
        print(describe(r))
    if a.serving and dep.colocated:
        from moeserve.planner.arch import load_shape
        from moeserve.planner.serving import ServingRun, simulate

        res = simulate(load_shape(a.model), cost_model(a.gpu, a.kernels), dep.colocated,
                       a.dtype, ServingRun(2 * a.serving, a.serving, chunk=chunk))
        print(f"bench.serving at {a.serving} concurrent (simulated): {res.output_tok_s:,.0f} "
              f"output tok/s, median TTFT {res.ttft_ms:.0f} ms, median ITL {res.itl_ms:.1f} ms")
    _emit(a, pred)
    return 0 if pred.fits else 3


def _emit(a: argparse.Namespace, pred: Prediction) -> None:
    if not a.emit_deploy:
        return
    if not pred.fits:
        raise SystemExit("refusing to write a deploy preset for a plan that does not fit memory")
    note = (f"{pred.deployment.model} on {pred.deployment.profile}, predicted "
            f"{pred.output_tok_s_gpu:,.0f} output tok/s/GPU at ITL {pred.itl_ms:.1f} ms")
    for path in write_deploy(pred.deployment, a.emit_deploy, note, a.deploy_dir):
        print(f"wrote {path}")


def sweep(a: argparse.Namespace, w: Workload) -> int:
    slo = SLO.parse(a.slo)
    space = SweepSpace(nodes=tuple(a.nodes), gpus_per_node=a.gpus_per_node,
                       batches=tuple(a.batch), chunks=tuple(a.chunk or (4096, 8192, 16384)),
                       redundant=a.redundant,
                       mtp=(0, a.mtp) if a.mtp else (0,), accept_len=a.accept_len,
                       graphs=GRAPHS[a.graphs])
    c = cost_model(a.gpu, a.kernels)
    dec = sweep_decode(a.model, c, w, a.dtype, space)
    pre = sweep_prefill(a.model, c, w, a.dtype, space)
    print(provenance(Deployment(a.model, a.gpu, a.dtype, a.kernels,
                                colocated=Role("colocated"))))
    print(table(pre + dec))
    bd, bp = best(dec, slo.itl_ms), best(pre, slo.ttft_ms)
    if a.plot:
        plot(dec, a.plot, slo.itl_ms, f"{a.model} {a.dtype} on {a.gpu}, input {w.input_len}, "
             f"output {w.output_len}")
        print(f"wrote {a.plot}")
    if bd is None or bp is None:
        print("no plan fits memory and meets the SLO")
        return 4
    ratio = node_split(bp, bd, w)
    print(f"\nbest under {slo}: decode {bd.role.nodes} node(s) batch {bd.role.batch} "
          f"TBO {'on' if bd.role.tbo else 'off'}: {bd.tok_s_gpu:,.0f} output tok/s/GPU at ITL "
          f"{bd.latency_ms:.1f} ms; prefill {bp.role.nodes} node(s) chunk {bp.role.chunk}: "
          f"{bp.tok_s_gpu:,.0f} input tok/s/GPU, TTFT {bp.latency_ms:.0f} ms; "
          f"{ratio:.2f} prefill node(s) per decode node for this workload")
    dep = Deployment(a.model, a.gpu, a.dtype, a.kernels, prefill=bp.role, decode=bd.role)
    _emit(a, Prediction(dep, w, [bp, bd]))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.check:
        from moeserve.planner.anchors import ANCHORS, EXTRA, OTHER, check, format_check

        print(format_check(check(ANCHORS + EXTRA + OTHER)))
        return 0
    w = Workload(a.input_len, a.output_len, a.prefix_hit, a.popularity)
    return sweep(a, w) if a.sweep else one_plan(a, w)


if __name__ == "__main__":
    sys.exit(main())
