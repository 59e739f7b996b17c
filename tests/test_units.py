"""Unit tests of main.py's pure helpers, on small arrays and IDX files made here."""

import gzip
import os
import re
import socket
import threading
import time
import types

import numpy as np
import pytest

import main
from fmnist import checkpoints, common, data, distributed, fetch, model, settings, tracking
from conftest import ROOT, idx_bytes, make_split, small_volume


def test_parse_idx_reads_plain_and_gzipped():
    images, _ = make_split(5, seed=1)
    for raw in (idx_bytes(images), gzip.compress(idx_bytes(images))):
        np.testing.assert_array_equal(fetch.parse_idx(raw), images)


@pytest.mark.parametrize("mangle, message", [
    (lambda raw: b"\x00\x00\x08\x02" + raw[4:], "magic number"),
    (lambda raw: raw[:-1], "header says shape"),
    (lambda raw: raw[:6], "too short"),
    (lambda raw: gzip.compress(raw)[:-9], "corrupt or truncated gzip"),
    (lambda raw: b"<html><body>404 Not Found</body></html>", "magic number"),
])
def test_parse_idx_rejects_malformed_files(mangle, message):
    raw = idx_bytes(np.zeros((3, 4, 4), np.uint8))
    with pytest.raises(ValueError, match=message):
        fetch.parse_idx(mangle(raw), "f")


def test_to_model_input_rescales_and_moves_channels_first():
    images = np.arange(2 * 28 * 28, dtype=np.uint64).reshape(2, 28, 28) % 256
    out = data.to_model_input(images.astype(np.uint8))
    assert out.shape == (2, 1, 28, 28) and out.dtype == np.float32
    np.testing.assert_allclose(out[:, 0], images / 255.0, rtol=1e-6)
    assert out.flags["C_CONTIGUOUS"]


def test_to_model_input_converts_hwc_color_to_chw():
    images = np.zeros((1, 28, 28, 3), np.uint8)
    images[..., 2] = 255  # only the third channel lit
    out = data.to_model_input(images)
    assert out.shape == (1, 3, 28, 28)
    assert out[0, 2].min() == 1.0 and out[0, :2].max() == 0.0


def test_to_model_input_resizes_other_sizes_to_28():
    out = data.to_model_input(np.full((2, 14, 14), 255, np.uint8))
    assert out.shape == (2, 1, 28, 28)
    np.testing.assert_allclose(out, 1.0)


def test_one_hot():
    out = data.one_hot(np.array([0, 9, 3], np.uint8))
    assert out.dtype == np.float32 and out.shape == (3, 10)
    np.testing.assert_array_equal(out.argmax(1), [0, 9, 3])
    np.testing.assert_array_equal(out.sum(1), 1.0)


def test_evaluation_loss_is_the_cross_entropy_computed_stably():
    logits = np.array([[2.0, 1.0, 0.1], [1000.0, 0.0, -1000.0]])
    labels = np.array([[1.0, 0, 0], [0, 1.0, 0]])
    evaluation = distributed.Evaluation(distributed.Collective(0, 0, 1), 3)
    evaluation.update(FakeTensor(logits), FakeTensor(labels))
    expected0 = -np.log(np.exp(2.0) / np.exp(logits[0]).sum())
    assert evaluation.eval()["loss"] == pytest.approx((expected0 + 1000.0) / 2)


class FakeCollective:
    """Stands in for two ranks: the other rank is given fixed sums."""

    def __init__(self, other_row):
        self.other_row = np.asarray(other_row, dtype=float)

    def all_gather(self, array):
        return np.stack([np.asarray(array, dtype=float), self.other_row])


class FakeTensor:
    def __init__(self, array):
        self.array = np.asarray(array)

    def asnumpy(self):
        return self.array


def test_evaluation_counts_every_sample_once_across_ranks():
    # This rank: 2 samples, 1 correct. The other rank: 3 samples, all of class 0 and right -> 4/5, not
    # mean(0.5, 1.0); its loss sum is 3.0.
    other = np.append(3.0, np.array([[3, 0], [0, 0]]).ravel())
    evaluation = distributed.Evaluation(FakeCollective(other), 2)
    logits, labels = np.array([[0.9, 0.1], [0.9, 0.1]]), np.array([[1.0, 0.0], [0.0, 1.0]])
    evaluation.update(FakeTensor(logits), FakeTensor(labels))
    figures = evaluation.eval()
    assert figures["accuracy"] == pytest.approx(0.8)
    right = np.exp(0.9) / (np.exp(0.9) + np.exp(0.1))  # the probability of class 0
    assert figures["loss"] == pytest.approx((-np.log(right) - np.log(1 - right) + 3.0) / 5)
    np.testing.assert_array_equal(figures["confusion"], [[4, 0], [1, 0]])
    evaluation.clear()
    evaluation.update(FakeTensor(logits[:1]), FakeTensor(labels[:1]))
    np.testing.assert_array_equal(evaluation.eval()["confusion"], [[4, 0], [0, 0]])


