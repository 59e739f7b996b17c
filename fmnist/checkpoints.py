"""Checkpoints and exact resume: the weights, the optimizer and the training's state, CRC-checked, whole or
absent; a restart continues from the newest good one, and refuses another training's."""

import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import mindspore as ms

from . import common, settings
from .common import log

# 5 kept the global batch and each part's world size, not the world size; 4 named the course; 3 added the step
# in the epoch and the restarts; 2 the settings.
CHECKPOINT_FORMAT = 5
NAME = re.compile(r"epoch-(\d{4,})(?:-step-(\d{6,}))?\.ckpt")
RECORD = "last-step"  # rank 0's newest step and its time, which a restart's cost is measured from


@dataclasses.dataclass(frozen=True, order=True)
class Position:
    """`epoch` epochs done, then `step` steps of the next; each conversion to steps and to names is here.
    epoch-0002.ckpt is epoch 2 done, and epoch-0003-step-000016.ckpt 16 steps into epoch 3."""

    epoch: int = 0
    step: int = 0

    @classmethod
    def after(cls, steps, steps_per_epoch):
        return cls(*divmod(steps, steps_per_epoch))

    @property
    def file_name(self):
        if self.step:
            return f"epoch-{self.epoch + 1:04d}-step-{self.step:06d}.ckpt"
        return f"epoch-{self.epoch:04d}.ckpt"

    @classmethod
    def of_file(cls, name):
        """The position a checkpoint's name gives, or None for another file."""
        if match := NAME.fullmatch(name):
            epoch, step = int(match[1]), int(match[2] or 0)
            return cls(epoch - 1, step) if step else cls(epoch)
        return None


@dataclasses.dataclass(frozen=True)
class Part:
    """A stretch of the training between two starts: its first global step, and the workers training it."""

    first_step: int
    world_size: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class State:
    """What a checkpoint keeps beside the weights: the steps done, each epoch's figures, the loss curve, the
    parts."""

    steps: int = 0
    history: list = dataclasses.field(default_factory=list)
    loss_points: list = dataclasses.field(default_factory=list)
    parts: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Resumed:
    path: Path
    state: State
    restarts: int  # the restarts before this one
    global_batch: int


def save_checkpoint(cell, path, extra=None):
    """A CRC-checked checkpoint at `path`, whole or absent (MindSpore writes in place, and wants .ckpt)."""
    with common.atomic_path(path, suffix=".ckpt") as tmp:
        ms.save_checkpoint(cell, str(tmp), append_dict=extra, crc_check=True)


def newest_first(directory):
    """The checkpoints in `directory`, the furthest in the training first; other files are ignored."""
    found = {path: Position.of_file(path.name) for path in Path(directory).glob("epoch-*.ckpt")}
    return sorted((path for path, position in found.items() if position), key=found.get, reverse=True)


def course(cfg, resolved, train_network, global_batch):
    """What a resume must keep: the settings that shape the training, what they resolved to, the shapes, and
    the global batch. Not the world size: each step trains the same samples on any (docs/data-order.md)."""
    kept = {name: value for name, value in dataclasses.asdict(cfg).items() if name in settings.COURSE}
    kept.update({name: value for name, value in resolved.items() if name != "world_size"})
    shapes = {p.name: list(p.shape) for p in train_network.get_parameters()}
    return {**kept, "global_batch": global_batch, "parameter_shapes": shapes}


def resume_conflicts(meta, current, world_size):
    """'name: was X, now Y' for each way a checkpoint's training differs from this job's."""
    if meta.get("format") != CHECKPOINT_FORMAT:
        writer = meta.get("job_version", "1.0.0")
        return [f"checkpoint format: was {meta.get('format', 1)} (written by job {writer}), "
                f"now {CHECKPOINT_FORMAT} (job {common.JOB_VERSION})"]
    saved, conflicts = meta["course"], []
    # On another world size the training keeps its global batch, and each device takes its share of it.
    if meta["parts"][-1]["world_size"] != world_size:
        current = {**current, "global_batch": saved["global_batch"]}
    for name in sorted(set(saved) | set(current)):
        if (was := saved.get(name)) == (now := current.get(name)):
            continue
        if name == "parameter_shapes":  # which parameters differ, not the whole table
            was, now = was or {}, now or {}
            differing = sorted(key for key in set(was) | set(now) if was.get(key) != now.get(key))
            was, now = "another model or optimizer", f"this one (differing: {', '.join(differing[:3])})"
        conflicts.append(f"{name}: was {was}, now {now}")
    return conflicts


