"""The trained model outside training: its MindIR, --predict, the pyfunc loader `mlflow models serve` runs."""

import os
import threading

import numpy as np
from scipy.special import softmax

import mindspore as ms
from mindspore import Tensor, nn

from . import common, data, distributed, model


def export_mindir(net, path):
    """The model for inference as MindIR, for any batch size, whole or absent. It is written through the open
    directory's /proc/self/fd name: MindSpore's exporter refuses a space or an accent in a file name."""
    any_batch = Tensor(shape=[None, 1, data.IMAGE_SIZE, data.IMAGE_SIZE], dtype=ms.float32)
    with common.atomic_path(path, suffix=".mindir") as tmp:
        directory = os.open(tmp.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ms.export(net, any_batch, file_name=f"/proc/self/fd/{directory}/{tmp.name}", file_format="MINDIR")
        finally:
            os.close(directory)


def load_model(path):
    """A saved model (MindIR, or a checkpoint of build_network()'s weights) as a cell; else UsageError."""
    try:
        if path.endswith(".mindir"):
            return nn.GraphCell(ms.load(path))
        net = model.build_network(len(data.CLASS_NAMES))
        missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(path, crc_check=True))
        if missing:
            raise ValueError(f"it has no {', '.join(missing)}")
        return net
    except (ValueError, RuntimeError) as exc:
        raise common.UsageError(f"--predict {path}: cannot load it ({common.first_line(exc)})") from None


def predict(path, test_ds, collective):
    """--predict: a saved model's figures on the test set (each rank its slice), printed by rank 0; exit 0."""
    net, evaluation = load_model(path), distributed.Evaluation(collective, len(data.CLASS_NAMES))
    for images, labels in test_ds.create_tuple_iterator(num_epochs=1):
        evaluation.update(net(images), labels)
    results = evaluation.eval()
    if collective.is_main:
        print(f"{path}: test accuracy {results['accuracy']:.4f}, test loss {results['loss']:.4f} "
              f"on {int(results['confusion'].sum())} images")
    return 0


def prediction_frame(logits):
    """Per image: the class index, the class name and the probabilities of every class."""
    import pandas as pd
    probabilities = softmax(np.asarray(logits, dtype=np.float64), axis=1)
    classes = probabilities.argmax(axis=1)
    return pd.DataFrame({"class_index": classes.astype(np.int64),
                         "class_name": [data.CLASS_NAMES[c] for c in classes],
                         "probabilities": [row.tolist() for row in probabilities]})


# MindSpore's graph executor, one per process, crashes or hangs when two threads enter it at once, and
# `mlflow models serve` answers on a pool of threads: the network runs one batch at a time.
_GRAPH_EXECUTOR = threading.Lock()


def pixels(batch):
    """A batch [N, 28, 28] of whole numbers from 0 to 255 (as in the IDX files) as uint8, else ValueError
    (MLflow answers 400); MLflow's schema has checked the shape and that they are numbers."""
    values = np.asarray(batch, dtype=np.float64)
    fractional = values[values != np.round(values)]  # NaN among them
    if fractional.size:
        raise ValueError(f"pixel values must be whole numbers from 0 to 255, as in the IDX files; got "
                         f"{fractional.flat[0]:g} (normalized values are not accepted: send the raw pixels)")
    outside = values[(values < 0) | (values > 255)]  # infinities among them
    if outside.size:
        raise ValueError(f"pixel values must be from 0 to 255; got {outside.flat[0]:g}")
    return values.astype(np.uint8)


class ServedModel:
    """The exported model as `mlflow models serve` runs it: pixels() in, prediction_frame() out."""

    def __init__(self, mindir):
        distributed.cap_onednn_isa()  # in the serving process as in training, before its first CPU kernel
        self.net = nn.GraphCell(ms.load(str(mindir)))
        self._logits(np.zeros((1, data.IMAGE_SIZE, data.IMAGE_SIZE), np.uint8))  # compiled now, not later

    def predict(self, model_input, params=None):
        from mlflow.exceptions import MlflowException
        try:
            images = pixels(model_input)
        except ValueError as exc:
            raise MlflowException.invalid_parameter_value(str(exc)) from None
        return prediction_frame(self._logits(images))

    def _logits(self, images):
        features = Tensor(data.to_model_input(images))
        with _GRAPH_EXECUTOR:
            return self.net(features).asnumpy()


_load_pyfunc = ServedModel  # MLflow's entry point for a pyfunc loader_module, given the MindIR's path
