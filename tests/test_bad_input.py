"""Bad input through run.sh with 2 workers, as the image and Kubernetes start the job: each case ends with
exit 2 and one line naming what is wrong, with no traceback on the console or in any log. A new case is one
row of BAD_INPUTS. And any directory name a user may choose works: spaces, accents."""

import gzip
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, job_env, no_traceback, read_summary, run_sh, tiny_args, write_dataset

pytestmark = pytest.mark.timeout(300)

# (case, extra arguments, environment, the line that must say what is wrong, caught before msrun starts)
BAD_INPUTS = [
    ("timeout-not-a-number", [], {"DOWNLOAD_TIMEOUT": "soon"},
     "argument --download-timeout: invalid float value",
     True),
    ("negative-learning-rate", ["--lr", "-1"], {}, "--lr must be positive, got -1.0 (flag or LR)", True),
    ("amp-level-from-the-environment", [], {"AMP": "O5"}, "--amp must be one of auto, O0, O1, O2, O3", True),
    ("optimizer-from-the-environment", [], {"OPTIMIZER": "rmsprop"},
     "--optimizer must be one of sgd, momentum, adam",
     True),
    ("cpu-binding-from-the-environment", [], {"CPU_BIND": "yes"},
     "--cpu-bind must be one of on, off, got 'yes'",
     True),
    ("zero-threads-from-the-environment", [], {"THREADS": "-1"},
     "--threads must be >= 0, got -1 (flag or THREADS)",
     True),
    ("registration-without-tracking", ["--register-model", "m", "--tracking", "off"], {},
     "--register-model needs tracking", True),
    ("batch-larger-than-the-training-set", ["--batch-size", "200"], {},
     "--batch-size 200 with 2 worker(s) takes 400 training images a step, but the training set has 256",
     True),
    ("fewer-test-images-than-workers", ["--data-dir", "one-test-image", "--checksums-file",
                                        "one-test-image/CHECKSUMS"], {},
     "the test set has 1 images, fewer than the 2 workers that each evaluate a share of it", True),
    ("output-dir-under-a-file", ["--output-dir", "a-file/out"], {},
     "--output-dir a-file/out: cannot use it (Not a directory)", True),
    ("data-dir-under-a-file", ["--data-dir", "a-file/data"], {},
     "--data-dir a-file/data: cannot use it (Not a directory)", True),
    ("missing-checksums-file", ["--checksums-file", "nowhere"], {},
     "--checksums-file nowhere: cannot read it", True),
    ("dynamic-loss-scaling-on-cpu", ["--loss-scale", "dynamic"], {}, "no dynamic loss scaling on CPU", True),
    ("corrupt-file-in-the-data-dir", ["--data-dir", "corrupt"], {},
     "cannot obtain train-images-idx3-ubyte", False),
    ("missing-model-to-predict", ["--predict", "missing.ckpt"], {},
     "--predict missing.ckpt: no such file", True),
]


@pytest.mark.parametrize("extra, env, message, before_msrun",
                         [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(tiny_data, tmp_path, extra, env, message, before_msrun):
    (tmp_path / "a-file").write_text("not a directory\n")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_data, corrupt)
    images = corrupt / "train-images-idx3-ubyte.gz"
    images.write_bytes(gzip.compress(gzip.decompress(images.read_bytes())[:-1] + b"\x01", mtime=0))
    write_dataset(tmp_path / "one-test-image", splits={"train": 256, "t10k": 1})
    result = run_sh(tmp_path, [*tiny_args(tiny_data, "out", "--tracking", "off"), *extra], WORKERS="2", **env)
    console = result.console
    assert result.returncode == 2, console[-3000:]
    assert message in console, console[-3000:]
    assert no_traceback(result, tmp_path / "out" / "logs")
    logs = list((tmp_path / "out" / "logs").glob("*.log"))
    if before_msrun:  # the whole console is that one line, and msrun never started
        lines = console.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], console
        assert not logs
    else:  # a worker found it: run.sh names the worker and its status
        assert "exited with status 2: a bad setting or missing data" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_directories_with_spaces_and_accents_work(tiny_data, tmp_path):
    """MindSpore's MindIR exporter refuses such names; the job writes through a name it accepts."""
    data_dir = tmp_path / "dä ta"
    shutil.copytree(tiny_data, data_dir)
    result = run_sh(tmp_path, tiny_args(data_dir, "öut put", "--tracking", "on"), WORKERS="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = read_summary(tmp_path / "öut put")
    assert summary["world_size"] == 2 and summary["replicas_identical"] is True and summary["mlflow_run_id"]
    assert "Results: öut put/summary.json" in result.stdout
    for name in ("model.mindir", "model.ckpt", "samples.png", "confusion_matrix.png", "logs/worker_1.log"):
        assert (tmp_path / "öut put" / name).is_file(), name
    assert not list((tmp_path / "öut put").glob(".*part*"))  # no temporary file left behind
    predicted = subprocess.run([sys.executable, str(ROOT / "main.py"),
                                *tiny_args(data_dir, "öut put"), "--predict", "öut put/model.mindir"],
                               cwd=tmp_path, env=job_env(), capture_output=True, text=True,
                               timeout=120, check=False)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert f"test accuracy {summary['test_accuracy']:.4f}" in predicted.stdout
