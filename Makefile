# Everyday commands; each does all the set-up it needs on a fresh machine (a venv in .venv, pinned packages).
#   make run    train with ./run.sh: one worker per Ascend device, else 2 CPU workers (ARGS="--epochs 3")
#   make test   the test suite, as CI runs it (all but the image's tests; the real data for the world-size tests)
#   make test-image  build the image with podman and run it, and the manifests' pods (as root; a few minutes)
#   make bench  the benchmark on the real data, beside its PyTorch DDP peer (BENCH_ARGS="--epochs 2 --pairs 3")
PYTHON ?= python3
VENV ?= .venv
CHECKOV_VENV ?= .venv-checkov
PEER_VENV ?= .venv-peer
BIN := $(abspath $(VENV))/bin
SYSTEM_DATA := /usr/share/datasets/fashion-mnist

# What podman needs to build and run the image here, and mmdebstrap, which makes the tests' Debian base.
IMAGE_TOOLS := podman runc netavark aardvark-dns iptables catatonit mmdebstrap

.PHONY: run test test-image image-tools bench system-data clean

run: $(VENV)/.runtime system-data
	PATH="$(BIN):$$PATH" ./run.sh $(ARGS)

# Three tests at a time: fewer, and the suite waits for msrun's starts and heartbeats and for servers; three keep
# both cores busy (docs/testing.md). loadgroup keeps the tests of a shared job on one worker.
test: $(VENV)/.dev system-data
	PATH="$(BIN):$$PATH" python -m pytest -n 3 --dist loadgroup -m "not image" $(PYTEST_ARGS)

# IMAGE_TESTS=required: a machine that cannot run them fails them instead of skipping them.
test-image: $(VENV)/.dev image-tools
	IMAGE_TESTS=required PATH="$(BIN):$$PATH" python -m pytest -m image $(PYTEST_ARGS)

bench: $(VENV)/.runtime $(PEER_VENV)/.installed system-data
	PATH="$(BIN):$$PATH" python bench/bench.py --peer-python $(PEER_VENV)/bin/python $(BENCH_ARGS)

# The benchmark's PyTorch peer, in a venv of its own so that the job's pins never move.
$(PEER_VENV)/.installed: bench/requirements-peer.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet -r bench/requirements-peer.txt
	touch $@

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.dev: requirements-dev.txt requirements-checkov.txt $(VENV)/.runtime
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet -r requirements-checkov.txt
	touch $@

# Debian and Ubuntu package Fashion-MNIST, so a machine without a route to the official mirror still has the
# data. Best effort: without root or apt the job downloads the data itself.
system-data:
	@if [ ! -d $(SYSTEM_DATA) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing dataset-fashion-mnist with apt-get"; \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends dataset-fashion-mnist >/dev/null) \
			|| echo "apt-get could not install dataset-fashion-mnist; the job will download the data"; \
	fi

# As root on Debian or Ubuntu; elsewhere the tests name what is missing.
image-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(IMAGE_TOOLS) with apt-get"; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $(IMAGE_TOOLS) >/dev/null; \
	fi

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(PEER_VENV) outputs mlruns mlflow.db
