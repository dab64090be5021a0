"""Hardware profiles: what one GPU of a deployment offers, each figure tagged with where it came
from (`spec`: the vendor's sheet; `measured`: on a lent GPU here), so a prediction can say which
of its inputs were measured.

Profiles are data (`profiles/*.json`). A profile names the kernel-cost table measured on that GPU
(`cost_table`), or the GPU whose table is scaled to it by the ratio of the two sheets
(`scale_costs_from`) where none was measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
SCHEMA = "moeserve.profile/1"
FIELDS = ("hbm_gib", "hbm_tbps", "bf16_tflops", "fp8_tflops", "sms", "nvlink_domain",
          "nvlink_gbps", "nic_gbps", "nic_latency_us")


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # spec | measured
    note: str = ""


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpu: str
    hbm_gib: Figure
    hbm_tbps: Figure
    bf16_tflops: Figure
    fp8_tflops: Figure
    sms: Figure
    nvlink_domain: Figure  # GPUs that reach each other over NVLink (a node, or an NVL72 rack)
    nvlink_gbps: Figure  # per GPU, one direction
    nic_gbps: Figure  # scale-out bandwidth per GPU, one direction (GB/s)
    nic_latency_us: Figure
    cost_table: str | None = None
    scale_costs_from: str | None = None

    def flops(self, dtype: str) -> float:
        """Dense matmul FLOP/s of the sheet for bf16 or fp8."""
        return (self.fp8_tflops if dtype == "fp8" else self.bf16_tflops).value * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps.value * 1e12

    def sources(self) -> dict[str, str]:
        return {f: getattr(self, f).source for f in FIELDS}


def profile_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (h100, h200, h800, h20, gb200_nvl72) or a JSON file."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(
        PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise ValueError(f"no hardware profile {name_or_path!r}; shipped: {profile_names()}")
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} file")
    figs = {k: Figure(float(doc[k]["value"]), doc[k]["source"], doc[k].get("note", ""))
            for k in FIELDS}
    return HardwareProfile(doc["name"], doc["gpu"], cost_table=doc.get("cost_table"),
                           scale_costs_from=doc.get("scale_costs_from"), **figs)
