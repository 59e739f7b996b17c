"""Data-parallel LeNet on Fashion-MNIST with MindSpore, launched by msrun, tracked in MLflow:

    python main.py --epochs 1                                               # one process
    msrun --worker_num=2 --local_worker_num=2 --join=True python main.py    # two data-parallel workers
    ./run.sh                                                                # msrun, one worker per device

One file for Ascend NPUs (HCCL, float16 under amp O2) and CPU (MindSpore's own collective). Every setting is a
flag and a variable (--help): above all --epochs, --batch-size (per device), --lr and --output-dir. A job
writes outputs/summary.json, the model, its pictures and an MLflow run. Below, in the order the job runs: the
data, the model, the training as one Model callback, the end; then main(). fmnist/ holds the machinery."""

import copy
import dataclasses
import functools
import gc
import math
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.train import Callback, Model

from fmnist import checkpoints, common, data, distributed, model, outputs, serving, settings, tracking
from fmnist.common import log

# --- The data: on every rank, verified; the article's transforms, batch by batch; each rank's share of it


def get_data(job, splits):
    """The splits on every rank, where each file came from, and the job with its settings checked against the
    data. Where a rank read none, its node's first worker fetches them (nodes need not share a disk)."""
    cfg, collective = job.cfg, job.collective
    sources = dict.fromkeys(job.checksums, str(cfg.data_dir.resolve()))
    if collective.all_gather(np.array([splits is None], dtype=np.int32)).any():
        fetch = functools.partial(data.make_available, cfg, job.checksums, say=log.info)
        sources = collective.wait_for(fetch if collective.is_local_main else None) or sources
        # A rank that read a verified copy before joining has the fetched content already.
        if splits is None:
            splits = data.load_splits(cfg.data_dir, job.checksums)
    sizes = len(splits.train.labels), len(splits.test.labels)
    cfg = settings.check_against_data(cfg, collective.world_size, *sizes)
    return dataclasses.replace(job, cfg=cfg), splits, sources


def model_input(images, labels):
    """A batch as the network reads it: the article's transforms (data.to_model_input), one-hot labels. Batch
    by batch, as the datasets draw them: the whole training set in float32 would be 188 MB more per rank."""
    return data.to_model_input(images), data.one_hot(labels)


class Shard:
    """This rank's share of the training set, epoch after epoch, as GeneratorDataset reads it. The order is
    global: step k of an epoch trains the k-th `global_batch` samples of the permutation of (seed, epoch),
    and rank r takes the r-th of its world_size slices. So any world size that divides the global batch trains
    the same samples at each step, and a job resumed `skip` steps into an epoch trains what an unbroken one
    would (docs/data-order.md)."""

    def __init__(self, split, global_batch, collective, seed):
        self.images, self.labels, self.seed = split.images, split.labels, seed
        self.global_batch, self.rank, self.world_size = global_batch, collective.rank, collective.world_size
        self.epoch = self.skip = 0

    @property
    def batch_size(self):
        return self.global_batch // self.world_size

    @property
    def steps_per_epoch(self):
        return len(self.images) // self.global_batch

    def __len__(self):
        return self.steps_per_epoch - self.skip

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.images))
        self.epoch += 1
        for step in range(self.skip, self.steps_per_epoch):
            start = step * self.global_batch + self.rank * self.batch_size
            batch = order[start:start + self.batch_size]
            yield model_input(self.images[batch], self.labels[batch])

    def dataset(self, epoch, skip=0):
        """The batches from `epoch` (from 0) on, `skip` steps into it; with `skip`, of that epoch alone:
        MindSpore fixes a dataset's length for all its epochs."""
        shard = copy.copy(self)
        shard.epoch, shard.skip = epoch, skip
        return batches_dataset(shard)


def eval_dataset(test, batch_size, collective):
    """This rank's test samples, every world_size-th from its rank on, in batches. The framework's sampler
    pads shards to equal length by repeating samples, which would count some twice."""
    mine = slice(collective.rank, None, collective.world_size)
    images, labels = test.images[mine], test.labels[mine]
    batches = [model_input(images[i:i + batch_size], labels[i:i + batch_size])
               for i in range(0, len(labels), batch_size)]
    return batches_dataset(batches)


def batches_dataset(batches):
    """(images, labels) batches as a MindSpore dataset, in their order and in this process."""
    return ms.dataset.GeneratorDataset(batches, ["image", "label"], shuffle=False,
                                       python_multiprocessing=False)


# --- The model: the network, its loss, the optimizer and mixed precision, gradients averaged across ranks