def test_settings_come_from_flags_then_environment(monkeypatch):
    monkeypatch.setenv("BATCH_SIZE", "32")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp-from-env")
    cfg = settings.parse_config(["--epochs", "3"])
    assert (cfg.epochs, cfg.batch_size, cfg.experiment, cfg.lr) == (3, 32, "exp-from-env", 0.1)
    assert settings.parse_config(["--batch-size", "8"]).batch_size == 8  # a flag beats the environment


def test_every_setting_is_in_the_docs_table_and_the_help_with_its_variable():
    rows = re.findall(r"^\| `(--[\w-]+)` \| `(\w+)` \|",
                      (ROOT / "docs" / "settings.md").read_text(), flags=re.M)
    assert sorted(rows) == sorted((settings.flag(f), settings.variable(f)) for f in settings.FIELDS)
    actions = settings.build_parser()._actions  # noqa: SLF001
    helps = {action.option_strings[0]: action.help for action in actions}
    for f in settings.FIELDS:
        help_line = f"{f.metadata['help']} [{settings.variable(f)}; default: {f.default}]"
        assert helps[settings.flag(f)] == help_line


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "--epochs must be positive"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--momentum", "1.5"], "--momentum must be in"),
])
def test_bad_settings_are_usage_errors(argv, message):
    with pytest.raises(common.UsageError, match=message):
        settings.parse_config(argv)


def test_bad_environment_value_exits_with_usage_status(monkeypatch, capsys):
    monkeypatch.setenv("EPOCHS", "ten")
    with pytest.raises(SystemExit) as exit_info:
        settings.parse_config([])
    assert exit_info.value.code == common.EXIT_USAGE
    assert "--epochs: invalid int value: 'ten'" in capsys.readouterr().err


def test_main_reports_bad_setting_in_one_line(capsys):
    assert main.main(["--batch-size", "0"]) == common.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--batch-size must be positive" in err


def test_amp_auto_is_o2_on_ascend_only():
    assert settings.resolve_precision("auto", "none", "Ascend")[0] == "O2"
    assert settings.resolve_precision("auto", "none", "CPU")[0] == "O0"
    assert settings.resolve_precision("O1", "none", "CPU")[0] == "O1"


def test_checksums_file_must_cover_all_four_files(tmp_path):
    path = tmp_path / "sums"
    path.write_text("ab  train-images-idx3-ubyte.gz\n")
    with pytest.raises(common.UsageError, match="no checksum for t10k-images-idx3-ubyte"):
        data.load_checksums(str(path))
    assert data.load_checksums("") == data.CHECKSUMS


def test_lenet_is_the_articles_layers_and_parameter_count():
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    net = model.LeNet()
    shapes = {p.name: p.shape for p in net.trainable_params()}
    assert shapes == {
        "features.0.weight": (6, 1, 5, 5), "features.0.bias": (6,),
        "features.3.weight": (16, 6, 5, 5), "features.3.bias": (16,),
        "classifier.1.weight": (120, 256), "classifier.1.bias": (120,),
        "classifier.3.weight": (84, 120), "classifier.3.bias": (84,),
        "classifier.5.weight": (10, 84), "classifier.5.bias": (10,)}
    assert [c.pad_mode for c in (net.features[0], net.features[3])] == ["valid", "valid"]
    # 6*25+6 + 16*6*25+16 + 256*120+120 + 120*84+84 + 84*10+10
    assert sum(p.size for p in net.trainable_params()) == 44426
    assert net.features(ms.Tensor(np.zeros((2, 1, 28, 28), np.float32))).shape == (2, 16, 4, 4)
    assert net(ms.Tensor(np.zeros((2, 1, 28, 28), np.float32))).shape == (2, 10)


