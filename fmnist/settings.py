"""The settings, one table (Config) for the parser, the checks and the course a resume keeps: each is a flag
and a variable (--batch-size, BATCH_SIZE, cfg.batch_size), the flag winning. `python -m fmnist.settings
WORLD_SIZE [flags...]` is run.sh's check before msrun, without MindSpore: exit 2 in one line."""

import argparse
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path

from . import common, data

OFFICIAL_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
DEVICES = ("auto", "Ascend", "CPU")
AMP_LEVELS = ("auto", "O0", "O1", "O2", "O3")
TRACKING = ("on", "offline", "off")
POSITIVE = (lambda value: value > 0, "must be positive")
NON_NEGATIVE = (lambda value: value >= 0, "must be >= 0")
BELOW_ONE = (lambda value: 0 <= value < 1, "must be in [0, 1)")
LOSS_SCALE = (lambda value: value in ("auto", "none", "dynamic") or is_positive_number(value),
              "must be auto, none, dynamic or a positive number")


def is_positive_number(text):
    """As float() reads it: 1024, 0.5 and 1e3 are; 0, inf, nan and ² are not."""
    try:
        return 0 < float(text) < math.inf
    except ValueError:
        return False


def setting(default, help, choices=(), check=None, course=False):  # noqa: A002 (argparse's word)
    """A field of Config; `course`: it shapes the training, so a resume keeps it (where, or how long, not)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "check": check,
                                                         "course": course})


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings of one job, as read and checked by parse_config(): the one table of them."""

    epochs: int = setting(10, "training epochs in total", check=POSITIVE)
    batch_size: int = setting(64, "batch size per device (the default fits itself to a small training set); "
                              "times the world size, the global batch, which a resume keeps", check=POSITIVE)
    lr: float = setting(0.1, "learning rate", check=POSITIVE, course=True)
    optimizer: str = setting("sgd", "optimizer", choices=("sgd", "momentum", "adam"), course=True)
    momentum: float = setting(0.9, "momentum, for --optimizer momentum", check=BELOW_ONE, course=True)
    weight_decay: float = setting(0.0, "L2 weight decay", check=NON_NEGATIVE, course=True)
    # amp and loss scale are free as asked for: what the job resolves them to is checked on resume instead.
    amp: str = setting("auto", "mixed precision; auto: O2 on Ascend, O0 on CPU", choices=AMP_LEVELS)
    loss_scale: str = setting("auto", "none, dynamic (Ascend only) or a fixed scale; auto: dynamic for O2 on "
                              "Ascend, else none", check=LOSS_SCALE)
    device: str = setting("auto", "auto: Ascend when present, else CPU", choices=DEVICES, course=True)
    seed: int = setting(42, "random seed, the same on every rank: the replicas start identical", course=True)
    data_dir: Path = setting(Path("data"), "where Fashion-MNIST is, or is put")
    data_mirrors: str = setting(OFFICIAL_MIRROR, "base URLs to download from, comma-separated, after local "
                                "copies; empty: never download")
    checksums_file: str = setting("", "sha256sum-style file for the four IDX files (another IDX dataset)")
    download_timeout: float = setting(30.0, "seconds without progress that end a download", check=POSITIVE)
    download_deadline: float = setting(600.0, "seconds one file's download may take in all", check=POSITIVE)
    output_dir: Path = setting(Path("outputs"), "where summary.json, PNGs and checkpoints go")
    resume: str = setting("auto", "auto: continue from the newest good checkpoint; never: start fresh",
                          choices=("auto", "never"))
    checkpoint_steps: int = setting(0, "also checkpoint every N steps (a kill -9 loses fewer); 0: at each "
                                    "epoch's end only", check=NON_NEGATIVE)
    keep_checkpoints: int = setting(3, "checkpoints kept in <output-dir>/checkpoints", check=POSITIVE)
    predict: str = setting("", "evaluate a saved model (.ckpt or .mindir) on the test set, then exit")
    experiment: str = setting("fashion-mnist-lenet", "MLflow experiment name")
    run_name: str = setting("", "MLflow run name (default: MLflow picks one)")
    tracking: str = setting("on", "on: the MLflow journal, sent as the job goes; offline: the journal only, "
                            "for `python -m fmnist.tracking sync`; off: none", choices=TRACKING)
    tracking_wait: int = setting(60, "seconds a finishing job gives an unreachable MLflow", check=POSITIVE)
    register_model: str = setting("", "register the model under this name in MLflow's Model Registry")
    divergence_check: str = setting("on", "on: exit 3 when the training loss explodes, or past 200 steps "
                                    "the network is no better than chance; off: only a non-finite loss stops",
                                    choices=("on", "off"))
    log_interval: int = setting(100, "steps between progress lines (and an epoch's end)", check=POSITIVE)
    threads: int = setting(0, "CPU threads per worker; 0: one per core of its share (--cpu-bind)",
                           check=NON_NEGATIVE)
    cpu_bind: str = setting("on", "on: each CPU worker bound to its share of this machine's cores "
                            "(LOCAL_WORKERS workers, else the world size)", choices=("on", "off"))


FIELDS = dataclasses.fields(Config)
COURSE = frozenset(f.name for f in FIELDS if f.metadata["course"])
# A setting's variable is its name in capitals, but for MLflow's own.
VARIABLES = {"experiment": "MLFLOW_EXPERIMENT_NAME"}


