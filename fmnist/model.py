"""The network, the other seam to replace for your own training: build_network(num_classes) returns an
nn.Cell that maps float32 [N, C, 28, 28] (data.to_model_input) to logits [N, num_classes].

Nothing else in the job knows its layers: checkpoints, resume, the MindIR export, MLflow and serving all
work on whatever cell this returns.
"""

from mindspore import nn


class LeNet(nn.Cell):
    """The article's LeNet: two 5x5 `valid` convolutions (6 and 16 channels) each with ReLU and 2x2 max-pooling,
    28 -> 24 -> 12 -> 8 -> 4, then dense 256-120-84-10; 44,426 parameters."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.SequentialCell(
            nn.Conv2d(1, 6, 5, pad_mode="valid", has_bias=True), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(6, 16, 5, pad_mode="valid", has_bias=True), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.classifier = nn.SequentialCell(
            nn.Flatten(), nn.Dense(16 * 4 * 4, 120), nn.ReLU(), nn.Dense(120, 84), nn.ReLU(),
            nn.Dense(84, num_classes))

    def construct(self, x):
        return self.classifier(self.features(x))


def build_network(num_classes):
    return LeNet(num_classes)
