"""Kernel costs for the step model: the op-cost tables measured by `bench.op_costs`
(`costs/*.json`), interpolated between their points, and tagged with where each number came from.

Sources, from best to worst: `measured` (a table point), `interpolated` (between points of a
measured table, or from the nearest measured shape scaled by the roofline ratio of the two
shapes), `scaled` (another GPU's table scaled by the ratio of the two spec sheets, op by op:
bandwidth-bound ops by HBM bandwidth, compute-bound ones by FLOP/s), `published` (a kernel's
published throughput, e.g. FlashMLA's) and `spec` (the sheet's roofline alone).

`kernels="moeserve"` prices what our runtime dispatches to; `kernels="best"` the fastest thing
measured or published for the op (MHA-form MLA prefill through SDPA, FlashMLA decode, grouped
expert GEMMs at dense-GEMM efficiency), which is what SGLang-like stacks run.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass

from moeserve.config_schema import AttentionConfig
from moeserve.planner.arch import ModelShape
from moeserve.planner.profiles import HardwareProfile, load_profile

COST_DIR = os.path.join(os.path.dirname(__file__), "costs")
SCHEMA = "moeserve.op_costs/1"
# The part of a kernel's time that no GPU's bandwidth or FLOP/s shortens (launch gap, ramp):
# one-launch ops of a few KB take 1.4-2.0 us in a graph on the H100 (op_costs: RMSNorm at 1-16
# tokens) and 1.3-2.5 us on the H200 (docs/gpu_decode.md, small ops): the same on both
LAUNCH_FLOOR_US = 2.0
SMALL_MAX_PAIRS = 32  # fused_moe's GEMV path below this many pairs (when a table does not say)
# fresh GQA prefill steps from this many new tokens attend through SDPA (the runtime's default)
SDPA_MIN_TOKENS = AttentionConfig().sdpa_prefill_min_tokens
# FlashMLA's README (H800 SXM5, CUDA 12.8): up to 3000 GB/s memory-bound, 660 TFLOPS compute-bound
FLASHMLA_GBPS, FLASHMLA_TFLOPS, FLASHMLA_REF_TBPS = 3000.0, 660.0, 3.35


@dataclass(frozen=True)
class Cost:
    us: float
    source: str  # measured | interpolated | scaled | published | spec

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.us + other.us, worst(self.source, other.source))

    def times(self, f: float) -> Cost:
        return Cost(self.us * f, self.source)


RANK = ["measured", "interpolated", "scaled", "published", "spec"]


def worst(a: str, b: str) -> str:
    return a if RANK.index(a) >= RANK.index(b) else b


def interp(xs: list[float], ys: list[float], x: float) -> tuple[float, str]:
    """Piecewise log-log interpolation; below the first point the first value (a launch floor),
    above the last the last value scaled linearly in x (throughput-bound)."""
    for xi, yi in zip(xs, ys):
        if abs(xi - x) <= 1e-6 * max(1.0, xi):
            return yi, "measured"
    if x <= xs[0]:
        return ys[0], "interpolated"
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1], "interpolated"
    j = bisect.bisect_left(xs, x)
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0))), "interpolated"


class CostModel:
    """Costs of one GPU's ops (µs), from its measured table or a scaled reference table."""

    def __init__(self, profile: HardwareProfile, kernels: str = "moeserve",
                 table_path: str | None = None):
        if kernels not in ("moeserve", "best"):
            raise ValueError(f"kernels must be moeserve or best, not {kernels!r}")
        self.profile, self.kernels = profile, kernels
        self.ref = profile
        name = profile.cost_table
        if table_path is None and name is None and profile.scale_costs_from:
            self.ref = load_profile(profile.scale_costs_from)
            name = self.ref.cost_table
        path = table_path or (os.path.join(COST_DIR, name) if name else None)
        self.table = load_table(path) if path else {"ops": {}, "device": None}
        self.scaled = self.ref is not profile

    # ---- the roofline of the sheet, for shape and GPU scaling ----
    def roof(self, nbytes: float, flops: float, dtype: str, prof: HardwareProfile | None = None
             ) -> float:
        p = prof or self.profile
        return max(nbytes / p.hbm_bytes_per_s, flops / p.flops(dtype)) * 1e6

    def _finish(self, us: float, src: str, nbytes: float, flops: float, dtype: str) -> Cost:
        """Scale a reference-GPU figure to this GPU by the two sheets' rooflines."""
        if not self.scaled or src in ("spec", "published"):
            return Cost(us, src)
        f = self.roof(nbytes, flops, dtype) / self.roof(nbytes, flops, dtype, self.ref)
        fixed = min(us, LAUNCH_FLOOR_US)
        return Cost(fixed + (us - fixed) * f, "scaled")

    def _spec(self, nbytes: float, flops: float, dtype: str) -> Cost:
        return Cost(self.roof(nbytes, flops, dtype) / 0.7 + LAUNCH_FLOOR_US, "spec")

    def rows(self, op: str, **match) -> list[dict]:
        return [r for r in self.table["ops"].get(op, [])
                if all(r.get(k) == v for k, v in match.items())]

    # ---- ops ----
    def gemm(self, m: int, k: int, n: int, dtype: str) -> Cost:
        """[m, k] x [k, n] as the runtime runs it (bf16 cuBLAS / GEMV, or block-FP8)."""
        nbytes = k * n * (1 if dtype == "fp8" else 2) + 2 * m * (k + n)
        flops = 2.0 * m * k * n
        if m <= 0:
            return Cost(0.0, "measured")
        rows = self.rows("gemm", dtype=dtype) or self.rows("gemm")
        if not rows:
            return self._spec(nbytes, flops, dtype)
        exact = [r for r in rows if r["k"] == k and r["n"] == n and r["dtype"] == dtype]
        row = exact[0] if exact else min(rows, key=lambda r: abs(math.log(r["k"] / k))
                                         + abs(math.log(r["n"] / n))
                                         + (0 if r["dtype"] == dtype else 3))
        us, src = interp(row["m"], row["us"], m)
        if not exact:
            rb = row["k"] * row["n"] * (1 if row["dtype"] == "fp8" else 2) + 2 * m * (
                row["k"] + row["n"])
            us *= self.roof(nbytes, flops, dtype, self.ref) / self.roof(
                rb, 2.0 * m * row["k"] * row["n"], row["dtype"], self.ref)
            src = "interpolated"
        return self._finish(us, src, nbytes, flops, dtype)

    def absorb(self, m: int, s: ModelShape) -> Cost:
        """MLA decode's per-head products q_nope x W_UK and out x W_UV (bf16 batched GEMMs)."""
        nope = s.head_dim - s.rope_dim
        total = Cost(0.0, "measured")
        for k, n in ((nope, s.kv_lora), (s.kv_lora, s.v_head_dim)):
            flops, nbytes = 2.0 * m * s.heads * k * n, 2 * s.heads * (k * n + m * (k + n))
            rows = self.rows("bmm", k=k, n=n)
            if not rows:
                total = total + self.gemm(m, k, n * s.heads, "bf16")
                continue
            us, src = interp(rows[0]["m"], rows[0]["us"], m)
            us *= s.heads / rows[0]["heads"]
            total = total + self._finish(us, src, nbytes, flops, "bf16")
        return total

    def moe(self, s: ModelShape, dtype: str, touched: float, pairs: float) -> Cost:
        """Routed experts on one GPU: `touched` local experts receiving `pairs` (token, expert)
        pairs in all, priced per expert at the table's time per expert for that many tokens per
        expert. `best` also prices grouped GEMMs at dense-GEMM efficiency and takes the faster."""
        if touched <= 0 or pairs <= 0:
            return Cost(0.0, "measured")
        tpe = pairs / touched
        elt = 1 if dtype == "fp8" else 2
        nbytes, flops = touched * 3 * s.hidden * s.moe_inter * elt, 6.0 * pairs * s.hidden * \
            s.moe_inter
        rows = self.rows("moe", dtype=dtype) or self.rows("moe")
        if not rows:
            return self._spec(nbytes, flops, dtype)
        # the nearest expert shape, then the row whose expert count is nearest to `touched`
        # (the sorted path streams many experts better than a few)
        row = min(rows, key=lambda r: (
            abs(math.log(r["h"] * r["i"] / (s.hidden * s.moe_inter)))
            + (0 if r["dtype"] == dtype else 3), abs(math.log(r["experts"] / touched))))
        # the GEMV path (few pairs) and the sorted path price an expert differently: use the
        # points of the path this call takes. The GEMV path streams each touched expert once,
        # so its time per expert goes by how many experts are touched; the sorted path's by
        # tokens per expert (by tokens per expert, the GEMV points of 1.00 and 1.03 differed
        # by 30%: more experts in flight, not more tokens, made the second cheaper)
        small = pairs <= row.get("small_max_pairs", SMALL_MAX_PAIRS)
        pts = [(u if small else t * row["topk"] / u, us / u)
               for t, u, us in zip(row["tokens"], row["touched"], row["us"])
               if (t * row["topk"] <= row.get("small_max_pairs", SMALL_MAX_PAIRS)) == small]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        order = sorted(range(len(xs)), key=xs.__getitem__)
        pe, src = interp([xs[i] for i in order], [ys[i] for i in order],
                         touched if small else tpe)
        if (row["h"], row["i"], row["dtype"]) != (s.hidden, s.moe_inter, dtype):
            rb = 3 * row["h"] * row["i"] * (1 if row["dtype"] == "fp8" else 2)
            pe *= self.roof(nbytes / touched, flops / touched, dtype, self.ref) / self.roof(
                rb, 6.0 * tpe * row["h"] * row["i"], row["dtype"], self.ref)
            src = "interpolated"
        cost = self._finish(pe * touched, src, nbytes, flops, dtype)
        if self.kernels == "best":
            m = max(1, round(tpe))
            grouped = (self.gemm(m, s.hidden, 2 * s.moe_inter, dtype)
                       + self.gemm(m, s.moe_inter, s.hidden, dtype)).times(touched)
            if grouped.us < cost.us:
                cost = Cost(grouped.us, worst(grouped.source, "interpolated"))
        return cost

    def attn_decode(self, s: ModelShape, batch: int, context: float) -> Cost:
        """One layer's decode attention over `batch` requests of `context` cached tokens."""
        if batch <= 0:
            return Cost(0.0, "measured")
        kv_tok = (s.kv_lora + s.rope_dim if s.attention == "mla"
                  else 2 * s.kv_heads * s.head_dim)
        dk = s.kv_lora + s.rope_dim if s.attention == "mla" else s.head_dim
        dv = s.kv_lora if s.attention == "mla" else s.v_head_dim
        nbytes = 2.0 * batch * context * kv_tok
        flops = 2.0 * batch * context * s.heads * (dk + dv)
        if self.kernels == "best" and s.attention == "mla":
            bw = FLASHMLA_GBPS * 1e9 * self.profile.hbm_tbps.value / FLASHMLA_REF_TBPS
            us = max(nbytes / bw, flops / (FLASHMLA_TFLOPS * 1e12)) * 1e6 + LAUNCH_FLOOR_US
            return Cost(us, "published")
        kind = "mla" if s.attention == "mla" else "gqa"
        rows = self.rows("attn_decode", impl="moeserve", kind=kind)
        if not rows:
            return self._spec(nbytes, flops, "bf16")
        key = (s.heads, s.kv_heads if kind == "gqa" else 1)
        same = [r for r in rows if (r["heads"], r["kv_heads"]) == key] or rows
        ref = same[0]
        by_b = sorted({r["batch"] for r in same})
        pts = []
        for b in by_b:
            r = next(r for r in same if r["batch"] == b and r["heads"] == ref["heads"]
                     and r["kv_heads"] == ref["kv_heads"])
            pts.append(interp(r["context"], r["us"], context))
        us, src = interp([float(b) for b in by_b], [p[0] for p in pts], batch)
        src = worst(src, max((p[1] for p in pts), key=RANK.index))
        if (ref["heads"], ref["kv_heads"]) != key:
            if kind == "mla":
                # our MLA kernel runs a program per 16 heads per KV split: its time goes with the
                # heads (V2-Lite's 16 heads: 71 us at 256 x 512 on the H200, gpu_decode.md;
                # V3's 128 here: 8x) down to the KV read at 80% of the sheet's bandwidth and
                # its two launches
                us = max(us * s.heads / ref["heads"], nbytes / (0.8 * self.ref.hbm_bytes_per_s)
                         * 1e6, min(us, 2 * LAUNCH_FLOOR_US))  # split + reduce launches
            else:
                rkv = 2 * ref["kv_heads"] * ref["head_dim"]
                rb, rf = 2.0 * batch * context * rkv, 2.0 * batch * context * ref["heads"] * (
                    dk + dv)
                us *= self.roof(nbytes, flops, "bf16", self.ref) / self.roof(rb, rf, "bf16",
                                                                             self.ref)
            src = "interpolated"
        return self._finish(us, src, nbytes, flops, "bf16")

    def attn_prefill(self, s: ModelShape, n_req: float, new: float, prefix: float) -> Cost:
        """One layer's causal attention for n_req requests of `new` tokens over `prefix` cached
        ones. moeserve runs MLA in absorbed form; `best` in MHA form through SDPA. GQA steps of
        fresh prompts (no prefix) holding SDPA_MIN_TOKENS or more run the runtime's SDPA call
        (attention.sdpa_prefill_min_tokens), where the table has its rows."""
        if n_req <= 0 or new <= 0:
            return Cost(0.0, "measured")
        mha = s.attention == "mla" and self.kernels == "best"
        kind = "mha" if mha else ("mla" if s.attention == "mla" else "gqa")
        dk = s.head_dim if kind != "mla" else s.kv_lora + s.rope_dim
        dv = s.v_head_dim if kind != "mla" else s.kv_lora
        flops = 2.0 * n_req * s.heads * (dk + dv) * new * (prefix + new / 2)
        nbytes = 2.0 * n_req * (new + prefix) * s.heads * (dk + dv)
        sdpa = mha or (kind == "gqa" and prefix == 0 and SDPA_MIN_TOKENS is not None
                       and n_req * new >= SDPA_MIN_TOKENS)
        rows = (sdpa and self.rows("attn_extend", impl="sdpa", kind=kind)) or self.rows(
            "attn_extend", impl="moeserve", kind=kind)
        if not rows:
            return self._spec(nbytes, flops, "bf16")
        row = min(rows, key=lambda r: abs(math.log(r["heads"] / s.heads))
                  + abs(math.log(r.get("kv_heads", 1) / max(s.kv_heads, 1))))
        # a prefix costs as the extra query-key pairs it adds: scale from the causal figure
        us, src = interp(row["seq"], row["us"], new)
        us *= n_req * (prefix + new / 2) / (new / 2) * s.heads / row["heads"]
        if prefix or n_req != 1 or row["heads"] != s.heads:
            src = worst(src, "interpolated")
        return self._finish(us, src, nbytes, flops, "bf16")

    def norm(self, tokens: int, h: int) -> Cost:
        return self._small("norm", dict(h=h), tokens, 6.0 * tokens * h, 8.0 * tokens * h)

    def router(self, tokens: int, s: ModelShape) -> Cost:
        nbytes, flops = 2.0 * tokens * s.hidden + 4.0 * s.experts * s.hidden, 2.0 * tokens * \
            s.hidden * s.experts
        return self._small("router", dict(experts=s.experts), tokens, nbytes, flops)

    def glue(self, tokens: int, h: int) -> Cost:
        """A small one-launch op (q/k norm + rope, KV store, argmax, a residual add) priced as
        an RMSNorm of the same size: the table measures no such op on its own."""
        c = self.norm(tokens, h)
        return Cost(c.us, worst(c.source, "interpolated"))

    def _small(self, op: str, match: dict, tokens: int, nbytes: float, flops: float) -> Cost:
        if tokens <= 0:
            return Cost(0.0, "measured")
        rows = self.rows(op, **match) or self.rows(op)
        if not rows:
            return self._spec(nbytes, flops, "bf16")
        row = rows[0]
        us, src = interp(row["tokens"], row["us"], tokens)
        if any(row.get(k) != v for k, v in match.items()):
            src = "interpolated"
        return self._finish(us, src, nbytes, flops, "bf16")


def load_table(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} table (schema {doc.get('schema')!r})")
    return doc