def test_weights_fingerprint_changes_with_any_weight():
    net, alone = model.LeNet(), distributed.Collective(0, 0, 1)
    identical, before = distributed.replicas_identical(alone, net)
    param = net.trainable_params()[-1]
    param.set_data(param + 1e-6)
    assert identical and before.dtype == np.int32
    assert not np.array_equal(before, distributed.replicas_identical(alone, net)[1])


def global_batches(inputs, world_size, epoch=0, skip=0, global_batch=12):
    """Each step's global batch, as the ranks of `world_size` workers train it: their slices, in rank
    order."""
    ranks = []
    for rank in range(world_size):
        shard = main.Shard(inputs, global_batch,
                           types.SimpleNamespace(rank=rank, world_size=world_size), seed=7)
        shard.epoch, shard.skip = epoch, skip
        # A sample's image is its index, through the transforms: pixel index / 255.
        ranks.append([np.rint(images[:, 0, 0, 0] * 255).astype(int) for images, _ in shard])
    return [np.concatenate(slices) for slices in zip(*ranks, strict=True)]


def test_the_data_order_is_global_the_same_samples_each_step_on_any_world_size():
    indices = np.arange(100)
    inputs = data.Split(np.broadcast_to(indices.astype(np.uint8)[:, None, None], (100, 28, 28)), indices % 10)
    one_worker = global_batches(inputs, 1)
    assert len(one_worker) == 8  # 100 // 12 whole global batches; the remainder is dropped
    for world_size in (1, 2, 3, 4):
        steps = global_batches(inputs, world_size)
        assert all(np.array_equal(mine, theirs) for mine, theirs in zip(steps, one_worker, strict=True))
        seen = np.concatenate(steps)
        assert len(seen) == len(set(seen.tolist())) == 96, world_size  # no sample twice, none skipped
        # Resumed 3 steps into epoch 1 on any world size: the rest of the epoch an unbroken one trains.
        whole = global_batches(inputs, 2, epoch=1)
        rest = global_batches(inputs, world_size, epoch=1, skip=3)
        assert all(np.array_equal(a, b) for a, b in zip(rest, whole[3:], strict=True)) and len(rest) == 5
    assert not np.array_equal(np.concatenate(one_worker), np.concatenate(global_batches(inputs, 1, epoch=1)))
    for x, y in main.Shard(inputs, 12, types.SimpleNamespace(rank=1, world_size=2), seed=7):
        np.testing.assert_array_equal(np.rint(x[:, 0, 0, 0] * 255) % 10, y.argmax(axis=1))  # still paired


