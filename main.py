"""Data-parallel LeNet on Fashion-MNIST with MindSpore, launched by msrun, tracked in MLflow:

    python main.py --epochs 1                                               # one process
    msrun --worker_num=2 --local_worker_num=2 --join=True python main.py    # two data-parallel workers
    ./run.sh                                                                # msrun, one worker per device

The same file runs on Ascend NPUs (HCCL; float16 under amp O2) and on CPU (MindSpore's own collective).
Every setting is a flag and a variable (--help); those that matter most are --epochs, --batch-size (per
device), --lr and --output-dir. With the defaults, 2 CPU workers train 10 epochs in about a minute to a test
accuracy of 0.8726, and write outputs/summary.json, the model, its pictures and an MLflow run.

It reads in the order the job runs: the job's place in msrun, the data each rank trains on, the model, the
training as one Model callback, the tracking, the end; then main(), one call per stage. fmnist/ holds the
machinery a reader need not see to follow the training."""

import copy
import dataclasses
import functools
import gc
import json
import math
import os
import resource
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.train import Callback, Model

from fmnist import checkpoints, common, data, distributed, model, outputs, serving, settings, tracking
from fmnist.common import log

# --- The job: the settings, what they resolve to on this device, and this worker's place in the msrun job


@dataclasses.dataclass(frozen=True)
class Job:
    """The settings, what this worker resolved from them, and its place in the msrun job."""

    cfg: settings.Config
    checksums: dict
    device: str
    amp_level: str
    loss_scaling: str
    # The CPU's model, its ISA flags, oneDNN's cap on them (x86-64) and this worker's threads.
    cpu: dict
    collective: distributed.Collective
    local_workers: int
    # Rank 0's lock on the output directory, held until this process ends, however it ends.
    output_lock: object

    @property
    def resolved(self):
        """What the run records beside the settings, and a resume must match."""
        return {"device": self.device, "world_size": self.collective.world_size, "amp_level": self.amp_level,
                "loss_scaling": self.loss_scaling}


def join_job(cfg):
    """Graph mode on the device, init() of the msrun job, identical seeds, and this worker's share of the CPU.
    msrun's scheduler process stays in init() until the job ends."""
    device = distributed.resolve_device(cfg.device)
    amp_level, loss_scaling = settings.resolve_precision(cfg.amp, cfg.loss_scale, device)
    isa_cap = distributed.cap_onednn_isa() if device == "CPU" else None
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device)
    rank, local_rank, world_size = distributed.init_distributed()
    common.configure_logging(rank)
    local_workers = int(os.environ.get("LOCAL_WORKERS") or world_size)
    threads = distributed.set_up_worker(device, local_rank, local_workers, cfg.cpu_bind == "on", cfg.threads)
    # Identical initial weights on every replica: MindSpore does not broadcast them.
    ms.set_seed(cfg.seed)
    cpu = {**distributed.cpu_description(), "onednn_isa_cap": isa_cap, "threads_per_worker": threads}
    lock = common.hold_lock(cfg.output_dir / ".lock", f"--output-dir {cfg.output_dir}") if rank == 0 else None
    job = Job(cfg, data.load_checksums(cfg.checksums_file), device, amp_level, loss_scaling, cpu,
              distributed.Collective(rank, local_rank, world_size), local_workers, lock)
    # Every rank says who it is: run.sh finds a failed worker's log by the pid msrun reports.
    log.info("rank %d of %d (pid %d), device %s, amp %s, loss scale %s, %d threads on cores %s, oneDNN ISA "
             "cap %s, settings %s", rank, world_size, os.getpid(), device, amp_level, loss_scaling, threads,
             sorted(os.sched_getaffinity(0)), isa_cap, json.dumps(dataclasses.asdict(cfg), default=str))
    return job


