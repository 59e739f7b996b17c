"""The PyTorch DDP peer of the job, for the benchmark's side-by-side run: the same LeNet, data, data order,
per-worker batch, optimizer (SGD, lr 0.1) and worker count, with torchrun and gloo, one worker per core as the
job binds its workers. It runs in a venv of its own (make bench makes it), so the job's pins never move.

    torchrun --standalone --nproc_per_node=2 bench/peer_torch.py --data-dir DIR --epochs 10 --json OUT

Rank 0 writes JSON: the train samples/s of each epoch (the training loop alone, as the job's figure) and
overall, the time to the first step, and the test accuracy.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fmnist import fetch  # noqa: E402 (the job's own IDX reader; it needs neither MindSpore nor MLflow)

STARTED = time.perf_counter()


class LeNet(nn.Module):
    """The job's network (fmnist/model.py), layer for layer."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2, 2),
                                      nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 120), nn.ReLU(),
                                        nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def load(data_dir, split):
    images, labels = (fetch.parse_idx(fetch.local_copy(data_dir, f"{split}-{kind}").read_bytes(), kind)
                      for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
    images = torch.from_numpy(images[:, None].astype(np.float32) / 255)
    return images, torch.from_numpy(labels.astype(np.int64))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # DDP broadcasts rank 0's weights anyway
    images, labels = load(args.data_dir, "train")
    test_images, test_labels = load(args.data_dir, "t10k")
    model = nn.parallel.DistributedDataParallel(LeNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    steps = len(images) // (args.batch_size * world_size)
    per_rank = steps * args.batch_size
    first_step_s, epochs = None, []
    for epoch in range(args.epochs):
        # The job's data order (main.py, Shard): a permutation per (seed, epoch), a block per rank.
        order = np.random.default_rng((args.seed, epoch)).permutation(len(images))
        mine = torch.from_numpy(order[rank * per_rank:(rank + 1) * per_rank])
        model.train()
        started = time.perf_counter()
        for start in range(0, per_rank, args.batch_size):
            batch = mine[start:start + args.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(images[batch]), labels[batch]).backward()
            optimizer.step()
            if first_step_s is None:
                first_step_s, first_step_at = time.perf_counter() - STARTED, time.time()
        train_s = time.perf_counter() - started
        epochs.append({"epoch": epoch + 1, "train_s": train_s,
                       "train_samples_per_s": steps * args.batch_size * world_size / train_s})
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
    if rank == 0:
        total = sum(e["train_s"] for e in epochs)
        args.json.write_text(json.dumps({
            "torch_version": torch.__version__, "world_size": world_size, "epochs": epochs,
            "train_samples_per_s": steps * args.batch_size * world_size * args.epochs / total,
            "first_step_s": first_step_s, "first_step_at": first_step_at, "test_accuracy": accuracy}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
