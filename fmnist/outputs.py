"""The results, measured on every rank and written by rank 0, each file whole and logged to the run: the model
(checkpoint, MindIR, MLflow model), summary.json and the PNGs. matplotlib is imported late: rank 0 draws."""

import dataclasses
import io
import json
import resource
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn

from . import checkpoints, common, data, distributed, model, serving
from .common import log


def report(training, splits):
    """A main.Training's results, measured on every rank, written by rank 0; exit 1 if the replicas differ."""
    job, cfg, history, saver = training.job, training.cfg, training.history, training.checkpoints
    # The last validation's confusion is the model's; a job that had nothing left to train measures it again.
    confusion = training.confusion
    if confusion is None:
        confusion = training.model.eval(training.eval_set, dataset_sink_mode=False)["test"]["confusion"]
    identical, fingerprints = distributed.replicas_identical(training.collective, training.net)
    peak_rss_kb = np.float64(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    peak_rss_mb = training.collective.all_gather(peak_rss_kb) / 1024
    # Rank 0 reports a difference: an early exit here would end it before it writes the results.
    if not training.collective.is_main:
        return 0
    if len(history) > cfg.epochs:
        log.warning("the output directory holds a model of %d epochs, more than --epochs %d: it is what this "
                    "job reports and writes", len(history), cfg.epochs)
    # The MLflow model's input example, what the network predicts for it, and what amp did to it.
    example = splits.test.images[:4]
    logits, precision = probe(training.model.train_network, training.net, example)
    resumed_at = checkpoints.Position.after(training.resumed_steps, training.steps_per_epoch)
    summary = {
        **job.resolved, **precision, "cpu": job.cpu,
        "epochs": len(history), "global_batch_size": training.global_batch,
        "test_accuracy": history[-1]["val_accuracy"], "test_loss": history[-1]["val_loss"],
        "test_samples": int(confusion.sum()),
        "train_samples_per_s": (sum(e["train_samples_per_s"] * e["train_s"] for e in history)
                                / sum(e["train_s"] for e in history)),
        "first_step_s": training.first_step_s, "first_step_at": training.first_step_at,
        "startup_phases_s": training.startup.phases, "wall_s": time.perf_counter() - training.startup.started,
        "replicas_identical": identical, "mlflow_run_id": training.tracker.run_id,
        "skipped_steps": training.skipped_steps,
        "resumed_from_epoch": resumed_at.epoch, "resumed_from_step": resumed_at.step,
        "restarts": saver.restarts, "parts": [dataclasses.asdict(part) for part in training.parts],
        "weights_sha256": fingerprints[0].tobytes().hex(),
        "checkpoint_save_ms": 1000 * float(np.mean(saver.save_s)) if saver.save_s else None,
        "peak_rss_mb_per_rank": peak_rss_mb.round(1).tolist(), "epoch_history": history,
    }
    write_all(training, splits, summary, confusion)
    tracker = training.tracker
    tracker.log_model(cfg.output_dir / "model.mindir", example, serving.prediction_frame(logits),
                      cfg.register_model, summary["test_accuracy"])
    tracker.log_metrics({key: summary[key] for key in ("wall_s", "test_accuracy", "test_loss")},
                        step=len(history))
    tracker.finish("FINISHED" if identical else "FAILED")
    log.info("test accuracy %.4f, test loss %.4f, %s samples/s, wall %.1f s -> %s", summary["test_accuracy"],
             summary["test_loss"], f"{summary['train_samples_per_s']:,.0f}", summary["wall_s"],
             cfg.output_dir / "summary.json")
    if not identical:
        log.error("replicas diverged: weight fingerprints differ across ranks %s", fingerprints.tolist())
        return 1
    return 0


def write_all(training, splits, summary, confusion):
    """Every output into the output dir, each logged to the run as it is written."""
    net, cfg = training.net, training.cfg
    writers = {
        "samples.png": lambda path: draw(sample_grid, path, splits.train, cfg.seed),
        "model.ckpt": lambda path: checkpoints.save_checkpoint(net, path),
        "model.mindir": lambda path: serving.export_mindir(net, path),
        "training_curves.png": lambda path: draw(curves, path, training.loss_points, training.history),
        "confusion_matrix.png": lambda path: draw(confusion_matrix, path, confusion),
        "summary.json": lambda path: common.write_atomic(path, f"{json.dumps(summary, indent=2)}\n".encode()),
    }
    for name, write in writers.items():
        write(cfg.output_dir / name)
        training.tracker.log_artifact(cfg.output_dir / name)


class Probe(nn.Cell):
    """The trained network, the network as amp rebuilt it for the train step, a float32 copy and the first
    layer, on one batch: one graph to compile at the job's end instead of four."""

    def __init__(self, net, amp_forward, float32_net):
        # Without a prefix: the cells' parameters keep their names, which the checkpoint saved next holds.
        super().__init__(auto_prefix=False)
        self.net, self.amp_forward, self.float32_net = net, amp_forward, float32_net
        self.first = next(iter(net.cells()))

    def construct(self, images):
        return self.net(images), self.amp_forward(images), self.float32_net(images), self.first(images)


def probe(train_step, net, images):
    """The network's logits for `images`, and what amp and loss scaling do in the train step MindSpore
    built: features_dtype, the dtype the first layers compute in (float16 under O2 and O3); amp_logit_error,
    the largest change of its logits from a float32 copy's; step_loss_scale, its backward pass's factor."""
    float32_net = model.build_network(len(data.CLASS_NAMES))
    ms.load_param_into_net(float32_net, net.parameters_dict())
    # train_step.network._backbone is the network as amp rebuilt it.
    logits, amp_logits, float32_logits, features = Probe(net, train_step.network._backbone, float32_net)(
        Tensor(data.to_model_input(images)))
    scale = train_step.scale_sense.asnumpy() if hasattr(train_step, "scale_sense") else train_step.sens
    logit_error = np.abs(amp_logits.asnumpy() - float32_logits.asnumpy()).max()
    return logits.asnumpy(), {"features_dtype": str(features.dtype), "amp_logit_error": float(logit_error),
                              "step_loss_scale": float(scale)}


def draw(picture, path, *args):
    """`picture(plt, *args)` drawn on matplotlib's file-only backend, written whole to `path` as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = picture(plt, *args)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    common.write_atomic(path, buffer.getvalue())


def sample_grid(plt, split, seed, count=10):
    """Random images of a data.Split with their class names, in two rows."""
    fig, axes = plt.subplots(2, count // 2, figsize=(8, 3.8))
    shown = np.random.default_rng(seed).choice(len(split.images), count, replace=False)
    for ax, index in zip(axes.flat, shown, strict=True):
        ax.imshow(split.images[index], cmap="gray", vmin=0, vmax=255)
        ax.set_title(data.CLASS_NAMES[split.labels[index]], fontsize=9)
        ax.axis("off")
    fig.tight_layout(pad=0.3)
    return fig


def curves(plt, loss_points, epoch_history):
    """The training loss (per log interval) and the validation loss and accuracy (per epoch)."""
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9, 3.4), layout="tight")
    epochs = [e["epoch"] for e in epoch_history]
    loss_ax.plot(*zip(*loss_points, strict=True), label="training (rank mean)", color="tab:blue", alpha=0.8)
    loss_ax.plot(epochs, [e["val_loss"] for e in epoch_history], "o-", label="test set", color="tab:orange")
    loss_ax.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    loss_ax.legend()
    acc_ax.plot(epochs, [e["val_accuracy"] for e in epoch_history], "o-", color="tab:green")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="Test-set accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    return fig


def confusion_matrix(plt, matrix):
    """The test-set confusion matrix with its counts, rows the true class."""
    fig, ax = plt.subplots(figsize=(7, 6), layout="tight")
    ax.imshow(matrix, cmap="Blues")
    for (row, col), count in np.ndenumerate(matrix):
        ax.text(col, row, str(count), ha="center", va="center", fontsize=7,
                color="white" if count > matrix.max() / 2 else "black")
    ticks = range(len(data.CLASS_NAMES))
    ax.set_xticks(ticks, data.CLASS_NAMES, rotation=45, ha="right")
    ax.set_yticks(ticks, data.CLASS_NAMES)
    ax.set(xlabel="predicted", ylabel="true",
           title=f"Test set: {matrix.sum()} images, accuracy {np.trace(matrix) / max(matrix.sum(), 1):.4f}")
    return fig