def get_data(job):
    """The splits on every rank, fetched by one worker per node (nodes need not share a file system), where
    each file came from, and the job with its settings checked against the data (a default fitted to it)."""
    cfg, collective = job.cfg, job.collective
    fetch = functools.partial(data.make_available, cfg, job.checksums, say=log.info)
    sources = collective.wait_for(fetch if collective.is_local_main else None) or {}
    splits = data.load_splits(cfg.data_dir)
    sizes = len(splits.train.labels), len(splits.test.labels)
    cfg = settings.check_against_data(cfg, collective.world_size, *sizes)
    return dataclasses.replace(job, cfg=cfg), splits, sources


# --- The data: the article's transforms once for the whole set, and each rank's share of every epoch


class Shard:
    """This rank's share of the training set, epoch after epoch in whole batches, as GeneratorDataset reads
    it. Rank r takes the r-th block of the permutation of (seed, epoch): shards are disjoint, and a job
    resumed `skip` steps into an epoch trains what an unbroken one would."""

    def __init__(self, inputs, batch_size, rank, world_size, seed):
        self.images, self.labels = inputs.images, inputs.labels
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.epoch = self.skip = 0

    @property
    def steps_per_epoch(self):
        return len(self.images) // (self.batch_size * self.world_size)

    def __len__(self):
        return self.steps_per_epoch - self.skip

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.images))
        self.epoch += 1
        per_rank = self.steps_per_epoch * self.batch_size
        mine = order[self.rank * per_rank:(self.rank + 1) * per_rank]
        for start in range(self.skip * self.batch_size, per_rank, self.batch_size):
            batch = mine[start:start + self.batch_size]
            yield self.images[batch], self.labels[batch]

    def dataset(self, epoch, skip=0):
        """The batches for Model.fit from `epoch` (from 0) on, `skip` steps into it. With `skip`, for the
        rest of that epoch only: MindSpore fixes a dataset's length for all its epochs."""
        shard = copy.copy(self)
        shard.epoch, shard.skip = epoch, skip
        return ms.dataset.GeneratorDataset(shard, column_names=["image", "label"], shuffle=False,
                                           python_multiprocessing=False)


def model_input(split):
    """A split as the network reads it: the article's transforms (data.to_model_input), one-hot labels."""
    return data.Split(data.to_model_input(split.images), data.one_hot(split.labels))


def eval_dataset(test, batch_size, collective):
    """This rank's test samples, every world_size-th from its rank on, in batches. The framework's sampler
    pads shards to equal length by repeating samples, which would count some twice."""
    mine = slice(collective.rank, None, collective.world_size)
    inputs = model_input(data.Split(test.images[mine], test.labels[mine]))
    batches = [(inputs.images[i:i + batch_size], inputs.labels[i:i + batch_size])
               for i in range(0, len(inputs.images), batch_size)]
    return ms.dataset.GeneratorDataset(batches, column_names=["image", "label"], shuffle=False,
                                       python_multiprocessing=False)


# --- The model: the network, its loss, the optimizer and mixed precision, gradients averaged across ranks


def build_model(job, evaluation):
    """The network and the Model that trains it and scores it with `evaluation`."""
    cfg, fixed = job.cfg, job.loss_scaling.startswith("fixed:")
    scale = float(job.loss_scaling.partition(":")[2]) if fixed else 1.0
    net = model.build_network(len(data.CLASS_NAMES))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")
    # A fixed scale without overflow checks leaves the gradients scaled: the optimizer divides them back.
    common_args = {"learning_rate": cfg.lr, "weight_decay": cfg.weight_decay, "loss_scale": scale}
    if cfg.optimizer == "adam":
        optimizer = nn.Adam(net.trainable_params(), **common_args)
    else:
        momentum = cfg.momentum if cfg.optimizer == "momentum" else 0.0
        optimizer = nn.SGD(net.trainable_params(), momentum=momentum, **common_args)
    # drop_overflow_update=False is the only fixed scaling MindSpore runs on CPU, and needs no overflow check.
    manager = None
    if job.loss_scaling == "dynamic":
        manager = ms.amp.DynamicLossScaleManager()
    elif fixed:
        manager = ms.amp.FixedLossScaleManager(scale, drop_overflow_update=False)
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
    """The training stopped learning: a non-finite or exploded loss, or no better than chance. Its message
    advises."""


