"""Checkpoints and exact resume: rank 0 writes one per epoch (weights, optimizer state, the epoch, the figures
so far and the settings that shaped the training), whole or not at all; a restart continues from the newest
good one, and refuses one of another training."""

import dataclasses
import json
from pathlib import Path

import mindspore as ms
from mindspore.train import Callback

from . import common, settings
from .common import log

CHECKPOINT_FORMAT = 2  # 2: a checkpoint records the settings of its training; job 1.0.0 wrote format 1


def save_checkpoint(cell, path, extra=None):
    """A CRC-checked checkpoint at `path`, complete or absent (MindSpore writes in place, and insists on .ckpt)."""
    with common.atomic_path(path, suffix=".ckpt") as tmp:
        ms.save_checkpoint(cell, str(tmp), append_dict=extra, crc_check=True)


def checkpoint_path(directory, epoch):
    return Path(directory) / f"epoch-{epoch:04d}.ckpt"


def trajectory(cfg, resolved, train_network):
    """What decides the course of a training: every setting not free to change on resume, what the job
    resolved (amp level, loss scaling, world size, the data's checksums), and the parameters' shapes, which
    cover the model and the optimizer state."""
    shapes = {p.name: list(p.shape) for p in train_network.get_parameters()}
    return {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in settings.FREE_ON_RESUME}, **resolved,
            "parameter_shapes": shapes}


def resume_conflicts(meta, current):
    """What differs between a checkpoint's training and this job's, one 'name: was X, now Y' per item."""
    if meta.get("format") != CHECKPOINT_FORMAT:
        return [f"checkpoint format: was {meta.get('format', 1)} (written by job {meta.get('job_version', '1.0.0')}), "
                f"now {CHECKPOINT_FORMAT} (job {common.JOB_VERSION})"]
    saved = meta["trajectory"]
    conflicts = []
    for name in sorted(set(saved) | set(current)):
        if saved.get(name) != current.get(name):
            was, now = saved.get(name), current.get(name)
            if name == "parameter_shapes":  # say which, not the whole table
                differing = sorted(k for k in set(was or {}) | set(now or {}) if (was or {}).get(k) != (now or {}).get(k))
                was, now = "another model or optimizer", f"this one (differing: {', '.join(differing[:3])})"
            conflicts.append(f"{name}: was {was}, now {now}")
    return conflicts


def load_latest_checkpoint(directory, train_network, current):
    """Load the newest checkpoint that reads back whole into `train_network` (weights and optimizer state);
    a corrupt or partial one is skipped with a warning. Returns its metadata, or None. A checkpoint of another
    training (other settings, model, world size or job version) raises UsageError naming every difference:
    continuing it with this job's settings would produce a model that no run describes."""
    for path in sorted(Path(directory).glob("epoch-*.ckpt"), reverse=True):
        try:
            params = ms.load_checkpoint(str(path), crc_check=True)
            meta = json.loads(params.pop("meta"))
        except Exception as exc:  # pylint: disable=broad-except
            log.warning("skipping checkpoint %s: %s", path, str(exc).splitlines()[0])
            continue
        conflicts = resume_conflicts(meta, current)
        if conflicts:
            raise common.UsageError(f"cannot resume from {path}, a checkpoint of another training: "
                                    f"{'; '.join(conflicts)}. Start fresh with --resume never, or give another "
                                    "--output-dir")
        missing, _ = ms.load_param_into_net(train_network, params)
        if missing:  # same shapes recorded, yet not these parameters: a damaged checkpoint
            raise common.UsageError(f"cannot resume from {path}: it lacks {len(missing)} parameters, such as "
                                    f"{missing[0]}; start fresh with --resume never")
        return {**meta, "path": str(path)}
    return None


def agree_on_resume(collective, resumed, directory, epochs):
    """The epoch every rank resumes from (0: a fresh start); UsageError when the ranks found different
    checkpoints, as nodes that do not share the output directory would. A collective."""
    start_epoch = resumed["epoch"] if resumed else 0
    agreed = collective.all_gather(start_epoch)
    if (agreed != start_epoch).any():
        raise common.UsageError(f"ranks found different checkpoints to resume from (epochs {agreed.tolist()}); "
                                f"is {directory} shared by all nodes?")
    if resumed:
        log.info("resuming from %s: %d of %d epochs done", resumed["path"], start_epoch, epochs)
    return start_epoch


class CheckpointSaver(Callback):
    """Rank 0 writes one checkpoint per epoch (weights, optimizer state, epoch and the figures so far) and
    keeps the newest `keep`; only one process ever writes a checkpoint file."""

    def __init__(self, directory, keep, monitor, tracker, current):
        super().__init__()
        self.directory, self.keep, self.monitor, self.tracker = Path(directory), keep, monitor, tracker
        self.current = current  # the trajectory, checked on resume

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        # run_id waits only while the run is being created, so a resumed job can continue the same run.
        meta = {"format": CHECKPOINT_FORMAT, "job_version": common.JOB_VERSION, "trajectory": self.current,
                "epoch": cb.cur_epoch_num, "mlflow_run_id": self.tracker.run_id,
                "history": self.monitor.epoch_history, "loss_points": self.monitor.loss_points}
        self.directory.mkdir(parents=True, exist_ok=True)
        save_checkpoint(cb.train_network, checkpoint_path(self.directory, cb.cur_epoch_num),
                        extra={"meta": json.dumps(meta)})
        for old in sorted(self.directory.glob("epoch-*.ckpt"))[:-self.keep]:
            old.unlink()