def test_workers_get_disjoint_shares_of_the_cores():
    cores = list(range(8))
    assert [distributed.worker_cores(cores, rank, 2) for rank in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [distributed.worker_cores(cores, rank, 3) for rank in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [distributed.worker_cores([0, 1], rank, 4) for rank in range(4)] == [[0], [1], [0], [1]]
    assert distributed.worker_cores([5], 0, 1) == [5]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell bound from unbound")
def test_binding_holds_the_caller_and_its_later_threads_and_leaves_running_threads_free():
    everywhere, core = os.sched_getaffinity(0), min(os.sched_getaffinity(0))
    release, seen = threading.Event(), {}

    def worker():  # stands for the main thread of a worker, which init() has given its collective's threads
        os.sched_setaffinity(0, {core})  # as distributed.set_up_worker binds a worker
        seen["caller"] = os.sched_getaffinity(0)
        later = threading.Thread(target=lambda: seen.update(later=os.sched_getaffinity(0)))
        later.start()
        later.join()
        seen["running"] = os.sched_getaffinity(running.native_id)
        release.set()

    running = threading.Thread(target=release.wait)  # stands for a collective thread started by init()
    running.start()
    caller = threading.Thread(target=worker)
    caller.start()
    caller.join()
    running.join()
    assert seen == {"caller": {core}, "later": {core}, "running": everywhere}


def test_usable_cores_follow_the_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda _: set(range(16)))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")  # a limit of 2.5 CPUs
    assert distributed.usable_cores(cpu_max) == [0, 1, 2]
    cpu_max.write_text("max 100000\n")
    assert distributed.usable_cores(cpu_max) == list(range(16))
    assert distributed.usable_cores(tmp_path / "absent") == list(range(16))


def test_onednn_isa_cap_defaults_to_avx2_on_x86_and_a_users_value_wins():
    environ = {}
    assert distributed.cap_onednn_isa(environ, machine="x86_64") == "AVX2"
    assert environ == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    for name in distributed.ONEDNN_ISA_VARS:
        environ = {name: "AVX512_CORE"}
        assert distributed.cap_onednn_isa(environ, machine="x86_64") == "AVX512_CORE"
        assert environ == {name: "AVX512_CORE"}  # untouched
    environ = {}
    assert distributed.cap_onednn_isa(environ, machine="aarch64") is None and environ == {}


def test_cpu_description_reads_model_and_isa_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f amx_tile\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 9R14\n")
    assert distributed.cpu_description(cpuinfo) == {"model": "AMD EPYC 9R14",
                                                    "flags": ["avx2", "avx512f", "amx_tile"]}


@pytest.mark.parametrize("requested, amp, device, expected", [
    ("auto", "O2", "Ascend", "dynamic"),  # MindSpore's own default for O2
    ("auto", "O2", "CPU", "none"),  # what the article does; MindSpore refuses dynamic scaling on CPU
    ("auto", "O0", "Ascend", "none"),
    ("none", "O2", "Ascend", "none"),
    ("1024", "O2", "CPU", "fixed:1024"),
    ("dynamic", "O3", "Ascend", "dynamic"),
])
def test_loss_scaling_resolves_per_level_and_device(requested, amp, device, expected):
    assert settings.resolve_precision(amp, requested, device) == (amp, expected)


def test_dynamic_loss_scaling_is_refused_on_cpu_in_one_line(capsys):
    assert main.main(["--loss-scale", "dynamic", "--device", "CPU"]) == common.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no dynamic loss scaling on CPU" in err and "--loss-scale none" in err


@pytest.mark.parametrize("value", ["-8", "0", "inf", "nan", "²", "x"])
def test_loss_scale_must_be_a_mode_or_a_positive_number(value):
    with pytest.raises(common.UsageError, match="--loss-scale must be"):
        settings.parse_config(["--loss-scale", value])


def test_a_fixed_loss_scale_is_any_positive_number():
    assert [settings.parse_config(["--loss-scale", v]).loss_scale for v in ("1024", "0.5", "1e3")] == [
        "1024", "0.5", "1e3"]


class FakeRunContext:
    def __init__(self, **args):
        self.args = types.SimpleNamespace(**args)

    def original_args(self):
        return self.args


class RecordingTracker(tracking.NullTracker):
    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, dict(metrics)))


def tiny_training(output_dir, **changes):
    """A one-process Training of 4 steps an epoch on 32 generated images, its journal a RecordingTracker."""
    cfg = settings.Config(epochs=1, batch_size=8, log_interval=2, output_dir=output_dir, **changes)
    job = distributed.Job(cfg, {}, "CPU", "O0", "none", {}, distributed.Collective(0, 0, 1), 1, None)
    split = data.Split(*make_split(32, seed=0))
    training = main.Training(job, data.Splits(split, split), common.Startup())
    training.resume()
    training.tracker = RecordingTracker()
    return training


def test_dynamic_loss_scale_and_skipped_steps_are_logged(tmp_path):
    """The outputs of MindSpore's TrainOneStepWithLossScaleCell, (loss, overflowed, scale), as the callback
    sees them; the cell itself needs an Ascend device."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    training = tiny_training(tmp_path)
    training.on_train_epoch_begin(None)
    for overflowed, scale in ((True, 65536.0), (False, 32768.0), (True, 32768.0), (True, 16384.0)):
        outputs = (ms.Tensor(1.0, ms.float32), ms.Tensor(overflowed), ms.Tensor(scale, ms.float32))
        training.on_train_step_end(FakeRunContext(net_outputs=outputs))
    intervals = [(step, m["skipped_steps"], m["loss_scale"]) for step, m in training.tracker.logged
                 if "loss_scale" in m]
    assert intervals == [(2, 1, 32768.0), (4, 3, 16384.0)]
    assert training.skipped_steps == 3


def test_a_non_finite_loss_stops_training_even_with_the_divergence_check_off(tmp_path):
    """The one check --divergence-check off keeps: an exploded but finite loss trains on, a NaN stops."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    training = tiny_training(tmp_path, lr=1e8, divergence_check="off")
    training.on_train_epoch_begin(None)
    for loss in (1e30, 1e30, float("nan")):
        training.on_train_step_end(FakeRunContext(net_outputs=ms.Tensor(loss, ms.float32)))
    with pytest.raises(main.Diverged, match=r"training loss nan at step 4 \(epoch 1\)"):
        training.on_train_step_end(FakeRunContext(net_outputs=ms.Tensor(1.0, ms.float32)))


