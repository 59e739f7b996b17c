"""The network, the other seam to replace for your own training: build_network(num_classes), a cell from
float32 [N, C, 28, 28] (data.to_model_input) to logits [N, num_classes]; nothing else knows its layers."""

import mindspore as ms
from mindspore import nn, ops


class MaxPool2x2(nn.Cell):
    """nn.MaxPool2d(2, 2) bit for bit, by adaptive max-pooling to half size on CPU: nn.MaxPool2d's oneDNN
    kernel for plain NCHW under the AVX2 cap is its slow reference code (docs/performance.md)."""

    def __init__(self):
        super().__init__()
        self.on_cpu = ms.get_context("device_target") == "CPU"
        self.pool = nn.MaxPool2d(2, 2)

    def construct(self, x):
        height, width = x.shape[-2:]  # constants in the compiled graph: the branch is chosen at compile time
        if self.on_cpu and height % 2 == 0 and width % 2 == 0:
            return ops.adaptive_max_pool2d(x, (height // 2, width // 2))
        return self.pool(x)


class LeNet(nn.Cell):
    """The article's LeNet: two 5x5 `valid` convolutions (6 and 16 channels) each with ReLU and 2x2
    max-pooling, 28 -> 24 -> 12 -> 8 -> 4, then dense 256-120-84-10; 44,426 parameters."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.SequentialCell(
            nn.Conv2d(1, 6, 5, pad_mode="valid", has_bias=True), nn.ReLU(), MaxPool2x2(),
            nn.Conv2d(6, 16, 5, pad_mode="valid", has_bias=True), nn.ReLU(), MaxPool2x2())
        self.classifier = nn.SequentialCell(
            nn.Flatten(), nn.Dense(16 * 4 * 4, 120), nn.ReLU(), nn.Dense(120, 84), nn.ReLU(),
            nn.Dense(84, num_classes))

    def construct(self, x):
        return self.classifier(self.features(x))


def build_network(num_classes):
    return LeNet(num_classes)
