"""Data-parallel LeNet on Fashion-MNIST with MindSpore, launched by msrun and tracked in MLflow: `python main.py`
alone, `msrun --worker_num=2 --local_worker_num=2 --join=True python main.py`, or ./run.sh. The same file runs on
Ascend NPUs (HCCL) and on CPU (MindSpore's own collective); every setting is a flag and a variable (--help).
main() is the pipeline, one function per stage, over fmnist/."""

import dataclasses
import functools
import gc
import json
import os
import resource
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn
from mindspore.train import Model

from fmnist import checkpoints, common, data, distributed, model, monitor, outputs, serving, settings, tracking
from fmnist.common import log


@dataclasses.dataclass(frozen=True)
class Job:
    """The settings, what this worker resolved from them, and its place in the msrun job."""

    cfg: settings.Config
    checksums: dict
    device: str
    amp_level: str
    loss_scaling: str
    cpu: dict  # the CPU's model, its ISA flags, oneDNN's cap on them (x86-64) and this worker's threads
    collective: distributed.Collective
    local_workers: int

    @property
    def resolved(self):  # what the run records beside the settings, and a resume must match
        return {"device": self.device, "world_size": self.collective.world_size, "amp_level": self.amp_level,
                "loss_scaling": self.loss_scaling}


def main(argv=None) -> int:
    # MindSpore collects garbage before each graph compile: objects frozen here, the imports', are never scanned
    # again, which saves seconds of a short job (docs/performance.md).
    gc.freeze()
    laps = monitor.Laps()  # the phases before the first step
    try:
        cfg = settings.parse_config(argv)
        job = join_job(cfg)  # msrun's scheduler process stays in there until the job ends
    except common.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    laps("join")
    collective = job.collective
    try:
        if collective.is_main:  # held until this process ends, however it ends: the kernel drops it then
            lock = common.hold_lock(cfg.output_dir / ".lock", f"--output-dir {cfg.output_dir}")  # noqa: F841
        job, splits, sources = get_data(job)
        cfg = job.cfg  # its batch size fitted to the data, if the default was too big for it
        shards, test_ds = data.shard(splits, cfg.batch_size, collective.rank, collective.world_size, cfg.seed)
        evaluation = monitor.Evaluation(collective, len(data.CLASS_NAMES))
        if cfg.predict:
            return serving.predict(cfg.predict, test_ds, evaluation, collective.is_main)
        net, trainer = build_model(job, evaluation)
        laps("setup")
        resumed, current, start = resume(job, trainer)
        laps("checkpoint")
        compile_step(trainer, shards)
        laps("compile")
        tracker = start_tracking(job, resumed, splits, sources)
        gc.freeze()  # MLflow's import too
        laps("tracking")
    except (common.UsageError, common.DiskFull) as exc:
        log.error("%s", exc)
        return exc.status
    progress = monitor.Progress.resumed_from(resumed, shards.steps_per_epoch)
    training = monitor.TrainingMonitor(cfg, collective, tracker, progress, laps, len(data.CLASS_NAMES))
    saver = checkpoints.CheckpointSaver(cfg.output_dir / "checkpoints", cfg.keep_checkpoints, cfg.checkpoint_steps,
                                        progress, tracker, current, resumed) if collective.is_main else None
    with training.stop:  # SIGTERM becomes a request the ranks agree on, and one more while they stop is moot
        try:
            train(job, trainer, shards, test_ds, [c for c in (training, saver) if c], start)
            return report(job, net, trainer, test_ds, splits, progress, tracker, saver, laps, start)
        except (monitor.Diverged, distributed.Terminated, common.DiskFull) as exc:
            return stop_early(job, exc, trainer, progress, saver, tracker)