def build_model(job, evaluation):
    """The network, and the Model that trains it and scores it with `evaluation`."""
    cfg, fixed = job.cfg, job.loss_scaling.startswith("fixed:")
    scale = float(job.loss_scaling.partition(":")[2]) if fixed else 1.0
    net = model.build_network(len(data.CLASS_NAMES))
    # A fixed scale without overflow checks leaves the gradients scaled: the optimizer divides them back.
    common_args = {"learning_rate": cfg.lr, "weight_decay": cfg.weight_decay, "loss_scale": scale}
    momentum = cfg.momentum if cfg.optimizer == "momentum" else 0.0
    optimizer = (nn.Adam(net.trainable_params(), **common_args) if cfg.optimizer == "adam"
                 else nn.SGD(net.trainable_params(), momentum=momentum, **common_args))
    # drop_overflow_update=False is the only fixed scaling MindSpore runs on CPU, and needs no overflow check.
    manager = (ms.amp.DynamicLossScaleManager() if job.loss_scaling == "dynamic" else
               ms.amp.FixedLossScaleManager(scale, drop_overflow_update=False) if fixed else None)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")
    return net, Model(net, loss_fn, optimizer, amp_level=job.amp_level, metrics={"test": evaluation},
                      loss_scale_manager=manager)


# --- The training: one Model callback that owns its state and its clock

# An untrained network's loss is ln C and its accuracy 1 / C, for C classes. With --divergence-check on,
# besides a non-finite loss: a training loss over EXPLODED times ln C is blowing up; and from
# JUDGED_AFTER_STEPS steps on, an epoch that ends at most CHANCE_MARGIN / C accurate or at least
# UNTRAINED_LOSS_MARGIN times ln C in loss has learned nothing (dead ReLUs, or a learning rate too small).
EXPLODED = 10
JUDGED_AFTER_STEPS = 200
CHANCE_MARGIN = 1.2
UNTRAINED_LOSS_MARGIN = 0.98


class Diverged(Exception):
    """The training stopped learning: a non-finite or exploded loss, or no better than chance."""