class Startup:
    """The job's phases on the way to its first step, each timed as it ends: lap("join") after joining,
    etc."""

    def __init__(self):
        self.started, self.phases = time.perf_counter(), {}

    def lap(self, phase):
        self.phases[phase] = time.perf_counter() - self.started - sum(self.phases.values())


class Training(Callback):
    """The training, and the one owner of its state: the network and its Model, this rank's shard and test
    slice, the tracker, rank 0's checkpoints, and the clock, `steps`, the global steps done since the
    training began (a resumed job counts on). Model.fit calls it as a loop would run: after each step, the
    checkpoint when it is due; every log interval one gather (the loss, a stop request), the divergence
    check, the progress line and the tracking; at each epoch's end, the validation."""

    def __init__(self, job, splits, startup):
        super().__init__()
        self.job, self.cfg, self.collective, self.startup = job, job.cfg, job.collective, startup
        self.net, self.model = build_model(job, distributed.Evaluation(job.collective, len(data.CLASS_NAMES)))
        self.shard = Shard(model_input(splits.train), job.cfg.batch_size, job.collective.rank,
                           job.collective.world_size, job.cfg.seed)
        self.eval_set = eval_dataset(splits.test, job.cfg.batch_size, job.collective)
        self.steps_per_epoch = self.shard.steps_per_epoch
        self.global_batch = job.cfg.batch_size * job.collective.world_size
        self.tracker = tracking.NullTracker()
        self.checkpoints = self.resumed = None
        self.steps = self.resumed_steps = 0
        # Each epoch's figures, and the loss curve's points (epoch as a fraction, loss), a resume's too.
        self.history, self.loss_points = [], []
        # The latest validation's confusion matrix, and the steps dynamic loss scaling skipped for overflows.
        self.confusion, self.skipped_steps = None, 0
        self.first_step_s = self.first_step_at = None
        # SIGTERM becomes a request the ranks agree on; one agreed at an epoch's end waits for its checkpoint.
        self.stop, self.stop_after_epoch = distributed.StopRequest(), 0
        self._loss_sum = self._overflows = self._loss_scale = None
        # The loss and the accuracy of a network that learned nothing (see EXPLODED and CHANCE_MARGIN above).
        self.untrained_loss, self.chance = math.log(len(data.CLASS_NAMES)), 1 / len(data.CLASS_NAMES)

    @property
    def state(self):
        return checkpoints.State(self.steps, self.history, self.loss_points)

    @property
    def position(self):
        return checkpoints.Position.after(self.steps, self.steps_per_epoch)

    def resume(self):
        """The newest good checkpoint of this training loaded, or none, as every rank agrees."""
        directory, network = self.cfg.output_dir / "checkpoints", self.model.train_network
        resolved = {**self.job.resolved, "data_sha256": self.job.checksums}
        course = checkpoints.course(self.cfg, resolved, network)
        if self.cfg.resume == "auto":
            self.resumed = checkpoints.load_latest(directory, network, course, self.steps_per_epoch)
        checkpoints.agree_on_resume(self.collective, self.resumed, directory)
        if self.resumed:
            state = self.resumed.state
            self.steps = self.resumed_steps = state.steps
            self.history, self.loss_points = list(state.history), list(state.loss_points)
            steps_done = f" and {self.position.step} steps" if self.position.step else ""
            log.info("resuming from %s: %d of %d epochs%s done", self.resumed.path, self.position.epoch,
                     self.cfg.epochs, steps_done)
        if self.collective.is_main:
            self.checkpoints = checkpoints.Checkpoints(self.cfg, course, self.resumed, self.steps_per_epoch)

    def compile(self):
        """The training step compiled before Model.fit, which reuses the graph, so that its cost shows
        apart."""
        network, batch = self.model.train_network, self.shard.batch_size
        network.set_train()
        network.compile(Tensor(self.shard.images[:batch]), Tensor(self.shard.labels[:batch]))

    def fit(self):
        """Model.fit from where the training is, validating after each epoch: the rest of an interrupted epoch
        as a fit of its own (a dataset's length is fixed for all its epochs), then the whole epochs left."""
        epoch, step = self.position.epoch, self.position.step
        fit = {"valid_dataset": self.eval_set, "valid_frequency": 1, "callbacks": [self],
               "dataset_sink_mode": False}
        if step and epoch < self.cfg.epochs:
            self.model.fit(epoch + 1, self.shard.dataset(epoch, skip=step), initial_epoch=epoch, **fit)
            epoch += 1
        if epoch < self.cfg.epochs:
            self.model.fit(self.cfg.epochs, self.shard.dataset(epoch), initial_epoch=epoch, **fit)

    def on_train_epoch_begin(self, run_context):
        self._epoch_start = self._interval_start = time.perf_counter()
        self._epoch_steps = self._interval_steps = 0

    def on_train_step_end(self, run_context):
        self._add_up(run_context.original_args().net_outputs)
        self.steps += 1
        if self.steps == self.resumed_steps + 1:
            self._first_step_done()
        epoch_ends = self.position.step == 0
        if self.steps % self.cfg.log_interval == 0 or epoch_ends:
            self._log_interval(epoch_ends)
        if self.checkpoints:
            self.checkpoints.step_done(self.model.train_network, self.state)

    def _add_up(self, outputs):
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        # Summed on the device, so that the host does not wait on each step; read once an interval.
        self._loss_sum = outputs[0] if self._loss_sum is None else self._loss_sum + outputs[0]
        # Dynamic loss scaling's cell returns (loss, overflowed, scale).
        if len(outputs) == 3:
            overflowed = ops.cast(outputs[1], ms.int32)
            self._overflows = overflowed if self._overflows is None else self._overflows + overflowed
            self._loss_scale = outputs[2]
        self._epoch_steps += 1
        self._interval_steps += 1

    def _first_step_done(self):
        self.startup.lap("first_step")
        self.first_step_s, self.first_step_at = time.perf_counter() - self.startup.started, time.time()
        if not self.collective.is_main:
            return
        phases = ", ".join(f"{phase.replace('_', ' ')} {s:.1f}" for phase, s in self.startup.phases.items())
        log.info("first step done %.1f s after start (%s)", self.first_step_s, phases)
        if self.checkpoints.restarts:
            cost = self.checkpoints.restart_cost()
            lost_s = f"{cost['restart_total_s']:.1f} s" if "restart_total_s" in cost else "an unknown time"
            log.info("restart %d: %d steps lost, %s from the stop to this step", cost["restarts"],
                     cost["restart_steps_lost"], lost_s)
            self.tracker.log_metrics(cost, step=self.steps)

    def _log_interval(self, epoch_ends):
        # One gather carries each rank's loss and whether it was asked to stop, so all ranks decide alike.
        mine = [float(self._loss_sum.asnumpy()) / self._interval_steps, self.stop.signum]
        per_rank, stop_signals = self.collective.all_gather(np.array(mine, dtype=np.float64)).T
        self._loss_sum, loss = None, per_rank.mean()
        epoch, step = self.position.epoch + (not epoch_ends), self.position.step or self.steps_per_epoch
        where = f"at step {self.steps} (epoch {epoch})"
        if not np.isfinite(per_rank).all():
            raise self.diverged(f"training loss {loss} {where}")
        if self.cfg.divergence_check == "on" and loss > EXPLODED * self.untrained_loss:
            raise self.diverged(f"training loss {loss:.4g} {where}, over {EXPLODED} times the "
                                f"{self.untrained_loss:.2f} of an untrained network")
        if stop_signals.any():
            # At an epoch's last step the stop waits for the epoch's end, whose validation it checkpoints.
            if not epoch_ends:
                raise distributed.Terminated(int(stop_signals.max()), self.steps)
            self.stop_after_epoch = int(stop_signals.max())
        now = time.perf_counter()
        rate = self._interval_steps * self.global_batch / (now - self._interval_start)
        self._interval_start, self._interval_steps = now, 0
        if not self.collective.is_main:
            return
        steps_per_s = rate / self.global_batch
        epoch_left = common.duration((self.steps_per_epoch - step) / steps_per_s)
        training_left = common.duration((self.cfg.epochs * self.steps_per_epoch - self.steps) / steps_per_s)
        log.info("epoch %d/%d | step %d/%d | loss %.4f | %s samples/s | epoch ends in %s, training in %s",
                 epoch, self.cfg.epochs, step, self.steps_per_epoch, loss, f"{rate:,.0f}", epoch_left,
                 training_left)
        metrics = {"train_loss": loss, "train_samples_per_s": rate,
                   **{f"train_loss_rank{rank}": value for rank, value in enumerate(per_rank)}}
        if self._loss_scale is not None:
            self.skipped_steps += int(self._overflows.asnumpy())
            metrics.update(loss_scale=self._loss_scale.asnumpy(), skipped_steps=self.skipped_steps)
            self._overflows = None
        self.tracker.log_metrics(metrics, step=self.steps)
        self.loss_points.append((self.steps / self.steps_per_epoch, float(loss)))

    def on_eval_begin(self, run_context):
        self._eval_start = time.perf_counter()
        self._train_s = self._eval_start - self._epoch_start

    def on_train_epoch_end(self, run_context):
        test, eval_s = run_context.original_args().metrics["test"], time.perf_counter() - self._eval_start
        epoch = self.position.epoch
        figures = {"epoch": epoch, "train_s": self._train_s, "eval_s": eval_s,
                   "train_samples_per_s": self._epoch_steps * self.global_batch / self._train_s,
                   "val_loss": float(test["loss"]), "val_accuracy": float(test["accuracy"])}
        self.confusion = test["confusion"]
        # The same figures on every rank, checked before this epoch's checkpoint is written.
        self._check_learning(figures)
        self.history.append(figures)
        if self.collective.is_main:
            training_left = common.duration((self.cfg.epochs - epoch) * (self._train_s + eval_s))
            log.info("epoch %d/%d done | train %.1f s, %s samples/s | eval %.1f s | val_loss %.4f | "
                     "val_accuracy %.4f | training ends in %s", epoch, self.cfg.epochs, self._train_s,
                     f"{figures['train_samples_per_s']:,.0f}", eval_s, figures["val_loss"],
                     figures["val_accuracy"], training_left)
            # Per-epoch figures take the epoch as MLflow's step, so that their charts read in epochs.
            epoch_figures = {"train_s", "eval_s", "train_samples_per_s"}
            self.tracker.log_metrics({f"epoch_{k}" if k in epoch_figures else k: v
                                      for k, v in figures.items() if k != "epoch"}, step=epoch)
            self.checkpoints.save(self.model.train_network, self.state)
        # A stop agreed at the last epoch's end changes nothing: the training is complete.
        if self.stop_after_epoch and epoch < self.cfg.epochs:
            raise distributed.Terminated(self.stop_after_epoch, self.steps)

    def _check_learning(self, figures):
        epoch, loss, accuracy = figures["epoch"], figures["val_loss"], figures["val_accuracy"]
        if not math.isfinite(loss):
            raise self.diverged(f"validation loss {loss} after epoch {epoch} (step {self.steps})")
        if self.cfg.divergence_check == "off" or self.steps < JUDGED_AFTER_STEPS:
            return
        if accuracy <= CHANCE_MARGIN * self.chance or loss >= UNTRAINED_LOSS_MARGIN * self.untrained_loss:
            what = (f"not learning: after epoch {epoch} ({self.steps} steps) the validation accuracy is "
                    f"{accuracy:.4f} and the loss {loss:.4f}, against {self.chance:.2f} and "
                    f"{self.untrained_loss:.2f} for guessing")
            raise self.diverged(what, exploded=False)

    def diverged(self, what, exploded=True):
        lr = self.cfg.lr
        advice = (f"Start again with a lower --lr (now {lr:g}) and --resume never" if exploded else
                  f"Check --lr (now {lr:g}: lower if the loss exploded before, higher if it barely moved), "
                  "then start again with --resume never; --divergence-check off trains on regardless")
        return Diverged(f"{what}. {advice}")