def join_job(cfg):
    """Graph mode on the device, init() of the msrun job, identical seeds, and this worker's share of the CPU."""
    device_name = distributed.resolve_device(cfg.device)
    amp_level, loss_scaling = settings.resolve_precision(cfg.amp, cfg.loss_scale, device_name)
    isa_cap = distributed.cap_onednn_isa() if device_name == "CPU" else None
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device_name)
    rank, local_rank, world_size = distributed.init_distributed()
    common.configure_logging(rank)
    local_workers = int(os.environ.get("LOCAL_WORKERS") or world_size)
    threads = distributed.set_up_worker(device_name, local_rank, local_workers, cfg.cpu_bind == "on", cfg.threads)
    ms.set_seed(cfg.seed)  # identical initial weights on every replica: MindSpore does not broadcast them
    cpu = {**distributed.cpu_description(), "onednn_isa_cap": isa_cap, "threads_per_worker": threads}
    job = Job(cfg, data.load_checksums(cfg.checksums_file), device_name, amp_level, loss_scaling, cpu,
              distributed.Collective(rank, local_rank, world_size), local_workers)
    # Every rank says who it is: run.sh finds a failed worker's log by the pid msrun reports.
    log.info("rank %d of %d (pid %d), device %s, amp %s, loss scale %s, %d threads on cores %s, oneDNN ISA cap %s, "
             "settings %s", rank, world_size, os.getpid(), device_name, amp_level, loss_scaling, threads,
             sorted(os.sched_getaffinity(0)), isa_cap, json.dumps(dataclasses.asdict(cfg), default=str))
    return job


def get_data(job):
    """The splits on every rank, fetched by one worker per node (nodes need not share a file system), where each
    file came from, and the job with the settings checked against the data (a default fitted to it)."""
    cfg, collective = job.cfg, job.collective
    fetch_here = collective.is_local_main and (lambda: data.make_available(cfg, job.checksums, say=log.info))
    sources = collective.wait_for(fetch_here or None) or {}
    splits = data.load_splits(cfg.data_dir)
    cfg = settings.check_against_data(cfg, collective.world_size, len(splits.train.labels), len(splits.test.labels))
    return dataclasses.replace(job, cfg=cfg), splits, sources


def build_model(job, evaluation):
    """The network, its loss, the optimizer and mixed precision as one Model (gradients averaged across ranks)."""
    cfg, fixed = job.cfg, job.loss_scaling.startswith("fixed:")
    scale = float(job.loss_scaling.partition(":")[2]) if fixed else 1.0
    net = model.build_network(len(data.CLASS_NAMES))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")
    # A fixed scale without overflow checks leaves the gradients scaled: the optimizer divides them back.
    common_args = {"learning_rate": cfg.lr, "weight_decay": cfg.weight_decay, "loss_scale": scale}
    momentum = cfg.momentum if cfg.optimizer == "momentum" else 0.0
    optimizer = (nn.Adam(net.trainable_params(), **common_args) if cfg.optimizer == "adam"
                 else nn.SGD(net.trainable_params(), momentum=momentum, **common_args))
    # drop_overflow_update=False is the only fixed scaling MindSpore runs on CPU, and needs no overflow check.
    manager = (ms.amp.DynamicLossScaleManager() if job.loss_scaling == "dynamic" else
               ms.amp.FixedLossScaleManager(scale, drop_overflow_update=False) if fixed else None)
    return net, Model(net, loss_fn, optimizer, amp_level=job.amp_level, metrics={"test": evaluation},
                      loss_scale_manager=manager)


def resume(job, trainer):
    """The newest good checkpoint of this training loaded (or None), its trajectory, and where every rank starts."""
    directory = job.cfg.output_dir / "checkpoints"
    current = checkpoints.trajectory(job.cfg, {**job.resolved, "data_sha256": job.checksums}, trainer.train_network)
    resumed = (checkpoints.load_latest_checkpoint(directory, trainer.train_network, current)
               if job.cfg.resume == "auto" else None)
    return resumed, current, checkpoints.agree_on_resume(job.collective, resumed, directory, job.cfg.epochs)