class Training(Callback):
    """The training and the one owner of its state: the network and its Model, this rank's shard and test
    slice, the tracker, rank 0's checkpoints, and the clock, `steps`, the global steps done. Model.fit calls
    it where a loop acts: after each step, the checkpoint when due; every log interval one gather (the loss, a
    stop request), the checks, the progress line and the tracking; at an epoch's end, the validation."""

    def __init__(self, job, splits, startup):
        super().__init__()
        self.job, self.cfg, self.collective, self.startup = job, job.cfg, job.collective, startup
        self.net, self.model = build_model(job, distributed.Evaluation(job.collective, len(data.CLASS_NAMES)))
        self.shard = Shard(splits.train, job.cfg.batch_size * job.collective.world_size,
                           job.collective, job.cfg.seed)
        self.eval_set = eval_dataset(splits.test, job.cfg.batch_size, job.collective)
        self.tracker, self.checkpoints, self.resumed = tracking.NullTracker(), None, None
        self.steps = self.resumed_steps = 0  # the clock
        self.parts = []  # checkpoints.Part, this one last
        # Each epoch's figures and the loss curve's (epoch as a fraction, loss) points, with a resume's.
        self.history, self.loss_points = [], []
        # The latest validation's confusion matrix; the steps dynamic loss scaling skipped for overflows.
        self.confusion, self.skipped_steps = None, 0
        self.first_step_s = self.first_step_at = None
        self.tracking_agreed = False
        # SIGTERM becomes a request the ranks agree on; one agreed at an epoch's end waits for its checkpoint.
        self.stop, self.stop_after_epoch = distributed.StopRequest(), 0
        self._loss_sum = self._overflows = self._loss_scale = None
        self.chance_loss, self.chance = math.log(len(data.CLASS_NAMES)), 1 / len(data.CLASS_NAMES)

    @property
    def global_batch(self):
        return self.shard.global_batch

    @property
    def steps_per_epoch(self):
        return self.shard.steps_per_epoch

    @property
    def state(self):
        return checkpoints.State(self.steps, self.history, self.loss_points, self.parts)

    @property
    def position(self):
        return checkpoints.Position.after(self.steps, self.steps_per_epoch)

    def resume(self):
        """The newest good checkpoint of this training loaded, or none, as every rank agrees."""
        directory, network = self.cfg.output_dir / "checkpoints", self.model.train_network
        resolved = {**self.job.resolved, "data_sha256": self.job.checksums}
        course = checkpoints.course(self.cfg, resolved, network, self.global_batch)
        world_size = self.collective.world_size
        if self.cfg.resume == "auto":
            self.resumed = checkpoints.load_latest(directory, network, course, world_size)
        checkpoints.agree_on_resume(self.collective, self.resumed, directory)
        if self.resumed:
            state, was = self.resumed.state, self.resumed.state.parts[-1]
            self.steps = self.resumed_steps = state.steps
            self.history, self.loss_points, self.parts = list(state.history), state.loss_points, state.parts
            steps = f" and {self.position.step} steps" if self.position.step else ""
            log.info("resuming from %s: %d of %d epochs%s done", self.resumed.path, self.position.epoch,
                     self.cfg.epochs, steps)
            if was.world_size != world_size:
                self.shard.global_batch = course["global_batch"] = self.resumed.global_batch
                self.cfg = dataclasses.replace(self.cfg, batch_size=self.shard.batch_size)
                self.job = dataclasses.replace(self.job, cfg=self.cfg)
                log.info("resuming a %d-worker training on %d worker%s: %d -> %d per device, global batch %d "
                         "kept", was.world_size, world_size, "s" if world_size > 1 else "", was.batch_size,
                         self.shard.batch_size, self.global_batch)
        self.parts = [*self.parts, checkpoints.Part(self.steps, world_size, self.shard.batch_size)]
        if self.collective.is_main:
            self.checkpoints = checkpoints.Checkpoints(self.cfg, course, self.resumed, self.steps_per_epoch)

    def compile(self):
        """The training step compiled before Model.fit, which reuses the graph, so that its cost shows."""
        network, batch = self.model.train_network, self.shard.batch_size
        network.set_train()
        network.compile(*map(Tensor, model_input(self.shard.images[:batch], self.shard.labels[:batch])))

    def fit(self):
        """Model.fit from where the training is, validating after each epoch: the rest of an interrupted epoch
        as a fit of its own (a dataset's length is fixed for all its epochs), then the whole epochs left."""
        epoch, step = self.position.epoch, self.position.step
        fit = {"valid_dataset": self.eval_set, "callbacks": [self], "dataset_sink_mode": False}
        if step and epoch < self.cfg.epochs:
            self.model.fit(epoch + 1, self.shard.dataset(epoch, skip=step), initial_epoch=epoch, **fit)
            epoch += 1
        if epoch < self.cfg.epochs:
            self.model.fit(self.cfg.epochs, self.shard.dataset(epoch), initial_epoch=epoch, **fit)

    def on_train_epoch_begin(self, run_context):
        self._epoch_start = self._interval_start = time.perf_counter()
        self._epoch_steps = self._interval_steps = 0

    def on_train_step_end(self, run_context):
        outputs = run_context.original_args().net_outputs
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        # Summed on the device, so that the host does not wait on each step; read once an interval.
        self._loss_sum = outputs[0] if self._loss_sum is None else self._loss_sum + outputs[0]
        # Dynamic loss scaling's cell returns (loss, overflowed, scale).
        if len(outputs) == 3:
            overflowed = ops.cast(outputs[1], ms.int32)
            self._overflows = overflowed if self._overflows is None else self._overflows + overflowed
            self._loss_scale = outputs[2]
        self.steps += 1
        self._epoch_steps += 1
        self._interval_steps += 1
        if self.steps == self.resumed_steps + 1:
            self._first_step_done()
        if self.steps % self.cfg.log_interval == 0 or self.position.step == 0:
            self._log_interval()
        if self.cfg.checkpoint_steps and self.steps % self.cfg.checkpoint_steps == 0:
            self.agree_on_tracking()
        if self.checkpoints:
            self.checkpoints.step_done(self.model.train_network, self.state)

    def _first_step_done(self):
        self.startup.lap("first_step")
        self.first_step_s, self.first_step_at = time.perf_counter() - self.startup.started, time.time()
        if self.collective.is_main:
            phases = ", ".join(f"{name.replace('_', ' ')} {s:.1f}" for name, s in self.startup.phases.items())
            log.info("first step done %.1f s after start (%s)", self.first_step_s, phases)
            part = {"world_size": self.collective.world_size, "batch_size_per_device": self.shard.batch_size}
            if self.checkpoints.restarts:
                part.update(self.checkpoints.restart_cost())
            self.tracker.log_metrics(part, step=self.steps)

    def agree_on_tracking(self):
        """Before the first checkpoint or result, once: every rank learns whether MLflow took the run's start,
        which rank 0 sends as training begins. A refusal ends them all with exit 2. A collective."""
        if not self.tracking_agreed:
            self.collective.wait_for(self.tracker.started if self.collective.is_main else None)
            self.tracking_agreed = True

    def _log_interval(self):
        # One gather carries each rank's loss and whether it was asked to stop, so all ranks decide alike.
        mine = [float(self._loss_sum.asnumpy()) / self._interval_steps, self.stop.signum]
        per_rank, stop_signals = self.collective.all_gather(np.array(mine, dtype=np.float64)).T
        self._loss_sum, loss, epoch_ends = None, per_rank.mean(), self.position.step == 0
        epoch, step = self.position.epoch + (not epoch_ends), self.position.step or self.steps_per_epoch
        if not np.isfinite(per_rank).all():
            raise self.diverged(f"training loss {loss} at step {self.steps} (epoch {epoch})")
        if self.cfg.divergence_check == "on" and loss > EXPLODED * self.chance_loss:
            raise self.diverged(f"training loss {loss:.4g} at step {self.steps} (epoch {epoch}), over "
                                f"{EXPLODED} times the {self.chance_loss:.2f} of an untrained network")
        if stop_signals.any():
            self.stop_after_epoch = int(stop_signals.max())
        now = time.perf_counter()
        rate = self._interval_steps * self.global_batch / (now - self._interval_start)
        self._interval_start, self._interval_steps = now, 0
        if self.collective.is_main:
            left = [common.duration(steps * self.global_batch / rate) for steps in
                    (self.steps_per_epoch - step, self.cfg.epochs * self.steps_per_epoch - self.steps)]
            log.info("epoch %d/%d | step %d/%d | loss %.4f | %s samples/s | epoch ends in %s, training in %s",
                     epoch, self.cfg.epochs, step, self.steps_per_epoch, loss, f"{rate:,.0f}", *left)
            metrics = {"train_loss": loss, "train_samples_per_s": rate,
                       **{f"train_loss_rank{rank}": value for rank, value in enumerate(per_rank)}}
            if self._loss_scale is not None:
                self.skipped_steps += int(self._overflows.asnumpy())
                metrics.update(loss_scale=self._loss_scale.asnumpy(), skipped_steps=self.skipped_steps)
                self._overflows = None
            self.tracker.log_metrics(metrics, step=self.steps)
            self.loss_points.append((self.steps / self.steps_per_epoch, float(loss)))
        # After the interval's figures, which the stop's checkpoint keeps; at an epoch's last step the stop
        # waits for the epoch's end, whose validation it checkpoints.
        if stop_signals.any() and not epoch_ends:
            raise distributed.Terminated(self.stop_after_epoch, self.steps)

    def on_eval_begin(self, run_context):
        self._eval_start = time.perf_counter()
        self._train_s = self._eval_start - self._epoch_start

    def on_train_epoch_end(self, run_context):
        test, eval_s = run_context.original_args().metrics["test"], time.perf_counter() - self._eval_start
        epoch, loss, accuracy = self.position.epoch, float(test["loss"]), float(test["accuracy"])
        figures = {"epoch": epoch, "train_s": self._train_s, "eval_s": eval_s,
                   "train_samples_per_s": self._epoch_steps * self.global_batch / self._train_s,
                   "val_loss": loss, "val_accuracy": accuracy}
        self.confusion = test["confusion"]
        # The same figures on every rank, checked before this epoch's checkpoint is written.
        if not math.isfinite(loss):
            raise self.diverged(f"validation loss {loss} after epoch {epoch} (step {self.steps})")
        guessing = accuracy <= CHANCE_MARGIN * self.chance or loss >= UNTRAINED_LOSS_MARGIN * self.chance_loss
        if self.cfg.divergence_check == "on" and self.steps >= JUDGED_AFTER_STEPS and guessing:
            raise self.diverged(f"not learning: after epoch {epoch} ({self.steps} steps) the validation "
                                f"accuracy is {accuracy:.4f} and the loss {loss:.4f}, against "
                                f"{self.chance:.2f} and {self.chance_loss:.2f} for guessing", exploded=False)
        self.history.append(figures)
        self.agree_on_tracking()
        if self.collective.is_main:
            log.info("epoch %d/%d done | train %.1f s, %s samples/s | eval %.1f s | val_loss %.4f | "
                     "val_accuracy %.4f | training ends in %s", epoch, self.cfg.epochs, self._train_s,
                     f"{figures['train_samples_per_s']:,.0f}", eval_s, loss, accuracy,
                     common.duration((self.cfg.epochs - epoch) * (self._train_s + eval_s)))
            # Per-epoch figures take the epoch as MLflow's step, so that their charts read in epochs.
            self.tracker.log_metrics({"epoch_train_s": self._train_s, "epoch_eval_s": eval_s,
                                      "epoch_train_samples_per_s": figures["train_samples_per_s"],
                                      "val_loss": loss, "val_accuracy": accuracy}, step=epoch)
            self.checkpoints.save(self.model.train_network, self.state)
        # A stop agreed at the last epoch's end changes nothing: the training is complete.
        if self.stop_after_epoch and epoch < self.cfg.epochs:
            raise distributed.Terminated(self.stop_after_epoch, self.steps)

    def diverged(self, what, exploded=True):
        advice = (f"Start again with a lower --lr (now {self.cfg.lr:g}) and --resume never" if exploded else
                  f"Check --lr (now {self.cfg.lr:g}: lower if the loss exploded before, higher if it barely "
                  "moved), then start again with --resume never; --divergence-check off trains on regardless")
        return Diverged(f"{what}. {advice}")