# --- The tracking: rank 0 journals the run, and a sender carries the journal to MLflow


def start_tracking(job, resumed, splits, sources):
    """Rank 0 journals the run's start (settings, system tags, datasets) and, online, creates or continues the
    run before training: a refused start is bad input on every rank. Further nodes watch their own system."""
    cfg, collective = job.cfg, job.collective
    # In system metrics' names; run.sh exports NODE_RANK.
    node = f"node{os.environ.get('NODE_RANK', '0')}"
    tracker = tracking.NullTracker()
    if cfg.tracking == "off":
        return tracker
    create_run = None
    if collective.is_main:
        tracker = tracking.Tracker(cfg.output_dir, cfg.tracking == "on", node, cfg.tracking_wait)
        params = {**dataclasses.asdict(cfg), **job.resolved, "onednn_isa_cap": job.cpu["onednn_isa_cap"],
                  "cpu_model": job.cpu["model"], "global_batch_size": cfg.batch_size * collective.world_size,
                  "mindspore_version": ms.__version__, "job_version": common.JOB_VERSION}
        tags = {"device": job.device, "world_size": str(collective.world_size),
                "job_version": common.JOB_VERSION}
        # An image has no .git for MLflow's git context to read: its build says which commit it is.
        if os.environ.get("GIT_COMMIT"):
            tags["mlflow.source.git.commit"] = os.environ["GIT_COMMIT"]
        run = tracking.Run(cfg.experiment, cfg.run_name, params, tags,
                           tracking.dataset_entities(splits, job.checksums, sources), resumed is not None)
        create_run = functools.partial(tracker.start, run)
    collective.wait_for(create_run)
    if cfg.tracking == "on" and collective.world_size > job.local_workers:
        run_id = collective.broadcast_text(tracker.run_id or "")
        watches = run_id and collective.is_local_main and not collective.is_main
        # Awaited: its import of MLflow takes seconds, and a collective fails a rank MS_NODE_TIMEOUT late.
        collective.wait_for(functools.partial(tracking.watch_node, run_id, node) if watches else None)
    return tracker


