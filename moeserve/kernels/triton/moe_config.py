"""Launch configs of the fused-MoE kernels: tuned JSON tables, else a shape heuristic.

A table `E=<experts>,N=<intermediate>,H=<hidden>,dtype=<dtype>,device=<GPU name>.json` (written by
`python -m moeserve.tools.tune_moe`) maps token counts (strings) to configs; a call takes the entry
whose token count is nearest. Lookups are cached: the layer asks on every forward.

A config may carry a `down` entry: the down GEMM's own tile (DOWN_KEYS), since its shape (N = H,
K = I) differs from the gate/up GEMM's; BLOCK_SIZE_M is shared because both walk one sorted layout.
Either level may set the optional flags (0 or 1, absent = 0; `down` inherits them unless it sets
its own): `SWAP_AB`, that GEMM computes its tiles transposed, and `B_TMA`, it reads the weight
tiles through a TMA descriptor where the GPU has TMA (sm90+; fused_moe.py, tma.py). The heuristic
sets neither.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).parent / "moe_configs"
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
DOWN_KEYS = KEYS[1:]
SWAP_KEY = "SWAP_AB"  # optional at either level
TMA_KEY = "B_TMA"  # optional at either level
FLAG_KEYS = (SWAP_KEY, TMA_KEY)


def _flag(cfg: dict, key: str) -> int:
    """cfg's flag `key` as 0 or 1 (absent: 0); anything else raises ValueError naming the key."""
    value = cfg.get(key, 0)
    if type(value) not in (int, bool) or value not in (0, 1):
        raise ValueError(f"{key} must be 0 or 1, got {value!r}")
    return int(value)


def swap_ab(cfg: dict) -> int:
    return _flag(cfg, SWAP_KEY)


def b_tma(cfg: dict) -> int:
    return _flag(cfg, TMA_KEY)


def down_config(cfg: dict) -> dict:
    """The down GEMM's launch config: cfg with its `down` entry (if any) laid over it."""
    return {k: v for k, v in cfg.items() if k != "down"} | cfg.get("down", {})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def device_name() -> str:
    """'NVIDIA_H200' style (spaces → _); 'cpu' without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().replace(" ", "_")


def config_file_name(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                     device: str | None = None) -> str:
    return (f"E={num_experts},N={intermediate},H={hidden},dtype={dtype_name(dtype)},"
            f"device={device or device_name()}.json")


@functools.cache
def load_table(path: str) -> dict[int, dict] | None:
    """{num_tokens: config} from a tuned JSON file; None if there is no such file."""
    p = Path(path)
    if not p.is_file():
        return None
    raw = json.loads(p.read_text())
    table = {}
    for tokens, cfg in raw.items():
        missing = [k for k in KEYS if k not in cfg]
        if missing:
            raise ValueError(f"{path}: config for {tokens} tokens lacks {missing}")
        entry = {k: int(cfg[k]) for k in KEYS}
        if "down" in cfg:
            bad = sorted(set(cfg["down"]) - set(DOWN_KEYS) - set(FLAG_KEYS))
            if bad:
                raise ValueError(f"{path}: down config for {tokens} tokens has unknown keys {bad}")
            entry["down"] = {k: int(v) for k, v in cfg["down"].items() if k not in FLAG_KEYS}
        for where, level in (("", cfg), ("down ", cfg.get("down", {}))):
            for key in FLAG_KEYS:
                if key in level:
                    try:
                        value = _flag(level, key)
                    except ValueError as err:
                        raise ValueError(
                            f"{path}: {where}config for {tokens} tokens: {err}") from None
                    (entry["down"] if where else entry)[key] = value
        table[int(tokens)] = entry
    return table or None


def default_config(num_experts: int, hidden: int, intermediate: int, topk: int,
                   dtype: torch.dtype, num_tokens: int) -> dict:
    """Heuristic by rows per expert. Decode (≤ ~2 rows per expert) is bound by streaming each
    touched expert's weights: BLOCK_SIZE_M 16 (tl.dot's minimum) wastes least, narrow N tiles
    give every SM programs even when only K experts are touched (gate_up: E_touched * I / BN),
    and deep K tiles with 4 stages keep ~48 KB of weights in flight per program. Prefill is
    compute-bound: big tiles, GROUP_SIZE_M 8 so m-blocks of one expert reuse B tiles in L2."""
    rows = num_tokens * topk / max(num_experts, 1)
    if rows <= 2:
        m, n, k, g, warps, stages = 16, 32, 128, 1, 4, 4
    elif rows <= 16:
        m, n, k, g, warps, stages = 16, 64, 128, 1, 4, 4
    elif rows <= 64:
        m, n, k, g, warps, stages = 32, 64, 128, 8, 4, 3
    elif rows <= 256:
        m, n, k, g, warps, stages = 64, 64, 64, 8, 4, 4
    else:
        m, n, k, g, warps, stages = 64, 128, 64, 8, 8, 3
    if dtype == torch.float32:
        k = min(k, 64)  # twice the bytes per element: keep the shared-memory stages the same
    small = max(16, 1 << (min(hidden, intermediate) - 1).bit_length())  # tiny (test) shapes
    return dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=min(n, small), BLOCK_SIZE_K=min(k, small),
                GROUP_SIZE_M=g, num_warps=warps, num_stages=stages)


@functools.cache
def _lookup(num_experts: int, hidden: int, intermediate: int, topk: int, dtype: torch.dtype,
            num_tokens: int, config_dir: str | None) -> dict:
    name = config_file_name(num_experts, hidden, intermediate, dtype)
    for folder in (config_dir, SHIPPED_DIR):
        table = load_table(str(Path(folder) / name)) if folder else None
        if table:
            return table[min(table, key=lambda n: (abs(n - num_tokens), n))]
    return default_config(num_experts, hidden, intermediate, topk, dtype, num_tokens)


def get_moe_config(num_experts: int, hidden: int, intermediate: int, topk: int,
                   dtype: torch.dtype, num_tokens: int, config_dir: str | None = None) -> dict:
    """Launch config for T=num_tokens: the nearest entry of the tuned table in config_dir, else
    the shipped one (moe_configs/), else `default_config`. num_experts: experts on this rank."""
    cfg = _lookup(num_experts, hidden, intermediate, topk, dtype, num_tokens,
                  None if config_dir is None else str(config_dir))
    return {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