@pytest.mark.parametrize("variable, value, message", [
    ("AMP", "O5", "--amp must be one of auto, O0, O1, O2, O3, got 'O5' (flag or AMP)"),
    ("RESUME", "always", "--resume must be one of auto, never, got 'always' (flag or RESUME)"),
    ("DEVICE", "GPU", "--device must be one of auto, Ascend, CPU, got 'GPU' (flag or DEVICE)"),
])
def test_choices_are_checked_for_values_from_the_environment(monkeypatch, variable, value, message):
    """argparse checks choices only on the command line; the job checks a default taken from the
    environment."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(common.UsageError) as error:
        settings.parse_config([])
    assert str(error.value) == message


def test_checkpoint_names_sort_as_the_training_went(tmp_path):
    Position = checkpoints.Position
    positions = [Position(1), Position(1, 16), Position(1, 200), Position(2), Position(2, 5)]
    paths = [tmp_path / p.file_name for p in positions]
    names = ["epoch-0001.ckpt", "epoch-0002-step-000016.ckpt", "epoch-0002-step-000200.ckpt",
             "epoch-0002.ckpt", "epoch-0003-step-000005.ckpt"]
    assert [path.name for path in paths] == names
    assert [Position.of_file(name) for name in names] == positions
    for path in reversed(paths):  # made in the reverse order, so that no time order helps
        path.touch()
    assert checkpoints.newest_first(tmp_path) == paths[::-1]
    assert Position.after(272, 256) == Position(1, 16)
    assert Position.after(512, 256) == Position(2)


def test_newest_checkpoints_come_first_and_other_files_are_ignored(tmp_path):
    for name in ("epoch-0001.ckpt", "epoch-0002-step-000010.ckpt", "epoch-0002.ckpt",
                 "epoch-0002-step-000300.ckpt", "last-step", ".epoch-0003.1a2b.part.ckpt", "epoch-x.ckpt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in checkpoints.newest_first(tmp_path)] == [
        "epoch-0002.ckpt", "epoch-0002-step-000300.ckpt", "epoch-0002-step-000010.ckpt", "epoch-0001.ckpt"]


def test_restart_cost_is_the_steps_lost_and_the_time_since_the_stop(tmp_path):
    resumed = checkpoints.Resumed(tmp_path / "epoch-0001.ckpt", checkpoints.State(290),
                                  restarts=2, global_batch=32)
    (tmp_path / "checkpoints").mkdir()
    # As the stopped job left it: step 300, done at 990 s after the epoch.
    (tmp_path / "checkpoints" / "last-step").write_text(f"{300:12d} {990.0:20.6f}\n")
    saver = checkpoints.Checkpoints(settings.Config(output_dir=tmp_path), {}, resumed, 290)
    saver.mark(291)
    cost = saver.restart_cost()
    assert cost["restarts"] == 3 and cost["restart_steps_lost"] == 10
    assert cost["restart_total_s"] == pytest.approx(time.time() - 990.0, abs=5)


def fill(volume, chunk):
    """Writes to `volume` until it is full, `chunk` bytes at a time."""
    with open(volume / "filler", "wb", buffering=0) as filler, pytest.raises(OSError, match="No space left"):
        while True:
            filler.write(b"\0" * chunk)


def test_step_record_on_a_full_volume_is_disk_full(tmp_path):
    """The record's first write takes a block: on a full volume that is the job's exit 4, not a traceback."""
    with small_volume(tmp_path / "volume", "64k") as volume:
        saver = checkpoints.Checkpoints(settings.Config(output_dir=volume), {}, None, 10)
        fill(volume, 4096)
        with pytest.raises(common.DiskFull, match=r"no space left on the device of .*/checkpoints/last-step"):
            saver.mark(1)


def test_a_journal_line_cut_short_is_dropped_before_the_next(tmp_path, caplog):
    """A job killed while writing a line leaves part of it: the next job's first line would join it into one
    that no reader takes. It is dropped, with one WARNING, and the whole lines before it stay."""
    path = tmp_path / tracking.JOURNAL
    tracking.Journal(path).append("metrics", step=1, timestamp=0, values={"train_loss": 1.0})
    with open(path, "ab") as out:
        out.write(b'{"op": "log_model", "mindir": "/x/mod')
    with caplog.at_level("WARNING", logger=common.log.name):
        tracking.Journal(path).append("end", status="FINISHED")
    assert [op["op"] for _, op in tracking.Journal(path).read_from(0)] == ["metrics", "end"]
    assert [record.getMessage() for record in caplog.records] == [
        "MLflow: the journal's last line was cut short (a job killed while writing it); its 37 bytes dropped"]


def test_a_resumed_job_journals_no_point_a_stopped_one_journaled(tmp_path, monkeypatch):
    """After a kill -9 the steps since the checkpoint are trained again: their points are in the journal once,
    the new ones follow, and the system metrics' samples go on from the stopped job's. A new training's start
    forgets the old one's."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.05")
    journal = tracking.Journal(tmp_path / tracking.JOURNAL)
    journal.append("start", continues=False)
    journal.append("metrics", step=8, timestamp=0, values={"train_loss": 2.0, "system/node0/cpu": 50.0})
    journal.append("metrics", step=16, timestamp=0, values={"train_loss": 1.5})
    tracker = tracking.Tracker(settings.Config(output_dir=tmp_path, tracking="offline"), "node0")
    tracker.start({}, {}, list, continues=True)
    tracker.started()
    for step in (8, 16, 24):
        tracker.log_metrics({"train_loss": 1.0, "world_size": 2}, step=step)
    deadline = time.monotonic() + 30
    while "system/node0/cpu_utilization_percentage" not in journal.last_steps():
        assert time.monotonic() < deadline, "no system metrics sampled"
        time.sleep(0.05)
    tracker.finish("FINISHED")
    lines = [op for _, op in journal.read_from(0) if op["op"] == "metrics"]
    points = [(op["step"], sorted(op["values"])) for op in lines[2:] if "train_loss" in op["values"] or
              "world_size" in op["values"]]
    assert points == [(8, ["world_size"]), (16, ["world_size"]), (24, ["train_loss", "world_size"])]
    cpu = [op["step"] for op in lines[2:] if "system/node0/cpu_utilization_percentage" in op["values"]]
    assert min(cpu) == 9
    journal.append("start", continues=False)
    assert journal.last_steps() == {}


