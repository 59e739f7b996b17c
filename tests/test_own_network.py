"""The seam a user replaces: another network, written in fmnist/model.py alone, trains through the whole
pipeline with 2 msrun workers: checkpoints and resume, the MLflow run, --predict and `mlflow models serve`."""

import gzip
import json
import shutil
import subprocess
import sys
import urllib.request

import pytest

from fmnist import fetch
from conftest import ROOT, free_port, job_env, models_serve, read_summary, tiny_args

pytestmark = pytest.mark.timeout(600)

MLP = '''"""A user's own network: a small multilayer perceptron in place of LeNet."""

from mindspore import nn


class MLP(nn.Cell):
    def __init__(self, num_classes=10):
        super().__init__()
        self.layers = nn.SequentialCell(nn.Flatten(), nn.Dense(28 * 28, 64), nn.ReLU(),
                                        nn.Dense(64, num_classes))

    def construct(self, x):
        return self.layers(x)


def build_network(num_classes):
    return MLP(num_classes)
'''

PREDICT = """import sys, json, numpy as np, mindspore as ms
from fmnist import data, model
net = model.build_network(len(data.CLASS_NAMES))
ms.load_param_into_net(net, ms.load_checkpoint(sys.argv[1]))
images = np.array(json.loads(sys.stdin.read()), dtype=np.uint8)
print(json.dumps(net(ms.Tensor(data.to_model_input(images))).asnumpy().argmax(axis=1).tolist()))
"""


@pytest.fixture(scope="module")
def own_network(tmp_path_factory):
    """A copy of the project whose fmnist/model.py is the MLP, and nothing else changed."""
    project = tmp_path_factory.mktemp("own-network") / "project"
    project.mkdir()
    for name in ("main.py", "run.sh", "requirements.txt"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(ROOT / "fmnist", project / "fmnist", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "fmnist" / "model.py").write_text(MLP)
    return project


def run_copy(project, cwd, args, store):
    """msrun with 2 workers on the copy's main.py, tracking to `store`."""
    log_dir = cwd / "msrun-logs"
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", "--join=True", f"--master_port={free_port()}",
           f"--log_dir={log_dir}", "python", str(project / "main.py"), *args]
    result = subprocess.run(cmd, cwd=cwd, env=job_env(MLFLOW_TRACKING_URI=store), capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, {p.name: p.read_text()[-2000:] for p in log_dir.glob("*.log")}
    return (log_dir / "worker_0.log").read_text()


def test_an_mlp_trains_resumes_is_tracked_predicts_and_serves(own_network, tiny_data, tmp_path):
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    run_copy(own_network, tmp_path, tiny_args(tiny_data, out), store)
    checkpoint = ms.load_checkpoint(str(out / "checkpoints" / "epoch-0001.ckpt"))
    assert tuple(checkpoint["layers.1.weight"].shape) == (64, 28 * 28)  # the MLP's, not LeNet's
    assert not any(name.startswith("features.") for name in checkpoint)

    log = run_copy(own_network, tmp_path, tiny_args(tiny_data, out, "--epochs", "2"), store)
    assert "resuming from" in log and "1 of 2 epochs done" in log
    summary = read_summary(out)
    assert (summary["resumed_from_epoch"], summary["world_size"],
            summary["replicas_identical"]) == (1, 2, True)
    run = MlflowClient(store).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "true"
    assert [m.step for m in MlflowClient(store).get_metric_history(run.info.run_id, "val_accuracy")] == [1, 2]

    predicted = subprocess.run([sys.executable, str(own_network / "main.py"), *tiny_args(tiny_data, out),
                                "--predict", str(out / "model.ckpt")], cwd=tmp_path, env=job_env(),
                               capture_output=True, text=True, timeout=120, check=False)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert f"test accuracy {summary['test_accuracy']:.4f}" in predicted.stdout

    images = fetch.parse_idx(gzip.decompress((tiny_data / "t10k-images-idx3-ubyte.gz").read_bytes()))[:16]
    expected = subprocess.run([sys.executable, "-c", PREDICT, str(out / "model.ckpt")], cwd=own_network,
                              input=json.dumps(images.tolist()), env=job_env(),
                              capture_output=True, text=True, timeout=120, check=True)
    with models_serve(f"runs:/{run.info.run_id}/model", tmp_path,
                      job_env(MLFLOW_TRACKING_URI=store)) as (url, _):
        request = urllib.request.Request(url, data=json.dumps({"inputs": images.tolist()}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            served = [p["class_index"] for p in json.loads(response.read())["predictions"]]
    assert served == json.loads(expected.stdout.strip().splitlines()[-1])