def load_latest(directory, train_network, current, world_size):
    """Resumed from the newest checkpoint that loads whole (a corrupt one is skipped with a warning), or None.
    Another training's is a UsageError naming every difference: no run would describe its model. So is a
    world size that does not divide the training's global batch."""
    for path in newest_first(directory):
        try:
            params = ms.load_checkpoint(str(path), crc_check=True)
            meta = json.loads(params.pop("meta"))
        except Exception as exc:
            log.warning("skipping checkpoint %s: %s", path, common.first_line(exc))
            continue
        if conflicts := resume_conflicts(meta, current, world_size):
            raise common.UsageError(f"cannot resume from {path}, a checkpoint of another training: "
                                    f"{'; '.join(conflicts)}. Start fresh with --resume never, or give "
                                    "another --output-dir")
        global_batch = meta["course"]["global_batch"]
        if global_batch % world_size:
            fitting = [str(size) for size in range(1, global_batch + 1) if global_batch % size == 0]
            raise common.UsageError(f"cannot resume from {path} on {world_size} workers: its global batch of "
                                    f"{global_batch} does not divide among them; {', '.join(fitting)} "
                                    "workers would resume it")
        ms.load_param_into_net(train_network, params)  # names and shapes match
        state = State(meta["steps"], meta["history"], [tuple(point) for point in meta["loss_points"]],
                      [Part(**part) for part in meta["parts"]])
        return Resumed(path, state, meta["restarts"], global_batch)
    return None


def agree_on_resume(collective, resumed, directory):
    """UsageError unless every rank found the same checkpoint to resume from. A collective."""
    agreed = collective.all_gather([resumed.state.steps if resumed else 0]).ravel()
    if (agreed != agreed[0]).any():
        raise common.UsageError(f"ranks found different checkpoints to resume from (steps "
                                f"{agreed.tolist()}); is {directory} shared by all nodes?")


class Checkpoints:
    """Rank 0's checkpoints, the newest --keep-checkpoints kept: at each epoch's end, every --checkpoint-steps
    steps, and on a stop, on the training thread (milliseconds for LeNet); each step is recorded in RECORD."""

    def __init__(self, cfg, current, resumed, steps_per_epoch):
        self.directory = cfg.output_dir / "checkpoints"
        self.keep, self.every = cfg.keep_checkpoints, cfg.checkpoint_steps
        self.current, self.resumed, self.steps_per_epoch = current, resumed, steps_per_epoch
        self.restarts = resumed.restarts + 1 if resumed else 0
        self.saved_steps, self.save_s, self.stopped_at = resumed and resumed.state.steps, [], None
        self.directory.mkdir(parents=True, exist_ok=True)
        # The stopped job's newest step and its time, read before this job overwrites them.
        with contextlib.suppress(OSError, ValueError):
            last_step, when = (self.directory / RECORD).read_text().split()
            self.stopped_at = int(last_step), float(when)
        self._record = os.open(self.directory / RECORD, os.O_WRONLY | os.O_CREAT, 0o644)

    def path(self, steps):
        return self.directory / Position.after(steps, self.steps_per_epoch).file_name

    def restart_cost(self):
        """What this restart cost, said and as metrics: the steps trained after the checkpoint resumed from,
        and the seconds from the stop to now (when the stopped job recorded them)."""
        cost = {"restarts": self.restarts, "restart_steps_lost": 0}
        if self.stopped_at:
            cost.update(restart_steps_lost=max(0, self.stopped_at[0] - self.resumed.state.steps),
                        restart_total_s=time.time() - self.stopped_at[1])
        took = f"{cost['restart_total_s']:.1f} s" if self.stopped_at else "an unknown time"
        log.info("restart %d: %d steps lost, %s from the stop to this step", self.restarts,
                 cost["restart_steps_lost"], took)
        return cost

    def step_done(self, train_network, state):
        """Record the step, and save it when --checkpoint-steps says so (an epoch's end saves by itself)."""
        self.mark(state.steps)
        if self.every and state.steps % self.every == 0 and state.steps % self.steps_per_epoch:
            self.save(train_network, state)

    def mark(self, steps):
        with common.catch_full_disk(self.directory / RECORD):
            os.pwrite(self._record, f"{steps:12d} {time.time():20.6f}\n".encode(), 0)

    def save(self, train_network, state):
        """The training at `state` as a checkpoint, unless saved already; the oldest beyond `keep` go."""
        if state.steps == self.saved_steps:
            return
        started = time.perf_counter()
        meta = {"format": CHECKPOINT_FORMAT, "job_version": common.JOB_VERSION, "course": self.current,
                "steps": state.steps, "restarts": self.restarts, "history": state.history,
                "loss_points": state.loss_points, "parts": [dataclasses.asdict(part) for part in state.parts]}
        save_checkpoint(train_network, self.path(state.steps), extra={"meta": json.dumps(meta)})
        for old in newest_first(self.directory)[self.keep:]:
            old.unlink()
        self.mark(state.steps)  # the newest step trained: a stop loses none
        self.saved_steps = state.steps
        self.save_s.append(time.perf_counter() - started)