def test_a_journal_line_a_full_volume_refuses_leaves_nothing_of_it(tmp_path):
    with small_volume(tmp_path / "volume", "64k") as volume:
        journal = tracking.Journal(volume / tracking.JOURNAL)
        journal.append("metrics", step=1, timestamp=0, values={"train_loss": 1.0})
        before = journal.path.read_bytes()
        fill(volume, 1024)
        # Larger than what a page of the tmpfs takes: some of it could be written, but none of it stays.
        with pytest.raises(common.DiskFull):
            journal.append("artifact", path="/x" * 10_000)
        assert journal.path.read_bytes() == before


def test_a_line_mlflow_does_not_take_waits_with_all_after_it(tmp_path, monkeypatch, caplog):
    """A 403 on metric points (the run's permissions changed mid-run, say) is neither transient nor a refused
    start: one WARNING naming sync, nothing retried, nothing skipped, the position before that line."""
    from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED  # pylint: disable=import-outside-toplevel
    journal = tracking.Journal(tmp_path / tracking.JOURNAL)
    journal.append("artifact", path="/x")
    journal.append("metrics", step=1, timestamp=0, values={"train_loss": 1.0})
    journal.append("end", status="FINISHED")
    tried = []

    def send(self, op):
        tried.append(op["op"])
        if op["op"] == "metrics":
            raise MlflowException("not allowed to log to this run", error_code=PERMISSION_DENIED)  # HTTP 403

    monkeypatch.setattr(tracking.Sender, "send", send)
    sender = tracking.Sender(tmp_path)
    with caplog.at_level("WARNING", logger=common.log.name):
        assert sender.send_unsent(stopping=lambda: len(tried) > 3) is False
        assert sender.send_unsent() is False
    assert tried == ["artifact", "metrics"]
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "not allowed to log to this run" in warnings[0], warnings
    assert f"python -m fmnist.tracking sync {tmp_path}" in warnings[0]
    first_line = len(journal.path.read_text().splitlines()[0]) + 1
    assert f'"offset": {first_line}' in (tmp_path / tracking.POSITION).read_text()
    assert [op["op"] for _, op in tracking.Sender(tmp_path).unsent()] == ["metrics", "end"]