# --- The end: the results, or an early stop


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
        # The others wait for rank 0's tracking.
        collective.wait_for(finish if collective.is_main else None)
    except common.DiskFull as full:
        # Its message says that the next start resumes.
        return stop_early(training, full)
    except common.UsageError:
        # Rank 0 failed to finish; its own exit says why.
        pass
    return 128 + exc.signum if stopped else common.EXIT_DIVERGED


def report(training, splits):
    """The results, measured on every rank (gathers) and written by rank 0; exit 1 if the replicas differ."""
    job, cfg, collective, history = training.job, training.cfg, training.collective, training.history
    # The last validation's figures are the model's: nothing trains after it.
    confusion = training.confusion
    if confusion is None:
        # It all trained before this run, maybe more epochs than asked: measure it again.
        confusion = training.model.eval(training.eval_set, dataset_sink_mode=False)["test"]["confusion"]
    identical, fingerprints = distributed.replicas_identical(collective, training.net)
    peak_rss_mb = collective.all_gather(np.float64(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    # Rank 0 reports a difference: an early exit here would end it before it writes the results.
    if not collective.is_main:
        return 0

    if len(history) > cfg.epochs:
        log.warning("the output directory holds a model of %d epochs, more than --epochs %d: it is what this "
                    "job reports and writes", len(history), cfg.epochs)
    precision = outputs.mixed_precision(training.model.train_network, training.net,
                                        model.build_network(len(data.CLASS_NAMES)),
                                        Tensor(data.to_model_input(splits.test.images[:8])))
    saver, train_s = training.checkpoints, sum(epoch["train_s"] for epoch in history)
    resumed_at = checkpoints.Position.after(training.resumed_steps, training.steps_per_epoch)
    summary = {
        "device": job.device, "world_size": collective.world_size, "amp_level": job.amp_level,
        "loss_scaling": job.loss_scaling, **precision, "cpu": job.cpu,
        "epochs": len(history), "global_batch_size": training.global_batch,
        "test_accuracy": history[-1]["val_accuracy"], "test_loss": history[-1]["val_loss"],
        "test_samples": int(confusion.sum()),
        "train_samples_per_s": sum(e["train_samples_per_s"] * e["train_s"] for e in history) / train_s,
        "first_step_s": training.first_step_s, "first_step_at": training.first_step_at,
        "startup_phases_s": training.startup.phases, "wall_s": time.perf_counter() - training.startup.started,
        "replicas_identical": identical, "mlflow_run_id": training.tracker.run_id,
        "skipped_steps": training.skipped_steps,
        "resumed_from_epoch": resumed_at.epoch, "resumed_from_step": resumed_at.step,
        "restarts": saver.restarts, "weights_sha256": fingerprints[0].tobytes().hex(),
        "checkpoint_save_ms": 1000 * float(np.mean(saver.save_s)) if saver.save_s else None,
        "peak_rss_mb_per_rank": peak_rss_mb.round(1).tolist(), "epoch_history": history,
    }
    results = outputs.Results(summary, training.loss_points, confusion)
    outputs.write_all(cfg, training.net, splits, results, training.tracker)
    final = {key: summary[key] for key in ("wall_s", "test_accuracy", "test_loss")}
    training.tracker.log_metrics(final, step=len(history))
    training.tracker.finish("FINISHED" if identical else "FAILED")
    log.info("test accuracy %.4f, test loss %.4f, %s samples/s, wall %.1f s -> %s", summary["test_accuracy"],
             summary["test_loss"], f"{summary['train_samples_per_s']:,.0f}", summary["wall_s"],
             cfg.output_dir / "summary.json")
    if not identical:
        log.error("replicas diverged: weight fingerprints differ across ranks %s", fingerprints.tolist())
        return 1
    return 0


# --- The pipeline


def main(argv=None) -> int:
    # MindSpore collects garbage before each graph compile: objects frozen here, the imports', are never
    # scanned again, which saves seconds of a short job (docs/performance.md).
    gc.freeze()
    startup = Startup()
    try:
        job = join_job(settings.parse_config(argv))
    except common.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    startup.lap("join")
    try:
        job, splits, sources = get_data(job)
        if job.cfg.predict:
            evaluation = distributed.Evaluation(job.collective, len(data.CLASS_NAMES))
            eval_set = eval_dataset(splits.test, job.cfg.batch_size, job.collective)
            return serving.predict(job.cfg.predict, eval_set, evaluation, job.collective.is_main)
        training = Training(job, splits, startup)
        startup.lap("setup")
        training.resume()
        startup.lap("checkpoint")
        training.compile()
        startup.lap("compile")
        training.tracker = start_tracking(job, training.resumed, splits, sources)
        # MLflow's imports are frozen too.
        gc.freeze()
        startup.lap("tracking")
    except (common.UsageError, common.DiskFull) as exc:
        log.error("%s", exc)
        return exc.status
    # SIGTERM becomes a request the ranks agree on, and one more while they stop is moot.
    with training.stop:
        try:
            training.fit()
            return report(training, splits)
        except (Diverged, distributed.Terminated, common.DiskFull) as exc:
            return stop_early(training, exc)


if __name__ == "__main__":
    sys.exit(main())
