"""The GPU cases of `python -m moeserve.bench.op_costs`: one function per op family, each
returning rows of the table (`impl`, shape keys, the swept variable, `us`).

`impl="moeserve"` rows run what the runtime dispatches to (`Linear` with the Triton ops attached,
`fp8_linear`'s path by M, `fused_moe`, the Triton attention backend, `RMSNorm`, the routers);
`impl="sdpa"` is torch's scaled_dot_product_attention: for the MHA-form MLA prefill that
SGLang-like stacks run (flash), so the planner can price either, and for GQA the runtime's own
fresh-prefill call (attention/sdpa_prefill.py, cuDNN first), which it takes from
`attention.sdpa_prefill_min_tokens` fresh tokens a step.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch

from moeserve.bench.graph_timing import copies_for, time_graph

MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
# (model, k, n, dtypes): the linear shapes of the models the planner prices
GEMMS = [
    ("deepseek_v3", 7168, 2112, ("fp8", "bf16")),  # fused q_a + kv_a
    ("deepseek_v3", 1536, 24576, ("fp8", "bf16")),  # q_b
    ("deepseek_v3", 16384, 7168, ("fp8", "bf16")),  # o_proj
    ("deepseek_v3", 7168, 36864, ("fp8", "bf16")),  # dense gate_up
    ("deepseek_v3", 18432, 7168, ("fp8", "bf16")),  # dense down
    ("deepseek_v3", 7168, 4096, ("fp8", "bf16")),  # shared expert gate_up
    ("deepseek_v3", 2048, 7168, ("fp8", "bf16")),  # shared expert down
    ("deepseek_v3", 512, 32768, ("fp8", "bf16")),  # kv_b (MHA-form prefill)
    ("deepseek_v3", 7168, 129280, ("bf16",)),  # LM head
    ("qwen3_30b_a3b", 2048, 5120, ("bf16",)),  # qkv
    ("qwen3_30b_a3b", 4096, 2048, ("bf16",)),  # o_proj
    ("qwen3_30b_a3b", 2048, 129280, ("bf16",)),  # LM head (the benchmarks' 129280 vocabulary)
    ("llama3_8b", 4096, 6144, ("bf16",)),
    ("llama3_8b", 4096, 4096, ("bf16",)),
    ("llama3_8b", 4096, 28672, ("bf16",)),
    ("llama3_8b", 14336, 4096, ("bf16",)),
    ("deepseek_v2_lite", 2048, 3648, ("bf16",)),  # fused q + kv_a (16 x 192 + 576)
    ("deepseek_v2_lite", 2048, 2048, ("bf16",)),  # o_proj
    ("deepseek_v2_lite", 2048, 5632, ("bf16",)),  # shared experts gate_up (2 x 1408)
    ("deepseek_v2_lite", 2816, 2048, ("bf16",)),  # shared experts down
    ("deepseek_v2_lite", 2048, 129280, ("bf16",)),  # LM head (the benchmarks' vocabulary)
]
# (model, experts in the table, hidden, intermediate, topk, dtypes, token counts)
MOES = [
    ("deepseek_v3", 16, 7168, 2048, 8, ("fp8", "bf16"), [1, 4, 16, 64, 256, 1024, 4096, 16384]),
    # all of a layer's experts on one GPU: the sorted path over many experts streams better
    ("deepseek_v3", 256, 7168, 2048, 8, ("fp8", "bf16"), [16, 64, 256, 1024]),
    ("qwen3_30b_a3b", 128, 2048, 768, 8, ("bf16",), [1, 4, 16, 64, 256, 1024, 4096]),
    ("deepseek_v2_lite", 64, 2048, 1408, 6, ("bf16",), [1, 4, 16, 64, 256, 1024, 4096]),
]
# (model, kind, heads, kv_heads, head_dim, v_head_dim, rope)
ATTN = [
    ("deepseek_v3", "mla", 128, 1, 576, 512, 64),
    ("qwen3_30b_a3b", "gqa", 32, 4, 128, 128, 0),
    ("llama3_8b", "gqa", 32, 8, 128, 128, 0),
    ("deepseek_v2_lite", "mla", 16, 1, 576, 512, 64),  # 16 heads: a program per 16 heads
]
BATCHES, CONTEXTS = [1, 16, 64, 256], [512, 2048, 8192]
PDL = [True]  # programmatic dependent launches, as the runtime on sm90 (off under the interpreter)
PROMPTS = [512, 2048, 8192]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gemm_rows(device: torch.device) -> list[dict]:
    from moeserve.kernels.triton.ops import TritonOps
    from moeserve.layers.fp8_linear import fp8_linear
    from moeserve.layers.linear import Linear

    ops = TritonOps(pdl=PDL[0])
    rows = []
    for model, k, n, dtypes in GEMMS:
        for dtype in dtypes:
            elt = 1 if dtype == "fp8" else 2
            copies = copies_for(n * k * elt)
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
                  for _ in range(copies)]
            if dtype == "fp8":
                ws = [(w.to(torch.float8_e4m3fn), torch.ones(math.ceil(n / 128),
                       math.ceil(k / 128), device=device)) for w in ws]
            ms = [m for m in MS if m * n <= (1 << 30) and m * k <= (1 << 29)]
            us = []
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                if dtype == "fp8":
                    call = lambda i, x=x, ws=ws: partial(fp8_linear, x, *ws[i], pdl=PDL[0])  # noqa: E731
                else:
                    lins = []
                    for w in ws:
                        lin = Linear(k, n, bias=False, device="meta")
                        lin.weight = torch.nn.Parameter(w, requires_grad=False)
                        lin.gpu_ops = ops
                        lins.append(lin)
                    call = lambda i, x=x, lins=lins: (lambda: lins[i](x))  # noqa: E731
                with torch.no_grad():
                    us.append(time_graph(call, copies, device))
            rows.append(dict(impl="moeserve", model=model, dtype=dtype, k=k, n=n, m=ms, us=us))
            log(f"gemm {model} {dtype} {k}->{n}: " + " ".join(f"{u:.1f}" for u in us))
            del ws
            torch.cuda.empty_cache()
    return rows


def bmm_rows(device: torch.device) -> list[dict]:
    """MLA's absorbed W_UK / W_UV at decode: per head [M, 128] x [128, 512] and back (bf16)."""
    rows = []
    heads = 128
    for k, n in [(128, 512), (512, 128)]:
        copies = copies_for(heads * k * n * 2)
        ws = [torch.randn(heads, k, n, device=device, dtype=torch.bfloat16)
              for _ in range(copies)]
        ms = [m for m in MS if m <= 4096]
        us = []
        for m in ms:
            x = torch.randn(heads, m, k, device=device, dtype=torch.bfloat16)
            us.append(time_graph(lambda i, x=x: (lambda: torch.bmm(x, ws[i])), copies, device))
        rows.append(dict(impl="torch", model="deepseek_v3", heads=heads, k=k, n=n, m=ms, us=us))
        log(f"bmm {k}->{n}: " + " ".join(f"{u:.1f}" for u in us))
    return rows


