"""The job's outputs, each written whole and logged to the run: the model as a checkpoint, as MindIR and as an
MLflow model, summary.json, and the PNGs (a grid of training samples, the training curves, the confusion
matrix). matplotlib is imported late: only rank 0 draws."""

import io
import math

import numpy as np

from mindspore import Tensor

from . import checkpoints, common, data, serving


def write_all(output_dir, net, splits, progress, summary, seed, tracker, register_as):
    """Every output into `output_dir`, each logged to the run as it is written; then the MLflow model."""
    history = summary["epoch_history"]
    writers = {"samples.png": lambda path: save_sample_grid(splits.train, path, seed),
               "model.ckpt": lambda path: checkpoints.save_checkpoint(net, path),
               "model.mindir": lambda path: serving.export_mindir(net, path),
               "training_curves.png": lambda path: save_training_curves(progress.loss_points, history, path),
               "confusion_matrix.png": lambda path: save_confusion_matrix(progress.confusion, path),
               "summary.json": lambda path: common.write_json(path, summary)}
    for name, write in writers.items():
        write(output_dir / name)
        tracker.log_artifact(output_dir / name)
    example = splits.test.images[:4]  # the MLflow model's input example
    tracker.log_model(output_dir / "model.mindir", example,
                      serving.prediction_frame(net(Tensor(data.to_model_input(example))).asnumpy()),
                      register_as, summary["test_accuracy"])


def save_sample_grid(split, path, seed, count=10):
    """PNG of `count` random images of a data.Split with their class names."""
    images, labels, plt = split.images, split.labels, pyplot()
    picks = np.random.default_rng(seed).choice(len(images), size=count, replace=False)
    cols = 5
    fig, axes = plt.subplots(math.ceil(count / cols), cols, figsize=(cols * 1.6, 1.9 * math.ceil(count / cols)))
    for ax, index in zip(axes.flat, picks):
        ax.imshow(images[index], cmap="gray", vmin=0, vmax=255)
        ax.set_title(data.CLASS_NAMES[labels[index]], fontsize=9)
    for ax in axes.flat:
        ax.axis("off")
    fig.tight_layout(pad=0.3)
    write_figure(fig, path)


def pyplot():
    """matplotlib on its file-only backend, imported only when a picture is drawn."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    return plt


def write_figure(fig, path):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    pyplot().close(fig)
    common.write_atomic(path, buffer.getvalue())


def save_training_curves(loss_points, epoch_history, path):
    """PNG of the training loss (per log interval) and the validation loss and accuracy (per epoch)."""
    fig, (loss_ax, acc_ax) = pyplot().subplots(1, 2, figsize=(9, 3.4))
    epochs = [e["epoch"] for e in epoch_history]
    if loss_points:
        loss_ax.plot(*zip(*loss_points), label="training (mean over ranks)", color="tab:blue", alpha=0.8)
    loss_ax.plot(epochs, [e["val_loss"] for e in epoch_history], "o-", label="test set", color="tab:orange")
    loss_ax.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    loss_ax.legend()
    acc_ax.plot(epochs, [e["val_accuracy"] for e in epoch_history], "o-", color="tab:green")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="Test-set accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(fig, path)


def save_confusion_matrix(matrix, path):
    """PNG of the test-set confusion matrix with counts, rows the true class."""
    fig, ax = pyplot().subplots(figsize=(7, 6))
    ax.imshow(matrix, cmap="Blues")
    for (row, col), count in np.ndenumerate(matrix):
        ax.text(col, row, str(count), ha="center", va="center", fontsize=7,
                color="white" if count > matrix.max() / 2 else "black")
    ticks = range(len(data.CLASS_NAMES))
    ax.set_xticks(ticks, data.CLASS_NAMES, rotation=45, ha="right")
    ax.set_yticks(ticks, data.CLASS_NAMES)
    accuracy = np.trace(matrix) / max(matrix.sum(), 1)
    ax.set(xlabel="predicted", ylabel="true", title=f"Test set: {matrix.sum()} images, accuracy {accuracy:.4f}")
    fig.tight_layout()
    write_figure(fig, path)

