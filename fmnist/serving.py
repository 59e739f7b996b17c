"""The trained model outside training: exported as MindIR, evaluated by --predict, and served by
`mlflow models serve` as a pyfunc model whose loader is this module."""

import os
from pathlib import Path

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn

from . import common, data, device, metrics, model


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


def predict(path, test_ds, test_metrics, is_main):
    """--predict: evaluate a saved model on the test set (each rank its slice, the metrics gather) instead of
    training; rank 0 prints the figures. Returns the exit status."""
    net = load_model(path)
    for images, labels in test_ds.create_tuple_iterator(num_epochs=1):
        logits = net(images)
        for metric in test_metrics.values():
            metric.update(logits, labels)
    results = {name: metric.eval() for name, metric in test_metrics.items()}
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


class ServedModel:
    """The exported model as `mlflow models serve` runs it. In: a batch of 28x28 grayscale images as 0-255
    pixel values, oriented as in the IDX files ([N, 28, 28]). Out: prediction_frame(). The preprocessing is
    the training's own (data.to_model_input)."""

    def __init__(self, mindir):
        self.net = nn.GraphCell(ms.load(str(mindir)))

    def predict(self, model_input, params=None):  # pylint: disable=unused-argument
        images = np.asarray(model_input, dtype=np.uint8)
        return prediction_frame(self.net(Tensor(data.to_model_input(images))).asnumpy())


def _load_pyfunc(path):
    """MLflow's entry point for this module as a pyfunc loader_module: the model from its MindIR at `path`."""
    device.cap_onednn_isa()  # in the serving process as in training, before its first CPU kernel
    return ServedModel(path)
