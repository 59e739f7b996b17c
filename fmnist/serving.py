"""The trained model outside training: exported as MindIR, evaluated by --predict, and served by
`mlflow models serve` as a pyfunc model whose loader is this module."""

import os
import threading
from pathlib import Path

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn

from . import common, data, distributed, metrics, model


def export_mindir(net, path):
    """The model for inference as MindIR, for any batch size, written whole or not at all.

    MindSpore's exporter refuses a file name with any character outside [0-9a-zA-Z@_-.:/\\], such as a space
    or an accent in a directory's name; it writes here through the open directory's name under /proc/self/fd,
    which has none of those, whatever the directory is called.
    """
    any_batch = Tensor(shape=[None, 1, data.IMAGE_SIZE, data.IMAGE_SIZE], dtype=ms.float32)
    with common.atomic_path(path, suffix=".mindir") as tmp:
        directory = os.open(tmp.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ms.export(net, any_batch, file_name=f"/proc/self/fd/{directory}/{tmp.name}", file_format="MINDIR")
        finally:
            os.close(directory)


def load_model(path):
    """A saved model as a cell: an exported MindIR, or a checkpoint of model.build_network()'s weights.
    UsageError when the file is missing or is neither."""
    path = Path(path)
    if not path.is_file():
        raise common.UsageError(f"--predict {path}: no such file; give a model.ckpt or model.mindir from a "
                                "finished job")
    try:
        if path.suffix == ".mindir":
            return nn.GraphCell(ms.load(str(path)))
        net = model.build_network(len(data.CLASS_NAMES))
        missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(str(path), crc_check=True))
        if missing:
            raise ValueError(f"it has no {', '.join(missing)}")
        return net
    except (ValueError, RuntimeError) as exc:
        raise common.UsageError(f"--predict {path}: cannot load it ({str(exc).splitlines()[0]})") from None


def predict(path, test_ds, evaluation, is_main):
    """--predict: a saved model's figures on the test set (each rank its slice), printed by rank 0; exit 0."""
    net = load_model(path)
    for images, labels in test_ds.create_tuple_iterator(num_epochs=1):
        evaluation.update(net(images), labels)
    results = evaluation.eval()
    if is_main:
        print(f"{path}: test accuracy {results['accuracy']:.4f}, test loss {results['loss']:.4f} "
              f"on {int(results['confusion'].sum())} images")
    return 0


def prediction_frame(logits):
    """Per image: the class index, the class name and the probabilities of every class."""
    import pandas as pd  # pylint: disable=import-outside-toplevel
    probabilities = np.exp(metrics.log_softmax(logits))
    classes = probabilities.argmax(axis=1)
    return pd.DataFrame({"class_index": classes.astype(np.int64),
                         "class_name": [data.CLASS_NAMES[c] for c in classes],
                         "probabilities": [row.tolist() for row in probabilities]})


# MindSpore's graph executor, one per process behind every cell, is not safe to enter from two threads: two
# calls at once crash the process (SIGSEGV) or hang it, whether they share one cell or each have their own.
# `mlflow models serve` answers requests on a pool of threads, so the network runs one batch at a time; the
# checks and the answer around it do not wait (docs/performance.md has what that costs).
_GRAPH_EXECUTOR = threading.Lock()


def pixels(batch):
    """The served model's input contract: a batch [N, 28, 28] of whole numbers from 0 to 255, as the IDX files
    hold them. Returns it as uint8; ValueError naming what is wrong (MLflow answers it with 400)."""
    values = np.asarray(batch)
    expected = (data.IMAGE_SIZE, data.IMAGE_SIZE)
    if values.dtype.kind not in "biuf":
        raise ValueError(f"pixel values must be numbers; got values of type {values.dtype}")
    if values.ndim != 3 or values.shape[1:] != expected:
        raise ValueError(f"expected a batch of {expected[0]}x{expected[1]} images, shape [N, {expected[0]}, "
                         f"{expected[1]}]; got shape {list(values.shape)}")
    if values.shape[0] == 0:
        raise ValueError("the batch is empty: send at least one image")
    if not np.isfinite(values).all():
        raise ValueError("pixel values must be finite numbers from 0 to 255")
    fractional = values[values != np.round(values)]
    if fractional.size:
        raise ValueError(f"pixel values must be whole numbers from 0 to 255, as in the IDX files; got "
                         f"{fractional.flat[0]:g} (normalized values are not accepted: send the raw pixels)")
    if values.min() < 0 or values.max() > 255:
        bad = values[(values < 0) | (values > 255)].flat[0]
        raise ValueError(f"pixel values must be from 0 to 255; got {bad:g}")
    return values.astype(np.uint8)


class ServedModel:
    """The exported model as `mlflow models serve` runs it. In: pixels(). Out: prediction_frame(). The
    preprocessing is the training's own (data.to_model_input)."""

    def __init__(self, mindir):
        self.net = nn.GraphCell(ms.load(str(mindir)))
        self._logits(np.zeros((1, data.IMAGE_SIZE, data.IMAGE_SIZE), np.uint8))  # compiled now, not by a request

    def predict(self, model_input, params=None):  # pylint: disable=unused-argument
        from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
        try:
            images = pixels(model_input)
        except ValueError as exc:
            raise MlflowException.invalid_parameter_value(str(exc)) from None
        return prediction_frame(self._logits(images))

    def _logits(self, images):
        features = Tensor(data.to_model_input(images))
        with _GRAPH_EXECUTOR:
            return self.net(features).asnumpy()


def _load_pyfunc(path):
    """MLflow's entry point for this module as a pyfunc loader_module: the model from its MindIR at `path`."""
    distributed.cap_onednn_isa()  # in the serving process as in training, before its first CPU kernel
    return ServedModel(path)
