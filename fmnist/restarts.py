"""What each restart cost, in the same MLflow run: rank 0 records its newest finished step as it trains, and a
resumed job compares that record with the checkpoint it resumed from and times its way back to training.

Logged once per restart, at the first step after it (the MLflow step is the global step):
    restarts                    restarts so far in this training
    restart_steps_lost          steps trained before the stop but not in the checkpoint resumed from (0 after a
                                SIGTERM stop; under --checkpoint-steps N, fewer than N after a kill -9)
    restart_total_s             from the previous stop (its checkpoint written, or its last step) to the first
                                new step; the sum of the parts below
    restart_down_s              ... until this process started: rescheduling, msrun and its start-up
    restart_startup_s           ... until the job's code ran: the interpreter and the imports
    restart_join_s              ... joining the job: the context, init() and every rank's arrival
    restart_setup_s             ... the data and the network
    restart_checkpoint_s        ... loading the checkpoint, and every rank agreeing on it
    restart_compile_s           ... compiling the training step
    restart_tracking_s          ... starting MLflow tracking: its import and the run's creation
    restart_first_step_s        ... the first step
"""

import os
import time
from pathlib import Path

from mindspore.train import Callback

from . import common
from .common import log

RECORD = "last-step"  # in the checkpoint directory


def read_record(directory):
    """(global step, wall-clock time) of the previous training's newest finished step, or None."""
    try:
        step, when = Path(directory, RECORD).read_text().split()
        return int(step), float(when)
    except (OSError, ValueError):
        return None


def process_start_time():
    """This process's start, on the wall clock: now less its age, which the kernel gives in clock ticks since
    boot (/proc/self/stat) against the time since boot (/proc/uptime), both to 10 ms."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class Laps:
    """The job's phases on the way to its first step, timed as they end: laps("join") after joining, etc."""

    def __init__(self):
        self.started_wall, self.started = time.time(), time.perf_counter()
        self._last = self.started
        self.laps = {}

    def __call__(self, phase):
        now = time.perf_counter()
        self.laps[phase], self._last = now - self._last, now


class StepRecord(Callback):
    """Rank 0: after every step, its global step and the time, overwritten in place (one 30-byte write, no
    fsync: it outlives the process, kill -9 included, though not the machine); marked again when the job
    stops. A resumed job (`restarts` > 0) logs what its restart cost at its first step."""

    def __init__(self, directory, monitor, tracker, laps, previous=None, restarts=0):
        super().__init__()
        self.monitor, self.tracker, self.laps = monitor, tracker, laps
        self.previous, self.restarts = previous, restarts  # read_record() before this job's first step
        self.resumed_step = self.global_step()  # the monitor starts where the checkpoint left off
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory, RECORD)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.cost = None

    def global_step(self):
        return self.monitor.position.global_step(self.monitor.steps_per_epoch)

    def mark(self):
        with common.space_for(self.path):  # the first write takes a block: the volume may be full by then
            os.pwrite(self._fd, f"{self.global_step():12d} {time.time():20.6f}\n".encode(), 0)

    def on_train_step_end(self, run_context):
        if self.cost is None and self.restarts:  # the monitor, before this, timed the first step
            self.cost = restart_cost(self.previous, self.restarts, self.laps, self.resumed_step)
            log.info("restart %d: %d steps lost, %.1f s from the stop to this step (%s)", self.restarts,
                     self.cost["restart_steps_lost"], self.cost["restart_total_s"],
                     ", ".join(f"{k[len('restart_'):-2]} {v:.1f}" for k, v in self.cost.items() if k.endswith("_s")
                               and k != "restart_total_s"))
            self.tracker.log_metrics(self.cost, step=self.global_step())
        self.mark()


def restart_cost(previous, restarts, laps, resumed_step):
    """The metrics of restart number `restarts` (see the module's docstring). `previous` is the record of the
    stopped job (None if it never finished a step), `resumed_step` the global step of the checkpoint resumed
    from."""
    cost = {"restarts": restarts,
            "restart_steps_lost": max(0, previous[0] - resumed_step) if previous else 0}
    parts = {}
    if previous:
        started = min(max(process_start_time() or previous[1], previous[1]), laps.started_wall)
        parts["down"], parts["startup"] = started - previous[1], laps.started_wall - started
    parts.update(laps.laps)
    cost.update({f"restart_{phase}_s": seconds for phase, seconds in parts.items()})
    if previous:
        cost["restart_total_s"] = sum(parts.values())
    return cost
