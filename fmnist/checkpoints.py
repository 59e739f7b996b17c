"""Checkpoints and exact resume: the weights, the optimizer, the epoch and step (the data order follows) and the
training's settings, CRC-checked, whole or absent. A restart continues from the newest good one and refuses
another training's. epoch-0002.ckpt is epoch 2 done; epoch-0003-step-000016.ckpt is 16 steps into epoch 3."""

import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import mindspore as ms
from mindspore.train import Callback

from . import common, settings
from .common import log

CHECKPOINT_FORMAT = 3  # 3 added the step within the epoch and the restarts; 2 added the settings
NAME = re.compile(r"epoch-(\d{4,})(?:-step-(\d{6,}))?\.ckpt")
RECORD = "last-step"  # rank 0's newest finished step and its time, beside the checkpoints


@dataclasses.dataclass(frozen=True, order=True)
class Position:
    """Where a training is: `epoch` epochs done, then `step` steps of the next one."""

    epoch: int = 0
    step: int = 0

    def global_step(self, steps_per_epoch):
        return self.epoch * steps_per_epoch + self.step


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The checkpoint a job resumes from: where, how far, and its figures so far."""

    path: Path
    position: Position
    restarts: int  # restarts before this one
    history: list  # the per-epoch figures of the epochs done
    loss_points: list  # (epoch as a fraction, training loss) so far


def save_checkpoint(cell, path, extra=None):
    """A CRC-checked checkpoint at `path`, complete or absent (MindSpore writes in place, and insists on .ckpt)."""
    with common.atomic_path(path, suffix=".ckpt") as tmp:
        ms.save_checkpoint(cell, str(tmp), append_dict=extra, crc_check=True)


def checkpoint_path(directory, position):
    if not position.step:
        return Path(directory) / f"epoch-{position.epoch:04d}.ckpt"
    return Path(directory) / f"epoch-{position.epoch + 1:04d}-step-{position.step:06d}.ckpt"


def newest_first(directory):
    """The checkpoints in `directory`, the furthest in the training first; other files are ignored."""
    found = {}
    for path in Path(directory).glob("epoch-*.ckpt"):
        if match := NAME.fullmatch(path.name):
            epoch, step = int(match[1]), int(match[2] or 0)
            found[path] = Position(epoch - 1, step) if step else Position(epoch)
    return sorted(found, key=found.get, reverse=True)


def trajectory(cfg, resolved, train_network):
    """What decides a training's course: the settings that shape it, what the job resolved, the parameters' shapes."""
    shapes = {p.name: list(p.shape) for p in train_network.get_parameters()}
    return {**{k: v for k, v in dataclasses.asdict(cfg).items() if k in settings.COURSE}, **resolved,
            "parameter_shapes": shapes}


def resume_conflicts(meta, current):
    """'name: was X, now Y' for each way a checkpoint's training differs from this job's."""
    if meta.get("format") != CHECKPOINT_FORMAT:
        return [f"checkpoint format: was {meta.get('format', 1)} (written by job {meta.get('job_version', '1.0.0')}), "
                f"now {CHECKPOINT_FORMAT} (job {common.JOB_VERSION})"]
    saved, conflicts = meta["trajectory"], []
    for name in sorted(set(saved) | set(current)):
        if (was := saved.get(name)) != (now := current.get(name)):
            if name == "parameter_shapes":  # say which, not the whole table
                was, now = was or {}, now or {}
                differing = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
                was, now = "another model or optimizer", f"this one (differing: {', '.join(differing[:3])})"
            conflicts.append(f"{name}: was {was}, now {now}")
    return conflicts


def load_latest_checkpoint(directory, train_network, current):
    """Resumed from the newest checkpoint that loads whole (a corrupt one is skipped with a warning), or None.
    Another training's is UsageError naming every difference: no run would describe the model it would make."""
    for path in newest_first(directory):
        try:
            params = ms.load_checkpoint(str(path), crc_check=True)
            meta = json.loads(params.pop("meta"))
        except Exception as exc:
            log.warning("skipping checkpoint %s: %s", path, common.first_line(exc))
            continue
        if conflicts := resume_conflicts(meta, current):
            raise common.UsageError(f"cannot resume from {path}, a checkpoint of another training: "
                                    f"{'; '.join(conflicts)}. Start fresh with --resume never, or give another "
                                    "--output-dir")
        ms.load_param_into_net(train_network, params)  # its parameters are these: their names and shapes match
        return Resumed(path, Position(meta["epoch"], meta["step"]), meta["restarts"], meta["history"],
                       [tuple(p) for p in meta["loss_points"]])
    return None


