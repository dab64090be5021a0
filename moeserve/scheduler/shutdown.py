"""How a rank ends: every rank leaves its loop at the same step, then tears down in order, so a
clean exit prints nothing (no traceback, no C++ error or warning), on CPU or GPU.

Why: a rank that left by SystemExit at an arbitrary bytecode (the launcher's stop) could leave
while its peer still waited in a collective with it, and it reached interpreter exit with its
process groups alive. With NCCL, the communicator's watchdog thread then outlives the
interpreter's teardown and reports CUDA's "driver shutting down" as a c10::Error with a
backtrace once CUDA is unloaded (seen at the end of scripts/gpu_dp_check.py on 2 GPUs).

The order, per rank (`release_rank`):
  0. the launcher's stop (STOP_SIGNAL) only sets a flag (`StopRequest`): the rank aborts what it
     still runs and votes stop in its next DP sync; the loop returns on every rank at the same
     iteration, once all voted stop and none has work (GlobalBatchInfo.all_stop);
  1. the forward thread is joined (the loops return with nothing in flight);
  2. the device is synchronized;
  3. CUDA graphs (and their memory pools) and the EP dispatcher (peer memory: IPC-mapped
     symmetric buffers on CUDA, shared-memory maps on CPU) are dropped and collected, and the
     cached device memory is returned;
  4. the process groups are destroyed (`distributed.destroy_mesh`: a barrier on the gloo group
     first, so no rank tears down while a peer still runs a collective);
  5. the ZMQ sockets close (the caller's `io.close()`), logs are flushed, and the process ends
     at once (`procs/exit.exit_now`): nothing is left that needs a finalizer, and the
     interpreter's finalization (collecting the whole torch heap, then libtorch's static
     destructors, where exit-time C++ errors come from) took 2-3 s on the 2-core CI machine
     under load, racing the launcher's 5 s stop limit (a rank still finalizing there was
     SIGKILLed).
A rank whose peer died never gets through step 0's DP sync: the stop watcher of
procs/children.py ends it after its grace, skipping finalizers (nothing is printed either).
"""

from __future__ import annotations

import gc
import logging
import re
import signal
from typing import Any

import torch

from moeserve.distributed import destroy_mesh

logger = logging.getLogger(__name__)

# Lines a clean exit never prints (tests/multiproc/test_clean_shutdown.py, scripts/gpu_dp_check.py
# search every process's stderr): C++ exceptions and glog-style warnings/errors ("[W1203 ...]",
# "[rank0]:[E...]" from ProcessGroupGloo/NCCL), Python tracebacks, multiprocessing's leak
# warnings, and the launcher's kills.
UNCLEAN_EXIT = re.compile(r"c10::|ProcessGroup[A-Z]|destroy_process_group|Traceback|"
                          r"terminate called|Segmentation fault|core dumped|leaked|did not stop|"
                          r"^(\[rank\d+\]:)?\[[WEF]\d{4}", re.M)
TEARDOWN_DONE = ("rank %d: device work done, graphs and peer memory released, process groups "
                 "destroyed")
TEARDOWN_LINE = re.compile(TEARDOWN_DONE.replace("%d", r"(\d+)"))


class StopRequest:
    """`should_stop` for a rank's loop: true once the launcher's stop signal arrived. `install`
    replaces the child's default handler (SystemExit at once) from the main thread."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.requested = False
        self._aborted = False

    def install(self, signum: int) -> None:
        signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.requested = True

    def __call__(self) -> bool:
        if self.requested and not self._aborted:
            self._aborted = True
            left = [rid for rid, req in self.scheduler.reqs.items() if not req.finished]
            if left:
                logger.info("rank %d stopping: aborting %d request(s)",
                            self.scheduler.mesh.rank, len(left))
            for rid in left:
                self.scheduler.abort(rid)
        return self.requested


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_rank(scheduler: Any) -> None:
    """Steps 1-4 of the module docstring, after the rank's loop returned (collective when the
    rank has peers: every rank calls it at the same point)."""
    runner = scheduler.runner
    scheduler.watchdog.close()
    scheduler.timeline.close()
    scheduler.worker.shutdown()
    scheduler.worker.spec = None  # holds the draft's graphs and buffers
    _synchronize(runner.device)
    runner.graph_runner = runner.extend_graphs = runner.draft_graphs = None
    runner.moe_parallel.dispatcher = None  # peer-memory buffers and their mappings
    gc.collect()
    _synchronize(runner.device)
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    destroy_mesh(runner.mesh)
    if runner.mesh.distributed:
        logger.info(TEARDOWN_DONE, runner.mesh.rank)
