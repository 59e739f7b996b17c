"""What the job measures, on every rank: Evaluation, the figures over the whole test set (each rank scores its
slice and one gather sums the counts, so a figure is the job's, never rank 0's shard alone); TrainingMonitor, the
training callback that prints and journals them on rank 0, publishes Progress, and stops every rank together on
divergence or SIGTERM; and what mixed precision did to the trained network."""

import dataclasses
import math
import time

import numpy as np
from scipy.special import log_softmax

import mindspore as ms
from mindspore import ops
from mindspore.train import Callback, Metric

from . import checkpoints, distributed
from .common import duration, log


# With --divergence-check on, besides a non-finite loss: a training loss over 10 ln C (C classes; an untrained
# network's is ln C) is blowing up; and from 200 steps on, an epoch that ends at most 1.2 / C accurate or at
# least 0.98 ln C in loss has learned nothing (dead ReLUs, or a learning rate too small to move it).
EXPLODED, JUDGED_AFTER_STEPS, CHANCE_MARGIN, UNTRAINED_LOSS_MARGIN = 10, 200, 1.2, 0.98


class Diverged(Exception):
    """The training stopped learning: a non-finite or exploded loss, or no better than chance. Its message advises."""


@dataclasses.dataclass
class Progress:
    """What the monitor publishes as the training goes, for the checkpoints and the report."""

    steps_per_epoch: int
    position: checkpoints.Position = checkpoints.Position()  # counted on from the checkpoint resumed from
    history: list = dataclasses.field(default_factory=list)  # per-epoch figures, those before a resume included
    loss_points: list = dataclasses.field(default_factory=list)  # (epoch as a fraction, cross-rank mean loss)
    steps_done: int = 0  # by this process
    confusion: object = None  # the latest validation's confusion matrix
    skipped_steps: int = 0  # under dynamic loss scaling: steps skipped for overflowed gradients
    first_step_s: float = None  # since main() started
    first_step_at: float = None  # on the wall clock

    @classmethod
    def resumed_from(cls, resumed, steps_per_epoch):
        if resumed is None:
            return cls(steps_per_epoch)
        return cls(steps_per_epoch, resumed.position, list(resumed.history), list(resumed.loss_points))


class Laps:
    """The job's phases on the way to its first step, timed as they end: laps("join") after joining, etc."""

    def __init__(self):
        self.started, self.laps = time.perf_counter(), {}

    def __call__(self, phase):
        self.laps[phase] = time.perf_counter() - self.started - sum(self.laps.values())


class Evaluation(Metric):
    """The loss, the accuracy and the confusion matrix (rows: the true class) over the whole test set."""

    def __init__(self, collective, num_classes):
        super().__init__()
        self._collective, self._num_classes = collective, num_classes
        self.clear()

    def clear(self):
        self._loss, self._confusion = 0.0, np.zeros((self._num_classes, self._num_classes), dtype=np.int64)

    def update(self, *inputs):  # logits and one-hot labels, as Model.eval passes them
        logits, labels = inputs[0].asnumpy().astype(np.float64), inputs[1].asnumpy()
        self._loss -= float((labels * log_softmax(logits, axis=1)).sum())  # the cross-entropy, stably
        np.add.at(self._confusion, (labels.argmax(axis=1), logits.argmax(axis=1)), 1)

    def eval(self):
        # float64 holds the counts exactly: one gather carries the loss and the matrix.
        rows = self._collective.all_gather(np.append(self._loss, self._confusion.ravel()).astype(np.float64))
        total = rows.sum(axis=0)
        confusion = total[1:].reshape(self._confusion.shape).astype(np.int64)
        count = max(int(confusion.sum()), 1)
        return {"loss": total[0] / count, "accuracy": np.trace(confusion) / count, "confusion": confusion}