def agree_on_resume(collective, resumed, directory, epochs):
    """The Position every rank resumes from; UsageError when ranks found different checkpoints. A collective."""
    start = resumed.position if resumed else Position()
    agreed = collective.all_gather([start.epoch, start.step])
    if (agreed != agreed[0]).any():
        raise common.UsageError(f"ranks found different checkpoints to resume from (epoch and step "
                                f"{agreed.tolist()}); is {directory} shared by all nodes?")
    if resumed:
        log.info("resuming from %s: %d of %d epochs%s done", resumed.path, start.epoch, epochs,
                 f" and {start.step} steps" if start.step else "")
    return start


class CheckpointSaver(Callback):
    """Rank 0's checkpoints, the newest `keep` kept: at each epoch's end, every `every_steps` steps, and on a stop,
    on the training thread (milliseconds for LeNet). Each step's number and time go to RECORD, for the restart cost."""

    def __init__(self, directory, keep, every_steps, progress, tracker, current, resumed=None):
        super().__init__()
        self.directory, self.keep, self.every_steps = Path(directory), keep, every_steps
        self.progress, self.tracker, self.current = progress, tracker, current  # current: the trajectory
        self.resumed, self.restarts = resumed, resumed.restarts + 1 if resumed else 0  # this start's number
        self.save_s = []  # each save's time, seconds
        self.directory.mkdir(parents=True, exist_ok=True)
        self._record = os.open(self.directory / RECORD, os.O_WRONLY | os.O_CREAT, 0o644)

    def on_train_step_end(self, run_context):
        position, steps = self.progress.position, self.progress.steps_per_epoch
        if self.restarts and self.progress.steps_done == 1:
            self.log_restart_cost(position.global_step(steps))
        self.mark()
        if (self.every_steps and position.step < steps  # the epoch's last step: its end's checkpoint follows
                and position.global_step(steps) % self.every_steps == 0):
            self.save(run_context.original_args().train_network, position)

    def on_train_epoch_end(self, run_context):
        self.save(run_context.original_args().train_network, Position(run_context.original_args().cur_epoch_num))

    def mark(self):
        step = self.progress.position.global_step(self.progress.steps_per_epoch)
        with common.space_for(self.directory / RECORD):  # the first write takes a block: the volume may be full
            os.pwrite(self._record, f"{step:12d} {time.time():20.6f}\n".encode(), 0)

    def log_restart_cost(self, step):
        # Steps trained before the stop but not in the checkpoint resumed from, and seconds from then to now.
        cost = {"restarts": self.restarts, "restart_steps_lost": 0}
        with contextlib.suppress(OSError, ValueError):  # the stopped job's newest step and its time, if recorded
            last_step, when = map(float, (self.directory / RECORD).read_text().split())  # before this job's overwrite
            resumed_step = self.resumed.position.global_step(self.progress.steps_per_epoch)
            cost.update(restart_steps_lost=max(0, int(last_step) - resumed_step), restart_total_s=time.time() - when)
        log.info("restart %d: %d steps lost, %s from the stop to this step", self.restarts, cost["restart_steps_lost"],
                 f"{cost['restart_total_s']:.1f} s" if "restart_total_s" in cost else "an unknown time")
        self.tracker.log_metrics(cost, step=step)

    def save(self, train_network, position):
        started = time.perf_counter()
        meta = {"format": CHECKPOINT_FORMAT, "job_version": common.JOB_VERSION, "trajectory": self.current,
                "epoch": position.epoch, "step": position.step, "restarts": self.restarts,
                "history": self.progress.history, "loss_points": self.progress.loss_points}
        save_checkpoint(train_network, checkpoint_path(self.directory, position), extra={"meta": json.dumps(meta)})
        for old in newest_first(self.directory)[self.keep:]:
            old.unlink()
        self.mark()  # the step saved is the newest trained: a stop loses none
        self.save_s.append(time.perf_counter() - started)