def compile_step(trainer, shards):
    """The training step compiled before Model.fit, which reuses the graph, so that its cost shows apart."""
    trainer.train_network.set_train()
    trainer.train_network.compile(Tensor(shards.images[:shards.batch_size]), Tensor(shards.labels[:shards.batch_size]))


def train(job, trainer, shards, test_ds, callbacks, start):
    """Model.fit from `start`, validating after each epoch: the rest of an interrupted epoch as a fit of its own
    (MindSpore fixes a dataset's length for all its epochs), then the whole epochs left."""
    fit = {"valid_dataset": test_ds, "valid_frequency": 1, "callbacks": callbacks, "dataset_sink_mode": False}
    epoch = start.epoch
    if start.step and epoch < job.cfg.epochs:
        trainer.fit(epoch + 1, data.train_dataset(shards, epoch, skip=start.step), initial_epoch=epoch, **fit)
        epoch += 1
    if epoch < job.cfg.epochs:
        trainer.fit(job.cfg.epochs, data.train_dataset(shards, epoch), initial_epoch=epoch, **fit)


def start_tracking(job, resumed, splits, sources):
    """Rank 0 journals the run's start (settings, system tags, datasets) and, online, creates or continues the
    run before training: a refused start is bad input on every rank. Further nodes watch their own system."""
    cfg, collective = job.cfg, job.collective
    node = f"node{os.environ.get('NODE_RANK', '0')}"  # in system metrics' names (run.sh exports NODE_RANK)
    tracker = tracking.NullTracker()
    if cfg.tracking == "off":
        return tracker
    if collective.is_main:
        tracker = tracking.Tracker(cfg.output_dir, cfg.tracking == "on", node, cfg.tracking_wait)
        params = {**dataclasses.asdict(cfg), **job.resolved, "onednn_isa_cap": job.cpu["onednn_isa_cap"],
                  "cpu_model": job.cpu["model"], "global_batch_size": cfg.batch_size * collective.world_size,
                  "mindspore_version": ms.__version__, "job_version": common.JOB_VERSION}
        tags = {"device": job.device, "world_size": str(collective.world_size), "job_version": common.JOB_VERSION}
        if os.environ.get("GIT_COMMIT"):  # an image has no .git for MLflow's git context to read; its build says
            tags["mlflow.source.git.commit"] = os.environ["GIT_COMMIT"]

        def start():  # a refusal is a UsageError
            tracker.start(cfg.experiment, cfg.run_name, params, tags,
                          tracking.dataset_entities(splits, job.checksums, sources), continues=resumed is not None)
    collective.wait_for(start if collective.is_main else None)
    if cfg.tracking == "on" and collective.world_size > job.local_workers:
        run_id = collective.broadcast_text(tracker.run_id or "")
        watches = run_id and collective.is_local_main and not collective.is_main
        # Awaited: its import of MLflow takes seconds, and a collective fails a rank MS_NODE_TIMEOUT late.
        collective.wait_for(functools.partial(tracking.watch_node, run_id, node) if watches else None)
    return tracker


def stop_early(job, exc, trainer, progress, saver, tracker):
    """The job ends without results. Divergence (exit 3) and a signal (128 + it) stop every rank at the same
    step, which rank 0 checkpoints on a signal; a full disk (exit 4) is rank 0's, the one writer's, alone."""
    stopped, is_main = isinstance(exc, distributed.Terminated), job.collective.is_main
    finish = functools.partial(tracker.finish, "KILLED" if stopped else "FAILED", timeout=tracking.STOP_TIMEOUT_S)
    if isinstance(exc, common.DiskFull):
        log.error("%s", exc)
        finish()
        return exc.status
    try:
        if not is_main:  # rank 0 says why; the others say where they stopped
            log.info("rank %d stops with the others: %s", job.collective.rank, exc)
        elif stopped:  # here, not in wait_for's thread: MindSpore is not thread-safe
            saver.save(trainer.train_network, progress.position)
            log.warning("%s; checkpoint %s written, the next start resumes from it", exc,
                        checkpoints.checkpoint_path(saver.directory, progress.position))
        else:
            log.error("training diverged: %s; no final model was written, the checkpoints of the good epochs stay "
                      "in %s", exc, saver.directory)
        job.collective.wait_for(finish if is_main else None)  # the others wait for rank 0's tracking
    except common.DiskFull as full:  # its message says that the next start resumes
        return stop_early(job, full, trainer, progress, saver, tracker)
    except common.UsageError:
        pass  # rank 0 failed to finish; its own exit says why
    return 128 + exc.signum if stopped else common.EXIT_DIVERGED


