"""`python -m moeserve.bench.serving`: online serving benchmark against an OpenAI-compatible server.

Sends `--num-prompts` random-token prompts to `/v1/completions` (or `/v1/chat/completions`) with
Poisson arrivals (`--request-rate`, inf = all at once) and/or a concurrency cap
(`--max-concurrency`), streams the answers over SSE and reports throughput, end-to-end latency,
TTFT (time to first content chunk), ITL (gaps between content chunks) and TPOT:

    python -m moeserve.bench.serving --base-url http://127.0.0.1:30000 --num-prompts 64 \\
        --max-concurrency 8 --random-input-len 128 --random-output-len 128 --ignore-eos

Works against moeserve's server, SGLang and `transformers serve` (which rejects `ignore_eos`: pass
`--no-ignore-eos-field`). Output tokens come from the stream's final `usage` when the server sends
one, else from re-tokenizing the generated text. `run_benchmark(args)` is the programmatic entry
point (a Namespace, or a dict of overrides on the CLI defaults); it returns the metrics dict.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import httpx

BACKENDS = ("openai-completions", "openai-chat")
DATASETS = ("random",)


# ----------------------------------------------------------------------------------------- args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moeserve.bench.serving",
        description="Online serving benchmark against an OpenAI-compatible HTTP server.",
    )
    p.add_argument("--base-url", default=None,
                   help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=BACKENDS, default="openai-completions")
    p.add_argument("--model", default=None,
                   help="model id for the requests (default: first id of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a Bearer token")
    p.add_argument("--tokenizer", default=None,
                   help="local HF tokenizer folder "
                        "(default: /server_info model_path, then --model as a folder)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [ratio*len, len]")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s; inf sends everything at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true so every request generates exactly max_tokens")
    p.add_argument("--no-ignore-eos-field", action="store_true",
                   help="never send ignore_eos (for servers that reject it: transformers serve)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-request-body", default=None,
                   help="JSON object merged into every request body")
    p.add_argument("--disable-stream", action="store_true",
                   help="non-streaming requests (TTFT = E2E latency, no ITL)")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--output-file", default=None,
                   help="append one JSON line per run (metrics + args)")
    p.add_argument("--tag", default=None, help="free-form label stored in the output file")
    p.add_argument("--quiet", action="store_true", help="do not print the result table")
    return p


def _normalize_args(args: argparse.Namespace | dict | None) -> argparse.Namespace:
    if isinstance(args, argparse.Namespace):
        return args
    ns = build_parser().parse_args([])
    for key, value in (args or {}).items():
        key = key.replace("-", "_")
        if not hasattr(ns, key):
            raise TypeError(f"unknown benchmark argument {key!r}")
        setattr(ns, key, value)
    return ns


def base_url_of(args: argparse.Namespace) -> str:
    url = args.base_url or f"http://{args.host}:{args.port}"
    return url.rstrip("/").removesuffix("/v1")


# ------------------------------------------------------------------------------------ tokenizer


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """AutoTokenizer for a local folder (cached: repeated programmatic runs reuse it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _usable_token_ids(tokenizer) -> np.ndarray:
    """Every vocabulary id except special and added tokens."""
    excluded = set(tokenizer.all_special_ids or [])
    excluded.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    n = len(tokenizer)
    ids = np.array([i for i in range(n) if i not in excluded], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer has no regular tokens to sample from")
    return ids


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_random_prompt(tokenizer, n_tokens: int, rng: np.random.Generator,
                       usable: np.ndarray, max_rounds: int = 16) -> tuple[str, int]:
    """Text that re-encodes to `n_tokens` tokens (random ids, decode, re-encode, trim/pad, repeat).

    → (prompt, its token count); the count can differ from `n_tokens` only if no round converged.
    """
    ids = rng.choice(usable, n_tokens).tolist()
    text, count = "", 0
    for _ in range(max_rounds):
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = _encode(tokenizer, text)
        count = len(again)
        if count == n_tokens:
            break
        if count > n_tokens:
            ids = again[:n_tokens]
        else:
            ids = again + rng.choice(usable, n_tokens - count).tolist()
    return text, count


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


def _lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    lo = max(1, int(length * ratio))
    hi = max(lo, length)
    return rng.integers(lo, hi + 1, size=n).tolist()


def sample_random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float, seed: int) -> list[BenchRequest]:
    """Random-token prompts with input/output lengths uniform in [ratio*len, len]."""
    rng = np.random.default_rng(seed)
    in_lens = _lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = _lengths(output_len, range_ratio, num_prompts, rng)
    if tokenizer is None:  # no tokenizer: ~one token per random lowercase word (approximate)
        words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 4)) for _ in range(512)]
        return [BenchRequest(" ".join(rng.choice(words, n)), n, o)
                for n, o in zip(in_lens, out_lens)]
    usable = _usable_token_ids(tokenizer)
    out = []
    for n, o in zip(in_lens, out_lens):
        prompt, count = make_random_prompt(tokenizer, n, rng, usable)
        out.append(BenchRequest(prompt, count, o))
    return out