# --- An early end: the agreed stop, divergence, a full disk


def stop_early(training, exc):
    """The job ends without results. Divergence (exit 3) and a signal (128 + it) stop every rank at the same
    step, which rank 0 checkpoints on a signal; a full disk (exit 4) is rank 0's, the one writer's, alone."""
    stopped, collective = isinstance(exc, distributed.Terminated), training.collective
    finish = functools.partial(training.tracker.finish, "KILLED" if stopped else "FAILED",
                               timeout=tracking.STOP_TIMEOUT_S)
    if isinstance(exc, common.DiskFull):
        log.error("%s", exc)
        finish()
        return exc.status
    try:
        # Before the stop's checkpoint, as before any other.
        if stopped:
            training.agree_on_tracking()
    except common.UsageError as refused:
        log.error("%s", refused)
        return refused.status
    try:
        # Rank 0 says why; the others say where they stopped.
        if not collective.is_main:
            log.info("rank %d stops with the others: %s", collective.rank, exc)
        elif stopped:
            # Here, not in wait_for's thread: MindSpore is not thread-safe.
            training.checkpoints.save(training.model.train_network, training.state)
            log.warning("%s; checkpoint %s written, the next start resumes from it", exc,
                        training.checkpoints.path(training.steps))
        else:
            log.error("training diverged: %s; no final model was written, the checkpoints of the good epochs "
                      "stay in %s", exc, training.checkpoints.directory)
        collective.wait_for(finish if collective.is_main else None)
    except common.DiskFull as full:
        return stop_early(training, full)
    except common.UsageError:
        pass  # rank 0 failed to finish: its own exit says why
    return 128 + exc.signum if stopped else common.EXIT_DIVERGED


