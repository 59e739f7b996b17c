# The training job's image. Default: Ascend 910B NPUs, on the CANN image whose CANN release MindSpore 2.10
# supports (8.2 to 9.1) with Python 3.11. CANN_CHIP picks CANN's image for another chip; the same file builds a
# CPU image from a plain Python base:
#   docker build -t fashion-mnist-mindspore:1.0.0 .                                      # Ascend 910B
#   docker build --build-arg CANN_CHIP=310p -t fashion-mnist-mindspore:1.0.0-310p .      # Ascend 310P (the article's)
#   docker build --build-arg BASE_IMAGE=python:3.11.14-slim-bookworm -t fashion-mnist-mindspore:1.0.0-cpu .
# podman builds it unchanged; tests/test_image.py builds and runs the CPU variant (docs/deployment.md).
ARG CANN_CHIP=910b
ARG BASE_IMAGE=quay.io/ascend/cann:8.5.0-${CANN_CHIP}-ubuntu22.04-py3.11
FROM ${BASE_IMAGE}

# 1 bakes Fashion-MNIST into the image (Debian/Ubuntu package dataset-fashion-mnist) so pods need no
# internet; the job finds it in /usr/share/datasets/fashion-mnist. 0 leaves the download to the job.
ARG BAKE_DATA=1

USER 0

# libgomp1: MindSpore's CPU kernels link GNU OpenMP, which the slim Python images leave out (CANN's have it).
# Its version is the base's own, so it is not pinned. dataset-fashion-mnist is pinned to the one version Debian
# and Ubuntu ship; its content is verified by checksum at run time anyway.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && if [ "${BAKE_DATA}" = 1 ]; then \
        apt-get install -y --no-install-recommends dataset-fashion-mnist=0.0~git20200523.55506a9-1; \
    fi \
    && rm -rf /var/lib/apt/lists/*

# uid/gid 1000 is HwHiAiUser on Ascend hosts, the owner of the driver files the container reads.
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 trainer) \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash trainer) \
    && mkdir -p /workspace \
    && chown 1000:1000 /workspace

# A venv: Debian's own Python refuses system-wide installs (PEP 668), and msrun launches `python`, which a
# Debian base lacks. --system-site-packages keeps what the base provides (CANN's Python packages); the pins win.
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
WORKDIR /opt/job
# Requirements before the source, so editing the code does not reinstall 2.5 GB of packages.
COPY requirements.txt ./
# Behind a proxy or a private index, pass the build machine's pip settings and CA bundle as build secrets:
# mounted for this step only, nothing of them stays in the image. Without them pip uses its defaults.
#   --secret id=pip.conf,src=/etc/pip.conf --secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    python3 -m venv --system-site-packages "${VIRTUAL_ENV}" \
    && python -m pip install --no-cache-dir -r requirements.txt

COPY main.py run.sh ./
COPY fmnist/ ./fmnist/

# Declared here, after every RUN: a build argument is part of each later RUN's cache key, so a new commit
# would otherwise reinstall every package.
ARG GIT_COMMIT=""
ENV PYTHONUNBUFFERED=1 \
    MPLBACKEND=Agg \
    MPLCONFIGDIR=/tmp/matplotlib \
    DATA_DIR=/workspace/data \
    OUTPUT_DIR=/workspace/outputs \
    GIT_COMMIT=${GIT_COMMIT}

USER 1000:1000
WORKDIR /workspace
ENTRYPOINT ["/opt/job/run.sh"]
