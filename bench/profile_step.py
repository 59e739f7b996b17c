"""Where one training step goes: the job's LeNet step (MindSpore, graph mode, Model's TrainOneStepCell) in one
process on one thread, batch 64, timed per kernel by MindSpore's profiler (every operator, MindSpore's own
and oneDNN's), and its oneDNN primitives by oneDNN itself (ONEDNN_VERBOSE=profile_exec), which names the
implementation each one runs. With --torch, the same step of the PyTorch peer (bench/peer_torch.py's LeNet,
SGD) under torch.profiler, run by the peer's venv.

    python bench/profile_step.py                                   # MindSpore, this venv
    .venv-peer/bin/python bench/profile_step.py --torch            # PyTorch, the peer's venv
"""

import argparse
import collections
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BATCH = 64


def batches(count=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((BATCH, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, BATCH))
            for _ in range(count)]


def mindspore_step(steps, before_timing=None):
    """Seconds per step, timed over `steps` steps after a warm-up, of the job's own training step."""
    sys.path.insert(0, str(ROOT))
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    from mindspore import Tensor, nn  # pylint: disable=import-outside-toplevel
    from mindspore.train import Model  # pylint: disable=import-outside-toplevel

    from fmnist import data, distributed, model  # pylint: disable=import-outside-toplevel
    distributed.cap_onednn_isa()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    ms.device_context.cpu.op_tuning.threads_num(1)
    ms.set_seed(42)
    net = model.build_network(len(data.CLASS_NAMES))
    trainer = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean"),
                    nn.SGD(net.trainable_params(), learning_rate=0.1))
    step = trainer.train_network
    step.set_train()
    inputs = [(Tensor(x), Tensor(data.one_hot(y))) for x, y in batches()]
    return timed(lambda i: step(*inputs[i % len(inputs)]), lambda out: out.asnumpy(), steps,
                 before_timing=before_timing)


def profiled(steps):
    """{operator type: ms per step} of mindspore_step's steps under MindSpore's profiler."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as output:
        profilers = []  # started after the warm-up, so that it sees the timed steps alone
        mindspore_step(steps, before_timing=lambda: profilers.append(ms.Profiler(output_path=output)))
        profilers[0].analyse()
        table = next(Path(output).rglob("cpu_op_type_info_*.csv"))
        with open(table, newline="") as rows:
            return {row["op_type"]: float(row["total_compute_time"]) / steps for row in csv.DictReader(rows)}


def timed(step, sync, steps, warmup=30, before_timing=None):
    for i in range(warmup):
        out = step(i)
    sync(out)
    if before_timing:
        before_timing()
    started = time.perf_counter()
    for i in range(steps):
        out = step(i)
    sync(out)
    return (time.perf_counter() - started) / steps


def onednn_breakdown(steps):
    """Run mindspore_step in a child with oneDNN's verbose timing; {(primitive, implementation, direction):
    ms per step}, and the child's seconds per step."""
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_exec", "GLOG_v": "3"}
    result = subprocess.run([sys.executable, __file__, "--child", str(steps)], env=env, capture_output=True,
                            text=True, check=True)
    totals = collections.Counter()
    step_s = None
    for line in result.stdout.splitlines():
        if line.startswith("step_s "):
            step_s = float(line.split()[1])
        fields = line.split(",")
        if line.startswith("onednn_verbose") and "exec" in fields and "cpu" in fields:
            kind = fields.index("cpu") + 1
            totals[(fields[kind], fields[kind + 1], fields[kind + 2])] += float(fields[-1])
    measured_steps = steps + 30 + 1  # the timed steps, the warm-up and the compiling call
    return {key: ms / measured_steps for key, ms in totals.items()}, step_s


def torch_breakdown(steps):
    import torch  # pylint: disable=import-outside-toplevel
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
    sys.path.insert(0, str(ROOT / "bench"))
    from peer_torch import LeNet  # pylint: disable=import-outside-toplevel
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    torch.set_num_threads(1)
    torch.manual_seed(42)
    net, loss_fn = LeNet(), torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    inputs = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches()]

    def step(i):
        x, y = inputs[i % len(inputs)]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        return loss

    step_s = timed(step, lambda out: out.item(), steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i)
    rows = sorted(((e.key, e.self_cpu_time_total / 1000 / steps) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    return rows, step_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--torch", action="store_true", help="profile the PyTorch peer's step instead")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--profiler-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(f"step_s {mindspore_step(args.child)}", flush=True)
        return
    if args.torch:
        rows, step_s = torch_breakdown(args.steps)
        print(f"PyTorch {__import__('torch').__version__}, one thread, batch {BATCH}: "
              f"{step_s * 1000:.2f} ms per step ({BATCH / step_s:,.0f} samples/s)")
        for name, ms in rows[:20]:
            print(f"  {ms:7.3f} ms  {name}")
        return
    if args.profiler_child:
        print(json.dumps(profiled(args.profiler_child)), flush=True)
        return
    plain_s = mindspore_step(args.steps)
    operators = json.loads(subprocess.run([sys.executable, __file__, "--profiler-child", str(args.steps)],
                                          env={**os.environ, "GLOG_v": "3"}, capture_output=True, text=True,
                                          check=True).stdout.splitlines()[-1])
    breakdown, verbose_s = onednn_breakdown(args.steps)
    print(f"MindSpore, one thread, batch {BATCH}: {plain_s * 1000:.2f} ms per step "
          f"({BATCH / plain_s:,.0f} samples/s)")
    print("  by operator, MindSpore's profiler (its own timing inflates the kernels a little):")
    for name, ms in sorted(operators.items(), key=lambda item: -item[1]):
        print(f"  {ms:7.3f} ms  {name}")
    print(f"  {plain_s * 1000 - sum(operators.values()):7.3f} ms  between the kernels: the runtime, Python")
    print(f"  oneDNN's primitives, timed by oneDNN ({verbose_s * 1000:.2f} ms per step with its timing on):")
    for (kind, impl, direction), ms in sorted(breakdown.items(), key=lambda item: -item[1]):
        print(f"  {ms:7.3f} ms  {kind} {direction} ({impl})")


if __name__ == "__main__":
    main()