class TrainingMonitor(Callback):
    """The training loss (mean and per rank) and samples/s every log interval, and each epoch's validation."""

    def __init__(self, cfg, collective, tracker, progress, laps, num_classes):
        super().__init__()
        self.collective, self.tracker, self.stop = collective, tracker, distributed.StopRequest()
        self.epochs, self.progress, self.steps_per_epoch = cfg.epochs, progress, progress.steps_per_epoch
        self.global_batch, self.log_interval, self.laps = cfg.batch_size * collective.world_size, cfg.log_interval, laps
        # The loss and the accuracy of a network that learned nothing (see EXPLODED and CHANCE_MARGIN above).
        self.untrained_loss, self.chance = math.log(num_classes), 1 / num_classes
        self.check_learning, self.lr = cfg.divergence_check == "on", cfg.lr
        self._loss_sum = self._overflows = self._loss_scale = None  # the last two under dynamic loss scaling

    def on_train_epoch_begin(self, run_context):
        self._epoch_start = self._interval_start = time.perf_counter()
        self._epoch_steps = self._interval_steps = 0  # trained in this process

    def on_train_step_end(self, run_context):
        cb, progress = run_context.original_args(), self.progress
        outputs = cb.net_outputs if isinstance(cb.net_outputs, (tuple, list)) else (cb.net_outputs,)
        # Summing on the device keeps the host from waiting on each step; it is read once per interval.
        self._loss_sum = outputs[0] if self._loss_sum is None else self._loss_sum + outputs[0]
        if len(outputs) == 3:  # dynamic loss scaling's cell returns (loss, overflowed, scale)
            overflowed = ops.cast(outputs[1], ms.int32)
            self._overflows = overflowed if self._overflows is None else self._overflows + overflowed
            self._loss_scale = outputs[2]
        self._epoch_steps += 1
        self._interval_steps += 1
        progress.position = checkpoints.Position(cb.cur_epoch_num - 1,
                                                 progress.position.step % self.steps_per_epoch + 1)
        progress.steps_done += 1
        if progress.first_step_s is None:
            self.laps("first_step")
            progress.first_step_s, progress.first_step_at = time.perf_counter() - self.laps.started, time.time()
            if self.collective.is_main:
                log.info("first step done %.1f s after start (%s)", progress.first_step_s,
                         ", ".join(f"{phase.replace('_', ' ')} {s:.1f}" for phase, s in self.laps.laps.items()))
        step = progress.position.global_step(self.steps_per_epoch)  # counts on across a resume
        if step % self.log_interval == 0 or progress.position.step == self.steps_per_epoch:
            self._report_interval(cb, step)

    def _report_interval(self, cb, step):
        # One gather carries each rank's loss and whether it was asked to stop, so all ranks decide alike.
        gathered = self.collective.all_gather(
            np.array([float(self._loss_sum.asnumpy()) / self._interval_steps, self.stop.signum], dtype=np.float64))
        per_rank, stop_signals = gathered[:, 0], gathered[:, 1]
        self._loss_sum = None
        if not np.isfinite(per_rank).all():
            raise self.diverged(f"training loss {per_rank.mean()} at step {step} (epoch {cb.cur_epoch_num})")
        if self.check_learning and per_rank.mean() > EXPLODED * self.untrained_loss:
            raise self.diverged(f"training loss {per_rank.mean():.4g} at step {step} (epoch {cb.cur_epoch_num}), "
                                f"over {EXPLODED} times the {self.untrained_loss:.2f} of an untrained network")
        # At an epoch's last step the stop waits for the epoch's end: its validation belongs in the checkpoint.
        if stop_signals.any() and self.progress.position.step < self.steps_per_epoch:
            raise distributed.Terminated(int(stop_signals.max()), step)
        now = time.perf_counter()
        rate = self._interval_steps * self.global_batch / (now - self._interval_start)
        self._interval_start, self._interval_steps = now, 0
        if self.collective.is_main:
            steps_per_s = rate / self.global_batch
            log.info("epoch %d/%d | step %d/%d | loss %.4f | %s samples/s | epoch ends in %s, training in %s",
                     cb.cur_epoch_num, self.epochs, self.progress.position.step, self.steps_per_epoch, per_rank.mean(),
                     f"{rate:,.0f}", duration((self.steps_per_epoch - self.progress.position.step) / steps_per_s),
                     duration((self.epochs * self.steps_per_epoch - step) / steps_per_s))
            metrics = {"train_loss": per_rank.mean(), "train_samples_per_s": rate,
                       **{f"train_loss_rank{r}": v for r, v in enumerate(per_rank)}}
            if self._loss_scale is not None:
                self.progress.skipped_steps += int(self._overflows.asnumpy())
                metrics.update(loss_scale=self._loss_scale.asnumpy(), skipped_steps=self.progress.skipped_steps)
                self._overflows = None
            self.tracker.log_metrics(metrics, step=step)
            self.progress.loss_points.append((step / self.steps_per_epoch, float(per_rank.mean())))

    def on_eval_begin(self, run_context):
        self._eval_start = time.perf_counter()
        self._train_s = self._eval_start - self._epoch_start

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        epoch, test, eval_s = cb.cur_epoch_num, cb.metrics["test"], time.perf_counter() - self._eval_start
        figures = {"epoch": epoch, "train_s": self._train_s, "eval_s": eval_s,
                   "train_samples_per_s": self._epoch_steps * self.global_batch / self._train_s,
                   "val_loss": float(test["loss"]), "val_accuracy": float(test["accuracy"])}
        self.progress.confusion = test["confusion"]
        # The same figures on every rank; checked before this epoch's checkpoint is written.
        self.progress.position = checkpoints.Position(epoch)
        steps = self.progress.position.global_step(self.steps_per_epoch)
        if not math.isfinite(figures["val_loss"]):
            raise self.diverged(f"validation loss {figures['val_loss']} after epoch {epoch} (step {steps})")
        if self.check_learning and steps >= JUDGED_AFTER_STEPS and (
                figures["val_accuracy"] <= CHANCE_MARGIN * self.chance
                or figures["val_loss"] >= UNTRAINED_LOSS_MARGIN * self.untrained_loss):
            raise self.diverged(f"not learning: after epoch {epoch} ({steps} steps) the validation accuracy is "
                                f"{figures['val_accuracy']:.4f} and the loss {figures['val_loss']:.4f}, against "
                                f"{self.chance:.2f} and {self.untrained_loss:.2f} for guessing", exploded=False)
        self.progress.history.append(figures)
        if self.collective.is_main:
            log.info("epoch %d/%d done | train %.1f s, %s samples/s | eval %.1f s | val_loss %.4f | val_accuracy "
                     "%.4f | training ends in %s", epoch, self.epochs, self._train_s,
                     f"{figures['train_samples_per_s']:,.0f}", eval_s, figures["val_loss"], figures["val_accuracy"],
                     duration((self.epochs - epoch) * (self._train_s + eval_s)))
            # Per-epoch figures use the epoch as MLflow's step, so their charts read in epochs.
            self.tracker.log_metrics({f"epoch_{k}" if k in ("train_s", "eval_s", "train_samples_per_s") else k: v
                                      for k, v in figures.items() if k != "epoch"}, step=epoch)
        stop_signals = self.collective.all_gather(np.array([self.stop.signum]))
        if stop_signals.any():
            raise distributed.Terminated(int(stop_signals.max()), steps)

    def diverged(self, what, exploded=True):
        advice = (f"Start again with a lower --lr (now {self.lr:g}) and --resume never" if exploded else
                  f"Check --lr (now {self.lr:g}: lower if the loss exploded before, higher if it barely moved), then "
                  "start again with --resume never; --divergence-check off trains on regardless")
        return Diverged(f"{what}. {advice}")


def mixed_precision(train_step, net, float32_net, images):
    """What mixed precision and loss scaling do in the train step MindSpore built, measured on it: features_dtype,
    the dtype the first layers compute in (float16 under O2 and O3); amp_logit_error, the largest change of the
    step's logits against `float32_net` given net's weights; step_loss_scale, the backward pass's factor."""
    ms.load_param_into_net(float32_net, net.parameters_dict())
    amp_forward = train_step.network._backbone  # the network after amp
    scale = train_step.scale_sense.asnumpy() if hasattr(train_step, "scale_sense") else train_step.sens
    return {"features_dtype": str(next(iter(net.cells()))(images[:2]).dtype),
            "amp_logit_error": float(np.abs(amp_forward(images).asnumpy() - float32_net(images).asnumpy()).max()),
            "step_loss_scale": float(scale)}