def moe_rows(device: torch.device) -> list[dict]:
    from moeserve.kernels.triton.fused_moe import fused_moe
    from moeserve.kernels.triton.fused_moe_small import SMALL_MAX_PAIRS

    rows = []
    for model, e, h, inter, k, dtypes, tokens in MOES:
        for dtype in dtypes:
            # weights once per shape, drawn in bf16 (no float32 copy of 256 experts)
            w13 = torch.randn(e, 2 * inter, h, device=device, dtype=torch.bfloat16) / h**0.5
            w2 = torch.randn(e, h, inter, device=device, dtype=torch.bfloat16) / inter**0.5
            scales = {}
            if dtype == "fp8":
                w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
                scales = dict(w13_scale=torch.ones(e, 2 * math.ceil(inter / 128),
                                                   math.ceil(h / 128), device=device),
                              w2_scale=torch.ones(e, math.ceil(h / 128),
                                                  math.ceil(inter / 128), device=device))
            us, touched = [], []
            for t in tokens:
                x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
                logits, ids = torch.randn(t, e, device=device).topk(k, dim=1)
                w = logits.softmax(1)
                touched.append(int(ids.unique().numel()))
                call = partial(lambda i, f: f, f=partial(fused_moe, x, w13, w2, ids, w,
                                                         pdl=PDL[0], **scales))
                us.append(time_graph(call, 1, device))
            del w13, w2
            torch.cuda.empty_cache()
            rows.append(dict(impl="moeserve", model=model, dtype=dtype, experts=e, h=h, i=inter,
                             topk=k, tokens=tokens, touched=touched, us=us,
                             small_max_pairs=SMALL_MAX_PAIRS))
            log(f"moe {model} E={e} {dtype}: " + " ".join(f"{u:.1f}" for u in us))
    return rows


