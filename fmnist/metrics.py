"""Figures over the whole test set: each rank scores its own slice and one gather sums the ranks' counts, so a
figure is the job's, never rank 0's shard alone; and what mixed precision did to the trained network."""

import numpy as np
from scipy.special import log_softmax

import mindspore as ms
from mindspore.train import Metric


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
