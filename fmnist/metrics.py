"""Figures over the whole test set: each rank measures its own slice, and eval() gathers the counts, so a
figure is the job's, never rank 0's shard alone."""

import numpy as np

import mindspore as ms
from mindspore.train import Metric


def log_softmax(logits):
    """Log-probabilities of each row of logits, computed stably in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def cross_entropy(logits, one_hot_labels):
    """Per-sample softmax cross-entropy."""
    return -(one_hot_labels * log_softmax(logits)).sum(axis=1)


def correct_predictions(logits, one_hot_labels):
    return (logits.argmax(axis=1) == one_hot_labels.argmax(axis=1)).astype(np.float64)


class GlobalMean(Metric):
    """Mean of a per-sample quantity over the whole test set: each rank sums its shard, eval() gathers the
    sums."""

    def __init__(self, per_sample, collective):
        super().__init__()
        self._per_sample, self._collective = per_sample, collective
        self.clear()

    def clear(self):
        self._sum, self._count = 0.0, 0

    def update(self, *inputs):
        values = self._per_sample(inputs[0].asnumpy(), inputs[1].asnumpy())
        self._sum += float(values.sum())
        self._count += len(values)

    def eval(self):
        total, count = self._collective.all_gather(np.array([self._sum, self._count])).sum(axis=0)
        return total / count


class GlobalConfusion(Metric):
    """Confusion matrix (rows: true class, columns: predicted) over the whole test set, summed across ranks."""

    def __init__(self, collective, num_classes):
        super().__init__()
        self._collective, self._num_classes = collective, num_classes
        self.clear()

    def clear(self):
        self._counts = np.zeros((self._num_classes, self._num_classes), dtype=np.int64)

    def update(self, *inputs):
        predicted, actual = inputs[0].asnumpy().argmax(axis=1), inputs[1].asnumpy().argmax(axis=1)
        np.add.at(self._counts, (actual, predicted), 1)

    def eval(self):
        return self._collective.all_gather(self._counts).sum(axis=0)


def test_metrics(collective, num_classes):
    """What Model.fit validates with after each epoch, and --predict evaluates: loss, accuracy, confusion."""
    return {"loss": GlobalMean(cross_entropy, collective), "accuracy": GlobalMean(correct_predictions, collective),
            "confusion": GlobalConfusion(collective, num_classes)}


def mixed_precision(train_step, net, float32_net, images):
    """What mixed precision and loss scaling do in a train step as MindSpore built it, measured on it:
    features_dtype, the dtype the first layers compute in (float16 under O2 and O3; O1 casts back after each
    layer); amp_logit_error, the largest change of the step's forward logits against `float32_net` (a fresh
    network, given net's weights here; 0 under O0); step_loss_scale, the factor the backward pass scales by."""
    ms.load_param_into_net(float32_net, net.parameters_dict())
    amp_forward = train_step.network._backbone  # pylint: disable=protected-access  (the network after amp)
    scale = train_step.scale_sense.asnumpy() if hasattr(train_step, "scale_sense") else train_step.sens
    return {"features_dtype": str(next(iter(net.cells()))(images[:2]).dtype),
            "amp_logit_error": float(np.abs(amp_forward(images).asnumpy() - float32_net(images).asnumpy()).max()),
            "step_loss_scale": float(scale)}