def flag(field):
    return "--" + field.name.replace("_", "-")


def variable(field):
    return VARIABLES.get(field.name, field.name.upper())


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors in one line, not the whole usage."""

    def error(self, message):
        self.exit(common.EXIT_USAGE, f"error: {message} (see python main.py --help)\n")


def build_parser():
    parser = OneLineParser(
        prog="main.py", description="Data-parallel LeNet on Fashion-MNIST (MindSpore, msrun, MLflow). "
                    "Each flag defaults from the environment variable named in brackets.")
    for f in FIELDS:
        # argparse converts a string default with `type`, so a bad variable fails like a bad flag.
        parser.add_argument(flag(f), type=f.type, default=os.environ.get(variable(f), f.default),
                            choices=f.metadata["choices"] or None,
                            help=f"{f.metadata['help']} [{variable(f)}; default: {f.default}]")
    return parser


def parse_config(argv=None):
    """The checked settings; UsageError naming the flag and its variable for a bad one."""
    cfg = Config(**vars(build_parser().parse_args(argv)))
    for f in FIELDS:
        value, choices, check = getattr(cfg, f.name), f.metadata["choices"], f.metadata["check"]
        # argparse checks choices only on the command line, not on a default taken from the environment.
        problem = f"must be one of {', '.join(choices)}" if choices and value not in choices else None
        problem = problem or (check and not check[0](value) and check[1])
        if problem:
            raise common.UsageError(f"{flag(f)} {problem}, got {value!r} (flag or {variable(f)})")
    if cfg.register_model and cfg.tracking == "off":
        raise common.UsageError("--register-model needs tracking: drop --tracking off, or the registration")
    if cfg.predict and not Path(cfg.predict).is_file():
        raise common.UsageError(f"--predict {cfg.predict}: no such file; give a model.ckpt or model.mindir "
                                "from a finished job")
    return cfg


def resolve_device(requested):
    """--device as MindSpore finds it: auto is Ascend when present, else CPU. MindSpore is imported here, so
    that run.sh's check loads it only for the one setting that needs it."""
    if requested != "auto":
        return requested
    import mindspore as ms
    logging.disable(logging.WARNING)  # is_available() warns of the missing Ascend plugin, as expected on CPU
    try:
        return "Ascend" if ms.device_context.ascend.is_available() else "CPU"
    finally:
        logging.disable(logging.NOTSET)


def resolve_precision(amp, loss_scale, device):
    """(amp level, loss scaling) on `device`: amp auto is O2 on Ascend (float16 pays off on its cube units,
    and only adds casts on CPU), else O0; loss scaling auto is MindSpore's default."""
    amp_level = amp if amp != "auto" else "O2" if device == "Ascend" else "O0"
    if loss_scale == "auto":
        return amp_level, "dynamic" if amp_level == "O2" and device == "Ascend" else "none"
    if loss_scale == "dynamic" and device == "CPU":
        raise common.UsageError("--loss-scale dynamic: MindSpore supports no dynamic loss scaling on CPU; "
                                "use --loss-scale none or a fixed scale such as --loss-scale 1024")
    return amp_level, loss_scale if loss_scale in ("none", "dynamic") else f"fixed:{float(loss_scale):g}"


def check_against_data(cfg, world_size, train_count, test_count):
    """The settings if every rank has test images and a global batch fits the training set (a default batch
    size is lowered to fit); else UsageError naming the limit."""
    if test_count < world_size:
        raise common.UsageError(f"the test set has {test_count} images, fewer than the {world_size} workers "
                                "that each evaluate a share of it: use fewer workers")
    per_step, fitted = cfg.batch_size * world_size, train_count // world_size
    if cfg.predict or per_step <= train_count:
        return cfg
    if cfg.batch_size == Config.batch_size and fitted:
        common.log.warning("--batch-size %d (the default) with %d worker(s) is more than the %d training "
                           "images: using %d", cfg.batch_size, world_size, train_count, fitted)
        return dataclasses.replace(cfg, batch_size=fitted)
    fix = f"use --batch-size {fitted} or less" if fitted else "use fewer workers"
    raise common.UsageError(f"--batch-size {cfg.batch_size} with {world_size} worker(s) takes {per_step} "
                            f"training images a step, but the training set has {train_count}: {fix}")


def main(argv):
    """run.sh's check before msrun starts: every check that needs no MindSpore and no download."""
    try:
        if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
            raise common.UsageError("usage: python -m fmnist.settings WORLD_SIZE [main.py flags...]")
        cfg = parse_config(argv[1:])
        data.load_checksums(cfg.checksums_file)
        if cfg.loss_scale == "dynamic":  # the one check the device decides, which needs MindSpore
            resolve_precision(cfg.amp, cfg.loss_scale, resolve_device(cfg.device))
        if os.environ.get("NODE_RANK", "0") == "0":  # whose job writes there, and holds its lock
            common.hold_lock(cfg.output_dir / ".lock", f"--output-dir {cfg.output_dir}", probe=True).close()
        try:
            splits = data.load_splits(cfg.data_dir)
        except common.UsageError:
            # The job will fetch the data there under this lock, which waits for another job's fetch.
            what = f"--data-dir {cfg.data_dir}"
            common.hold_lock(cfg.data_dir / ".lock", what, wait=True, probe=True).close()
        else:
            check_against_data(cfg, int(argv[0]), len(splits.train.labels), len(splits.test.labels))
    except common.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    print(cfg.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
