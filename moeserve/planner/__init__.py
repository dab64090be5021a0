"""Cluster planner (issue 43): predict a deployment's throughput, latencies and memory from
kernel costs measured on one GPU, checked against our own and published runs.

    python -m moeserve.planner --help

It imports the model configs and the EPLB algorithm, never the runtime (docs/planner.md).
"""

from __future__ import annotations

from moeserve.planner.deploy import Deployment, Role
from moeserve.planner.predict import Prediction, predict
from moeserve.planner.workload import Workload

__all__ = ["Deployment", "Prediction", "Role", "Workload", "predict"]