def report(job, net, trainer, test_ds, splits, progress, tracker, saver, laps, start):
    """The results, measured on every rank (gathers) and written by rank 0; exit 1 if the replicas differ."""
    cfg, collective = job.cfg, job.collective
    history = progress.history  # its last epoch's validation is the model's: nothing trains after it
    if progress.confusion is None:  # all trained before this run, maybe more epochs than asked: measure it again
        progress.confusion = trainer.eval(test_ds, dataset_sink_mode=False)["test"]["confusion"]
    identical, fingerprints = distributed.replicas_identical(collective, net)
    peak_rss_mb = collective.all_gather(np.float64(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    if not collective.is_main:
        return 0  # rank 0 reports a difference: an early exit here would end it before it writes the results

    if len(history) > cfg.epochs:
        log.warning("the output directory holds a model of %d epochs, more than --epochs %d: it is what this job "
                    "reports and writes", len(history), cfg.epochs)
    precision = monitor.mixed_precision(trainer.train_network, net, model.build_network(len(data.CLASS_NAMES)),
                                        Tensor(data.to_model_input(splits.test.images[:8])))
    train_s = sum(e["train_s"] for e in history)
    summary = {
        "device": job.device, "world_size": collective.world_size, "amp_level": job.amp_level,
        "loss_scaling": job.loss_scaling, **precision, "cpu": job.cpu,
        "epochs": len(history), "global_batch_size": cfg.batch_size * collective.world_size,
        "test_accuracy": history[-1]["val_accuracy"], "test_loss": history[-1]["val_loss"],
        "test_samples": int(progress.confusion.sum()),
        "train_samples_per_s": sum(e["train_samples_per_s"] * e["train_s"] for e in history) / train_s,
        "first_step_s": progress.first_step_s, "first_step_at": progress.first_step_at,
        "startup_phases_s": laps.laps, "wall_s": time.perf_counter() - laps.started, "replicas_identical": identical,
        "mlflow_run_id": tracker.run_id, "skipped_steps": progress.skipped_steps,
        "resumed_from_epoch": start.epoch, "resumed_from_step": start.step,
        "restarts": saver.restarts, "weights_sha256": fingerprints[0].tobytes().hex(),
        "checkpoint_save_ms": 1000 * float(np.mean(saver.save_s)) if saver.save_s else None,
        "peak_rss_mb_per_rank": peak_rss_mb.round(1).tolist(), "epoch_history": history,
    }
    outputs.write_all(cfg.output_dir, net, splits, progress, summary, cfg.seed, tracker, cfg.register_model)
    tracker.log_metrics({key: summary[key] for key in ("wall_s", "test_accuracy", "test_loss")}, step=len(history))
    tracker.finish("FINISHED" if identical else "FAILED")
    log.info("test accuracy %.4f, test loss %.4f, %s samples/s, wall %.1f s -> %s", summary["test_accuracy"],
             summary["test_loss"], f"{summary['train_samples_per_s']:,.0f}", summary["wall_s"],
             cfg.output_dir / "summary.json")
    if not identical:
        log.error("replicas diverged: weight fingerprints differ across ranks %s", fingerprints.tolist())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