# --- The pipeline


def main(argv=None) -> int:
    # MindSpore collects garbage before each graph compile: objects frozen here, the imports', are never
    # scanned again, which saves seconds of a short job (docs/performance.md).
    gc.freeze()
    startup = common.Startup()
    try:
        cfg = settings.parse_config(argv)
        # A worker reads the data before it joins: init() waits for the last worker anyway, and msrun's
        # scheduler, which reads nothing (its pod may have no data), is listening by the time they arrive.
        checksums = splits = None
        if not distributed.is_scheduler():
            checksums = data.load_checksums(cfg.checksums_file)
            splits = data.load_verified(cfg.data_dir, checksums)
        startup.lap("data")
        job = distributed.join_job(cfg, checksums)
    except common.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    startup.lap("join")
    try:
        job, splits, sources = get_data(job, splits)
        if job.cfg.predict:
            eval_set = eval_dataset(splits.test, job.cfg.batch_size, job.collective)
            return serving.predict(job.cfg.predict, eval_set, job.collective)
        training = Training(job, splits, startup)
        startup.lap("setup")
        training.resume()
        startup.lap("checkpoint")
        training.compile()
        startup.lap("compile")
        training.tracker = tracking.start(training.job, training.resumed is not None, splits, sources)
        startup.lap("tracking")
    except (common.UsageError, common.DiskFull) as exc:
        log.error("%s", exc)
        return exc.status
    # A SIGTERM from here on is a request the ranks agree on, and one more while they stop is moot.
    with training.stop:
        try:
            training.fit()
            training.agree_on_tracking()
            return outputs.report(training, splits)
        except common.UsageError as exc:
            log.error("%s", exc)
            return exc.status
        except RuntimeError as exc:
            if not (lost := distributed.peer_lost(exc)):
                raise
            log.error("another rank of the job is gone (%s); run.sh names it", lost)
            return 1
        except (Diverged, distributed.Terminated, common.DiskFull) as exc:
            return stop_early(training, exc)


if __name__ == "__main__":
    sys.exit(main())