# -------------------------------------------------------------------------------------- requests


@dataclass
class RequestResult:
    success: bool = False
    latency: float = 0.0  # seconds, send → last byte
    ttft: float = 0.0  # seconds, send → first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    generated_text: str = ""
    output_tokens: int = 0
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    prompt_len: int = 0
    requested_output_len: int = 0
    chunks: int = 0
    got_done: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send


def _build_payload(args: argparse.Namespace, model: str, req: BenchRequest, stream: bool,
                   extra: dict) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len,
                            "temperature": args.temperature, "stream": stream}
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos and not args.no_ignore_eos_field:
        body["ignore_eos"] = True
    body.update(extra)
    return body


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


def _take_usage(res: RequestResult, usage: Any) -> None:
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            res.usage_output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            res.usage_prompt_tokens = int(usage["prompt_tokens"])


async def send_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool,
                       headers: dict) -> RequestResult:
    """One request; streams when body["stream"]. Never raises: failures set `error`."""
    res = RequestResult()
    start = res.start = time.perf_counter()
    last = start
    try:
        if not body.get("stream"):
            resp = await client.post(url, json=body, headers=headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:500]}"
                return res
            data = resp.json()
            res.latency = res.ttft = time.perf_counter() - start
            res.generated_text = "".join(_chunk_text(c, chat) for c in data.get("choices") or [])
            _take_usage(res, data.get("usage"))
            res.success = True
            return res
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {text[:500]}"
                return res
            parts: list[str] = []
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event:/id: fields
                data_str = line[5:].strip()
                if data_str == "[DONE]":
                    res.got_done = True
                    break
                try:
                    chunk = json.loads(data_str)
                except json.JSONDecodeError:
                    continue
                if chunk.get("error"):
                    res.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return res
                _take_usage(res, chunk.get("usage"))
                text = "".join(_chunk_text(c, chat) for c in chunk.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                if res.chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.chunks += 1
                parts.append(text)
            # A server may close the stream without `data: [DONE]` (transformers serve does).
        res.latency = time.perf_counter() - start
        res.generated_text = "".join(parts)
        res.success = True
    except Exception as e:  # noqa: BLE001 — report, don't crash the run
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return res


def count_output_tokens(res: RequestResult, tokenizer) -> int:
    """usage.completion_tokens if sent, else the re-tokenized text, else the chunk count."""
    if res.usage_output_tokens is not None:
        return res.usage_output_tokens
    if tokenizer is not None:
        return len(_encode(tokenizer, res.generated_text)) if res.generated_text else 0
    return res.chunks if res.chunks else (1 if res.generated_text else 0)


# --------------------------------------------------------------------------------------- metrics


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(np.percentile(a, 90)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99))}


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    requested = sum(r.requested_output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    dur = max(duration, 1e-9)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_requested_output_tokens": requested,
        "output_len_mismatches": sum(r.output_tokens != r.requested_output_len for r in ok),
        "min_output_tokens": min((r.output_tokens for r in ok), default=0),
        "max_output_tokens": max((r.output_tokens for r in ok), default=0),
        "usage_reported": sum(r.usage_output_tokens is not None for r in ok),
        "done_received": sum(r.got_done for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur,  # mean requests in flight (Little's law)
    }
    for name, values in (("e2e_latency", [r.latency for r in ok]), ("ttft", [r.ttft for r in ok]),
                         ("itl", itls), ("tpot", tpots)):
        for stat, value in _stats(values).items():
            m[f"{stat}_{name}_ms"] = value
    return m


# (section title, row label, metric key): SGLang's bench_serving latency blocks, mean/median/p99 each
LATENCY_SECTIONS = (("End-to-End Latency", "E2E Latency", "e2e_latency"),
                    ("Time to First Token", "TTFT", "ttft"),
                    ("Time per Output Token (excl. 1st token)", "TPOT", "tpot"),
                    ("Inter-Token Latency", "ITL", "itl"))


def format_table(m: dict[str, Any], args: argparse.Namespace) -> str:
    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40} {value!s:<10}"

    def section(title: str) -> str:
        return f"{title:-^50}"

    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        row("Backend:", args.backend),
        row("Traffic request rate:", args.request_rate),
        row("Max request concurrency:", args.max_concurrency or "not set"),
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Benchmark duration (s):", m["duration"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Total requested output tokens:", m["total_requested_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Input token throughput (tok/s):", m["input_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_throughput"]),
        row("Concurrency:", m["concurrency"]),
    ]
    for title, label, key in LATENCY_SECTIONS:
        lines.append(section(title))
        lines += [row(f"{stat.title()} {label} (ms):", m[f"{stat}_{key}_ms"])
                  for stat in ("mean", "median", "p99")]
    lines.append("=" * 50)
    if m["output_len_mismatches"]:
        lines.append(f"note: {m['output_len_mismatches']} requests generated a different number of "
                     f"tokens than requested ({m['min_output_tokens']}..{m['max_output_tokens']})")
    if m["failed"]:
        lines.append(f"first error: {m['first_error']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the run


async def _get_json(client: httpx.AsyncClient, url: str, headers: dict) -> Any:
    try:
        resp = await client.get(url, headers=headers)
        if resp.status_code == 200:
            return resp.json()
    except Exception:  # noqa: BLE001 — optional endpoints
        pass
    return None


async def _resolve_model(client, base: str, headers: dict, model: str | None) -> str:
    if model:
        return model
    data = await _get_json(client, f"{base}/v1/models", headers)
    try:
        return data["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        raise SystemExit(f"could not read a model id from {base}/v1/models; pass --model") from None


async def _resolve_tokenizer(client, base: str, headers: dict, args, model: str):
    candidates = []
    if args.tokenizer:
        candidates.append(args.tokenizer)
    else:
        info = await _get_json(client, f"{base}/server_info", headers) or {}
        for key in ("tokenizer_path", "model_path"):
            if isinstance(info, dict) and info.get(key):
                candidates.append(info[key])
        candidates.append(model)
    for path in candidates:
        if os.path.isdir(path):
            try:
                return load_tokenizer(path), path
            except Exception as e:  # noqa: BLE001
                if args.tokenizer:
                    raise SystemExit(f"could not load tokenizer from {path}: {e}") from e
    if args.tokenizer:
        raise SystemExit(f"tokenizer folder {args.tokenizer} does not exist")
    print("warning: no local tokenizer found (pass --tokenizer DIR); prompt lengths are "
          "approximate "
          "and output tokens without usage are counted as stream chunks", file=sys.stderr)
    return None, None


async def run_benchmark(args: argparse.Namespace | dict | None = None) -> dict[str, Any]:
    """Run one benchmark; → metrics dict (also appended to --output-file when set)."""
    args = _normalize_args(args)
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be at least 1")
    base = base_url_of(args)
    chat = args.backend == "openai-chat"
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    stream = not args.disable_stream
    n_conn = max(args.max_concurrency or args.num_prompts, args.warmup_requests, 1) + 4
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await _resolve_model(client, base, headers, args.model)
        tokenizer, tokenizer_path = await _resolve_tokenizer(client, base, headers, args, model)
        requests = sample_random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed)

        if args.warmup_requests > 0:
            w = requests[0]
            warm = BenchRequest(w.prompt, w.prompt_len, min(w.output_len, 16))
            outs = await asyncio.gather(*[
                send_request(client, url, _build_payload(args, model, warm, stream, extra), chat,
                             headers)
                for _ in range(args.warmup_requests)])
            bad = [o for o in outs if not o.success]
            if bad:
                raise SystemExit(f"warmup request failed: {bad[0].error}")

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = np.random.default_rng(args.seed)

        async def one(req: BenchRequest) -> RequestResult:
            body = _build_payload(args, model, req, stream, extra)
            if sem is None:
                res = await send_request(client, url, body, chat, headers)
            else:
                async with sem:
                    res = await send_request(client, url, body, chat, headers)
            res.prompt_len = req.prompt_len
            res.requested_output_len = req.output_len
            if res.success:
                res.output_tokens = count_output_tokens(res, tokenizer)
            return res

        tasks = []
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            if i and math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0

    metrics = compute_metrics(list(results), duration)
    metrics.update({"backend": args.backend, "base_url": base, "model": model,
                    "tokenizer": tokenizer_path, "num_prompts": args.num_prompts,
                    "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
                    "random_input_len": args.random_input_len,
                    "random_output_len": args.random_output_len,
                    "random_range_ratio": args.random_range_ratio, "stream": stream,
                    "tag": args.tag})
    if not args.quiet:
        print(format_table(metrics, args))
    if args.output_file:
        record = dict(metrics)
        record["timestamp"] = time.time()
        record["args"] = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                          for k, v in vars(args).items() if k != "api_key"}
        record = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                  for k, v in record.items()}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metrics = asyncio.run(run_benchmark(args))
    return 0 if metrics["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
