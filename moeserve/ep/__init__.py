"""Expert parallelism: token dispatchers (one backend per file) behind `dispatcher.Dispatcher`."""

from moeserve.ep.dispatcher import (
    LOW_LATENCY,
    STANDARD,
    CombineHandle,
    Dispatcher,
    DispatchHandle,
    DispatchOutput,
    create_dispatcher,
    expert_owner,
)

__all__ = [
    "LOW_LATENCY",
    "STANDARD",
    "CombineHandle",
    "DispatchHandle",
    "DispatchOutput",
    "Dispatcher",
    "create_dispatcher",
    "expert_owner",
]