def test_metric_lines_in_a_row_are_one_request_of_at_most_1000_points():
    lines = [(i, {"op": "metrics", "step": i, "timestamp": 0, "values": {f"m{k}": 1.0 for k in range(300)}})
             for i in range(5)] + [(9, {"op": "end", "status": "FINISHED"})]
    op, count = tracking.batch(lines)
    assert count == 3 and len(op["points"]) == 900 and op["points"][-1] == ("m299", 1.0, 0, 2)
    assert tracking.batch(lines[3:]) == (tracking.batch(lines[3:5])[0], 2)
    assert tracking.batch(lines[5:]) == (lines[5][1], 1)
    huge = [(1, {"op": "metrics", "step": 0, "timestamp": 0, "values": {f"m{k}": 1.0 for k in range(1500)}})]
    assert tracking.batch(huge)[1] == 1


def test_a_local_store_being_made_or_locked_is_retried_like_a_dead_server():
    """SQLite's lock and a race in MLflow's migrations (two jobs making one mlflow.db) wait like an outage."""
    from alembic.util.exc import CommandError  # pylint: disable=import-outside-toplevel
    from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
    from mlflow.protos.databricks_pb2 import (  # pylint: disable=import-outside-toplevel
        PERMISSION_DENIED, TEMPORARILY_UNAVAILABLE)
    from sqlalchemy.exc import OperationalError  # pylint: disable=import-outside-toplevel
    assert tracking.transient(OperationalError("INSERT", {}, Exception("database is locked")))
    assert tracking.transient(CommandError("Online migration expected to match one row; 0 found"))
    assert tracking.transient(ConnectionError()) and tracking.transient(TimeoutError())
    assert tracking.transient(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE))  # 503
    assert not tracking.transient(MlflowException("no", error_code=PERMISSION_DENIED))  # 403
    assert not tracking.transient(RuntimeError("a bug"))


def test_an_experiment_another_job_makes_at_the_same_moment_is_used(tmp_path):
    """Two jobs starting a new experiment at once: the one whose creation fails takes the other's."""
    from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
    made = []

    class Client:
        def get_experiment_by_name(self, name):
            return types.SimpleNamespace(experiment_id="7") if made else None

        def create_experiment(self, name, tags):
            made.append(name)  # the other job's, a moment earlier
            raise MlflowException("UNIQUE constraint failed: experiments.name")

    sender = tracking.Sender(tmp_path)
    sender.client = Client()
    assert sender.experiment_id("new") == "7"
    made.clear()

    def refuse(self, name, tags):
        raise MlflowException("refused")  # and nobody else made it

    Client.create_experiment = refuse
    with pytest.raises(MlflowException, match="refused"):
        sender.experiment_id("forbidden")


def test_a_worker_waits_for_the_scheduler_to_listen_and_no_longer(monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    monkeypatch.setenv("MS_SCHED_HOST", "127.0.0.1")
    monkeypatch.setenv("MS_SCHED_PORT", str(server.getsockname()[1]))
    # The clock starts before the timer does, so that the wait measured cannot be shorter than the timer's.
    started = time.monotonic()
    threading.Timer(0.5, server.listen).start()
    distributed.wait_for_scheduler(timeout_s=10)
    assert 0.5 <= time.monotonic() - started < 1.5
    server.close()
    started = time.monotonic()
    distributed.wait_for_scheduler(timeout_s=0.5)  # nobody listens: init() takes over after the time-out
    assert 0.5 <= time.monotonic() - started < 1.5


@pytest.mark.parametrize("message, lost", [
    # A collective that timed out on a silent peer, and one whose connection to the peer broke first (both
    # seen from the two-node test's surviving rank).
    ("The state of the cluster is error, total nodes num: 3, failed nodes num: 1\n\n- C++ Call Stack:",
     "The state of the cluster is error, total nodes num: 3, failed nodes num: 1"),
    ("Launch kernel failed: Default/AllReduce-op0\n\n----\n- The Function Call Stack:",
     "Launch kernel failed: Default/AllReduce-op0"),
    ("Launch kernel failed: Default/Conv2D-op3\n\nAllReduce", None),
    ("Out of memory", None),
])
def test_a_peer_gone_is_told_from_other_runtime_errors(message, lost):
    assert distributed.peer_lost(RuntimeError(message)) == lost
    assert distributed.peer_lost(ValueError(message)) is None
