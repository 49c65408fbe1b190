#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what a GPU machine's image lacks for bench/gpu_proof.sh, from a machine
# where pip reaches an index: run it in the checkout's root, then carry .whl/ to the GPU machine.
#   bash bench/gpu_wheels.sh [PYTHON_VERSION] [EXTRA_PACKAGE ...]     (default 3.12)
# Fetched as binary wheels for manylinux x86-64 without their dependencies: DeepSpeed's and the CLI's needs,
# datasets and TRL (bench/peers.py), Liger's kernels, flash-linear-attention (pure Python over Triton: the gated
# delta rule's kernels, which tests/test_mixers_gpu.py runs), and jinja2 >= 3.1.6 (lit-hbp's pin: advisories below it),
# which an image may predate (the GPU image lent here has pyarrow 25.0.1 and pillow 13.0.0, within lit-hbp's pins;
# pyarrow's wheel alone, 55 MB, would take the carried tree over the device's 64 MiB). In .whl/vlm/, transformers
# 5.24 and its huggingface-hub: vision-language packs need transformers >= 5.18 (mm_encoder_outputs), so the
# proof's vlm part and image tests run on them where the image's transformers is older. An image with torch
# (>= 2.10; the GPU image's 2.11+cu130 is kept: no torch, triton or CUDA wheel is ever fetched, and
# bench/gpu_proof.sh refuses one), transformers (5.10-5.25; the image's 5.17), Lightning (>= 2.6.6, < 2.7;
# the image's 2.6.6), accelerate, numpy, pandas, tokenizers, safetensors, pyyaml, psutil, ninja, einops,
# msgpack, xxhash, py-cpuinfo, pytest, hypothesis and tensorboard has the rest (the GPU image lent to this
# project has them all: /work/.library/device/KINDS.md); bench/gpu_proof.sh checks every one against the pins.
# DeepSpeed ships as source: its pure-Python wheel is built here with the local DeepSpeed version (0.19.2-0.19.x).
set -eu
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
shift || true
mkdir -p .whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64"
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLAT -d .whl \
    hjson pydantic pydantic-core annotated-types typing-inspection omegaconf jsonargparse docstring-parser \
    typeshed-client importlib-resources datasets==5.2.0 dill multiprocess trl==1.16.0 "liger-kernel>=0.6.2" \
    "jinja2>=3.1.6" flash-linear-attention==0.6.0 fla-core==0.6.0 "$@"
mkdir -p .whl/vlm
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLAT -d .whl/vlm \
    transformers==5.24.0 huggingface-hub==1.33.0
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    "deepspeed==$(python3 -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || echo 0.19.8)"
du -sh .whl
