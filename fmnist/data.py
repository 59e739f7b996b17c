"""The dataset, one of the two seams to replace for your own training: what the classes are, how a split is
read, how images become the network's input, and how each rank gets its own shard of every epoch.

What the rest of the job relies on:
    CLASS_NAMES                 the label of each class index
    load_checksums(path)        each file's expected SHA-256: Fashion-MNIST's, or those of --checksums-file
    make_available(cfg, ...)    the files in cfg.data_dir, on one worker per node; returns where each came from
    load_splits(dir)            Splits: the train and test Split, each images uint8 [N, H, W(, C)] and
                                integer labels [N]
    to_model_input(images)      float32 [N, C, H, W], the network's input (training and serving alike)
    shard(splits, ...)          this rank's ShardBatches of every training epoch and its slice of the test set
    train_dataset, eval_dataset their batches of (input, one-hot label), for Model.fit
"""

import copy
import dataclasses

import numpy as np

import mindspore as ms

from . import common, fetch
from .fetch import load_checksums  # noqa: F401 (part of the seam above)

CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SIZE = 28


def make_available(cfg, checksums, say):
    """The four verified IDX files in cfg.data_dir (no request when they are there); {file: where it came from}."""
    return fetch.ensure_data(cfg.data_dir, checksums, cfg.mirrors, cfg.download_timeout, say=say,
                             deadline=cfg.download_deadline)


@dataclasses.dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8 [N, H, W] or [N, H, W, C]
    labels: np.ndarray  # integer class indices [N]


@dataclasses.dataclass(frozen=True)
class Splits:
    train: Split
    test: Split


def load_splits(data_dir):
    """The train and t10k splits of verified IDX files in `data_dir`."""
    return Splits(load_split(data_dir, "train"), load_split(data_dir, "t10k"))


def load_split(data_dir, split):
    try:
        images, labels = (fetch.parse_idx(fetch.local_copy(data_dir, f"{split}-{kind}").read_bytes(), kind)
                          for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
    except (OSError, ValueError) as exc:
        raise common.UsageError(f"--data-dir {data_dir}: cannot read the {split} split ({exc})") from None
    if len(images) != len(labels):
        raise common.UsageError(f"{data_dir}: {split} has {len(images)} images but {len(labels)} labels")
    return Split(images, labels)


def to_model_input(images):
    """The article's image transforms, applied once to a whole uint8 array [N, H, W(, C)]:
    resize to 28x28, rescale by 1/255, HWC -> CHW, float32. Returns float32 [N, C, 28, 28].

    Fashion-MNIST fits in memory many times over, so transforming it once beats a per-sample map each epoch.
    """
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[1:3] != (IMAGE_SIZE, IMAGE_SIZE):
        resize = ms.dataset.vision.Resize((IMAGE_SIZE, IMAGE_SIZE))
        images = np.stack([resize(image) for image in images]).reshape(len(images), IMAGE_SIZE, IMAGE_SIZE, -1)
    model_input = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32)
    model_input *= np.float32(1 / 255)  # in place: the training set's float32 copy is 188 MB
    return model_input


def one_hot(labels, num_classes=len(CLASS_NAMES)):
    return np.eye(num_classes, dtype=np.float32)[labels]


class ShardBatches:
    """This rank's share of every epoch, as whole batches of already-transformed arrays.

    Each epoch draws one permutation from (seed, epoch), the same on every rank, and rank r takes the r-th
    contiguous block of it, so shards are disjoint and together cover the epoch. Whole batches cost one
    fancy-index each, where a per-sample source with the framework's sharding spent about a third of the
    2-core machine's step time in the pipeline. The order is a function of (seed, epoch, step) alone, so a
    resumed job that starts at `epoch` after `skip` steps trains the same batches as an uninterrupted one.
    """

    def __init__(self, images, labels, batch_size, rank, world_size, seed, epoch=0, skip=0):
        self.images, self.labels = images, labels
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.epoch, self.skip = epoch, skip

    @property
    def steps_per_epoch(self):
        return len(self.images) // (self.batch_size * self.world_size)

    def __len__(self):
        return self.steps_per_epoch - self.skip

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.images))
        self.epoch += 1
        per_rank = self.steps_per_epoch * self.batch_size
        mine = order[self.rank * per_rank:(self.rank + 1) * per_rank]
        for start in range(self.skip * self.batch_size, per_rank, self.batch_size):
            batch = mine[start:start + self.batch_size]
            yield self.images[batch], self.labels[batch]


def shard(splits, batch_size, rank, world_size, seed):
    """This rank's disjoint share of every training epoch, and its disjoint slice of the test set."""
    shards = ShardBatches(to_model_input(splits.train.images), one_hot(splits.train.labels), batch_size, rank,
                          world_size, seed)
    return shards, eval_dataset(splits.test, batch_size, rank, world_size)


def train_dataset(shards, epoch=0, skip=0):
    """The training batches of `shards` for Model.fit from epoch `epoch` (counted from 0), `skip` steps into
    it. With `skip`, every epoch of the dataset is that short (MindSpore fixes a dataset's length once), so
    such a dataset is for the rest of one interrupted epoch."""
    shards = copy.copy(shards)  # each dataset counts its own epochs
    shards.epoch, shards.skip = epoch, skip
    return ms.dataset.GeneratorDataset(shards, column_names=["image", "label"], shuffle=False,
                                       python_multiprocessing=False)


def eval_dataset(split, batch_size, rank, world_size):
    """Every world_size-th test sample from `rank` on, in whole batches. The framework's sampler pads shards
    to equal length by repeating samples, which would count some twice; slicing gives each sample to
    exactly one rank."""
    shard = slice(rank, None, world_size)
    images, labels = to_model_input(split.images[shard]), one_hot(split.labels[shard])
    batches = [(images[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, len(images), batch_size)]
    return ms.dataset.GeneratorDataset(batches, column_names=["image", "label"], shuffle=False,
                                       python_multiprocessing=False)
