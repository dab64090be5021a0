"""`python -m moeserve.bench.serving`: online serving benchmark against an OpenAI-compatible server.

Sends `--num-prompts` random-token prompts to `/v1/completions` (or `/v1/chat/completions`) with
Poisson arrivals (`--request-rate`, inf = all at once) and/or a concurrency cap
(`--max-concurrency`), streams the answers over SSE and reports throughput, end-to-end latency,
TTFT (time to first content chunk), ITL (gaps between content chunks) and TPOT:

    python -m moeserve.bench.serving --base-url http://127.0.0.1:30000 --num-prompts 64 \\
        --max-concurrency 8 --random-input-len 128 --random-output-len 128 --ignore-eos

Above 64 requests in flight they are split over client processes where the CPUs allow
(`--workers`; serving_client.py says why). Works against moeserve's server, SGLang and
`transformers serve` (which rejects `ignore_eos`: pass `--no-ignore-eos-field`). Output tokens come from the stream's final `usage` when the server sends
one, else from re-tokenizing the generated text. `run_benchmark(args)` is the programmatic entry
point (a Namespace, or a dict of overrides on the CLI defaults); it returns the metrics dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any

import httpx

from moeserve.bench.serving_client import (Drive, RequestResult,  # noqa: F401
                                            count_output_tokens, drive, drive_in_workers,
                                            http_client, send_request)
from moeserve.bench.serving_data import (BenchRequest, _encode, _lengths,  # noqa: F401
                                          _usable_token_ids, load_tokenizer,
                                          make_random_prompt, sample_random_requests)
from moeserve.bench.serving_metrics import (LATENCY_SECTIONS, _stats,  # noqa: F401
                                             compute_metrics, format_table)

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
    p.add_argument("--workers", type=int, default=0,
                   help="client processes sharing the requests and the concurrency (0: one per "
                        "64 in flight, at most 4 and at most a quarter of the CPUs)")
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


def client_workers(args: argparse.Namespace) -> int:
    """--workers, or by load: one Python client streaming more than ~64 answers falls behind."""
    if args.workers:
        return max(1, min(args.workers, args.num_prompts))
    load = args.max_concurrency or args.num_prompts
    return max(1, min(4, (os.cpu_count() or 1) // 4, -(-load // 64), args.num_prompts))


def base_url_of(args: argparse.Namespace) -> str:
    url = args.base_url or f"http://{args.host}:{args.port}"
    return url.rstrip("/").removesuffix("/v1")


# -------------------------------------------------------------------------------------- requests


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

    async with http_client(n_conn, args.request_timeout) as client:
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

        d = Drive(url, [_build_payload(args, model, r, stream, extra) for r in requests], chat,
                  headers, args.max_concurrency, args.request_rate, args.seed,
                  args.request_timeout)
        workers = client_workers(args)
        if workers > 1:
            results, t0, t_end = await drive_in_workers(d, workers)
        else:
            results, t0, t_end = await drive(d, client)
        duration = t_end - t0
        for req, res in zip(requests, results, strict=True):
            res.prompt_len = req.prompt_len
            res.requested_output_len = req.output_len
            if res.success:
                res.output_tokens = count_output_tokens(res, tokenizer)

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