def _batch(kind: str, heads: int, kv_heads: int, head_dim: int, v_dim: int, rope: int,
           lens: list[int], prefix: int, device: torch.device, decode: bool):
    """A pool with `prefix` cached tokens per request and a batch adding lens[b] tokens each →
    (ForwardBatch, q, k, v, spec). Decode: lens are all 1."""
    from moeserve.attention.base import AttentionSpec
    from moeserve.core import ForwardMode
    from moeserve.forward_batch import ForwardBatch
    from moeserve.kvcache.pool import MHAKVPool, MLAKVPool
    from moeserve.kvcache.table import ReqToTokenPool

    dtype, b, per = torch.bfloat16, len(lens), prefix + max(lens)
    slots = b * per
    if kind == "mla":
        pool = MLAKVPool(slots, 1, v_dim, rope, dtype, device)
        pool.kv[0].normal_()
    else:
        pool = MHAKVPool(slots, 1, kv_heads, head_dim, v_dim, dtype, device)
        pool.k[0].normal_()
        pool.v[0].normal_()
    table = ReqToTokenPool(b, per, device)
    table.req_to_token.copy_((torch.arange(slots) + 1).view(b, per).to(device))
    n = sum(lens)
    pos = torch.cat([torch.arange(prefix, prefix + t) for t in lens]).to(device)
    loc = torch.cat([table.req_to_token[r, prefix:prefix + t] for r, t in enumerate(lens)])
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(n, dtype=torch.int64, device=device), positions=pos,
        out_cache_loc=loc, req_pool_indices=torch.arange(b, device=device),
        seq_lens=torch.tensor([prefix + t for t in lens], device=device),
        seq_lens_cpu=[prefix + t for t in lens], extend_prefix_lens_cpu=[prefix] * b,
        extend_seq_lens_cpu=list(lens), req_to_token_pool=table, kv_pool=pool, attn_backend=None)
    q = torch.randn(n, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(n, kv_heads, head_dim, dtype=dtype, device=device)
    v = None if kind == "mla" else torch.randn(n, kv_heads, v_dim, dtype=dtype, device=device)
    spec = AttentionSpec(0, heads, kv_heads, head_dim, v_dim, head_dim**-0.5)
    return fb, q, k, v, spec


def attn_decode_rows(device: torch.device) -> list[dict]:
    from moeserve.attention.triton_backend import TritonAttentionBackend

    rows = []
    for model, kind, heads, kvh, hd, vd, rope in ATTN:
        for b in BATCHES:
            us = []
            for ctx in CONTEXTS:
                us.append(_time_attention(TritonAttentionBackend(pdl=PDL[0]), _batch(
                    kind, heads, kvh, hd, vd, rope, [1] * b, ctx - 1, device, decode=True),
                    device))
            rows.append(dict(impl="moeserve", model=model, kind=kind, heads=heads, kv_heads=kvh,
                             head_dim=hd, v_head_dim=vd, batch=b, context=CONTEXTS, us=us))
            log(f"attn decode {model} b={b}: " + " ".join(f"{u:.1f}" for u in us))
    return rows + mla_bmm_rows(device)


def _time_attention(backend, batch: tuple, device: torch.device) -> float:
    """µs of one attention forward over `batch` (_batch's tuple, held by no caller) in a CUDA
    graph; its tensors are freed before the next case is built."""
    fb, q, k, v, spec = batch
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    fwd = partial(backend.forward, q, k, v, spec, fb)
    us = time_graph(lambda i, f=fwd: f, 1, device)
    del fb, q, k, v, batch
    torch.cuda.empty_cache()
    return us


def mla_bmm_rows(device: torch.device) -> list[dict]:
    """Absorbed MLA decode as two cuBLAS batched GEMMs per request (scores over the latent +
    rope channels, softmax, weights times the latent): what a plain torch stack runs, a
    reference beside our Triton kernel for a planner pricing other stacks."""
    rows = []
    heads, lat, rope = 128, 512, 64
    for b in BATCHES:
        us = []
        for ctx in CONTEXTS:
            q = torch.randn(b, heads, lat + rope, device=device, dtype=torch.bfloat16)
            kv = torch.randn(b, ctx, lat + rope, device=device, dtype=torch.bfloat16)

            def mla(q=q, kv=kv):
                p = torch.softmax(torch.bmm(q, kv.transpose(1, 2)).float() * 0.07, -1)
                return torch.bmm(p.to(kv.dtype), kv[..., :lat])
            us.append(time_graph(lambda i, f=mla: f, 1, device))
            del q, kv
        rows.append(dict(impl="torch", model="deepseek_v3", kind="mla", heads=heads, kv_heads=1,
                         head_dim=lat + rope, v_head_dim=lat, batch=b, context=CONTEXTS, us=us))
        log(f"attn decode torch mla b={b}: " + " ".join(f"{u:.1f}" for u in us))
    return rows


def attn_extend_rows(device: torch.device) -> list[dict]:
    """One causal prompt of L tokens, no cached prefix: ours (MLA absorbed), and for MLA the
    MHA form (128 heads, qk 192, v 128 padded to 192) through torch SDPA."""
    import torch.nn.functional as F

    from moeserve.attention.triton_backend import TritonAttentionBackend

    rows = []
    for model, kind, heads, kvh, hd, vd, rope in ATTN:
        us = []
        for n in PROMPTS:
            us.append(_time_attention(TritonAttentionBackend(), _batch(
                kind, heads, kvh, hd, vd, rope, [n], 0, device, decode=False), device))
        rows.append(dict(impl="moeserve", model=model, kind=kind, heads=heads, kv_heads=kvh,
                         head_dim=hd, v_head_dim=vd, seq=PROMPTS, us=us))
        log(f"attn extend {model}: " + " ".join(f"{u:.1f}" for u in us))
        if kind == "gqa":
            us = [_time_sdpa_prefill(heads, kvh, hd, n, device) for n in PROMPTS]
            rows.append(dict(impl="sdpa", model=model, kind=kind, heads=heads, kv_heads=kvh,
                             head_dim=hd, v_head_dim=vd, seq=PROMPTS, us=us))
            log(f"attn extend sdpa {model}: " + " ".join(f"{u:.1f}" for u in us))
    us = []
    for n in PROMPTS:
        q, k, v = (torch.randn(1, 128, n, 192, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        us.append(time_graph(lambda i: (lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True)), 1, device))
    rows.append(dict(impl="sdpa", model="deepseek_v3", kind="mha", heads=128, kv_heads=128,
                     head_dim=192, v_head_dim=128, seq=PROMPTS, us=us))
    log("attn extend sdpa mha: " + " ".join(f"{u:.1f}" for u in us))
    return rows


def _time_sdpa_prefill(heads: int, kv_heads: int, d: int, n: int, device: torch.device) -> float:
    """µs of the runtime's SDPA fresh prefill of one n-token prompt (its backend order)."""
    from moeserve.attention.sdpa_prefill import sdpa_prefill

    q = torch.randn(n, heads, d, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(n, kv_heads, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    return time_graph(lambda i: (lambda: sdpa_prefill(q, k, v, [n], d ** -0.5, out)), 1, device)


def norm_router_rows(device: torch.device) -> tuple[list[dict], list[dict]]:
    from moeserve.kernels.triton.ops import TritonOps
    from moeserve.layers.norm import RMSNorm
    from moeserve.layers.router import RouterConfig, select_experts

    ops = TritonOps(pdl=PDL[0])
    tokens = [1, 16, 64, 256, 1024, 4096, 16384]
    norms, routers = [], []
    for h in (7168, 2048, 4096):
        norm = RMSNorm(h).to(device=device, dtype=torch.bfloat16)
        norm.gpu_ops = ops
        us = []
        for t in tokens:
            x, r = (torch.randn(t, h, device=device, dtype=torch.bfloat16) for _ in range(2))
            us.append(time_graph(lambda i: (lambda: norm(x, r)), 1, device))
        norms.append(dict(impl="moeserve", h=h, tokens=tokens, us=us))
    cases = [("deepseek_v3", 256, 7168, RouterConfig(8, "sigmoid", True, 8, 4, "top2_sum", 2.5)),
             ("qwen3_30b_a3b", 128, 2048, RouterConfig(8))]
    for model, e, h, cfg in cases:
        gate = torch.randn(e, h, device=device) / h**0.5  # float32, as checkpoints keep it
        bias = torch.zeros(e, device=device) if cfg.scoring == "sigmoid" else None
        us = []
        for t in tokens:
            x = torch.randn(t, h, device=device, dtype=torch.bfloat16)

            def route(x=x):
                logits = ops.router_logits(x, gate)
                if logits is None:
                    logits = x.float() @ gate.t()
                return select_experts(logits, cfg, bias, ops)
            us.append(time_graph(lambda i, f=route: f, 1, device))
        routers.append(dict(impl="moeserve", model=model, experts=e, h=h, topk=cfg.top_k,
                            tokens=tokens, us=us))
        log(f"router {model}: " + " ".join(f"{u:.1f}" for u in us))
    return norms, routers


def measure_all(device: torch.device, only: list[str] | None = None,
                on_family=None) -> dict[str, list[dict]]:
    """Every family (or those in `only`); a family that fails is logged and left out, so one
    broken kernel does not cost the whole table. `on_family(out)` runs after each family (the
    CLI rewrites the JSON then, so a run cut short keeps what it measured)."""
    PDL[0] = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    fams = {"gemm": gemm_rows, "bmm": bmm_rows, "moe": moe_rows, "attn_decode": attn_decode_rows,
            "attn_extend": attn_extend_rows}
    out: dict[str, list[dict]] = {}
    with torch.no_grad():
        for name, fn in fams.items():
            if only and name not in only:
                continue
            try:
                out[name] = fn(device)
            except Exception as e:
                log(f"{name}: FAILED {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
            if on_family is not None:
                on_family(out)
        if not only or "norm" in only or "router" in only:
            try:
                out["norm"], out["router"] = norm_router_rows(device)
            except Exception as e:
                log(f"norm/router: FAILED {type(e).__name__}: {e}")
    return out
