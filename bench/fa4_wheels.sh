#!/usr/bin/env bash
# Fills .whl_fa4/ (git-ignored) with flash-attn 4 and what it needs beyond the GPU image, for the gpu_checks
# parts fa4stage and fa4: FA4 is Python over NVIDIA's CuTe DSL, whose compiler library (nvidia-cutlass-dsl-libs-cu13,
# a 92 MB wheel) is larger than what one device call carries (64 MiB with the tree). So it travels repacked (tar.xz
# of the unpacked wheel, 63 MB) and cut in two: .whl_fa4/a/ goes with a first call that only keeps it on the machine
# (fa4stage), .whl_fa4/b/ (the rest and the small wheels) with the second (fa4). The image has torch 2.11+cu130,
# cuda-bindings, cuda-pathfinder, protobuf, einops and typing-extensions; nothing of torch or CUDA is fetched.
#   bash bench/fa4_wheels.sh [PYTHON_VERSION]     (default 3.12; about 3 minutes: xz -9e of 227 MB; halves of 52 and 20 MB)
set -eu
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
FA4=${FA4_VERSION:-4.0.0b40}
DSL=${CUTLASS_DSL_VERSION:-4.8.1}
CUT=${FA4_FIRST_PART_MB:-50}
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
PLAT="$PLAT --platform manylinux2014_x86_64"
rm -rf .whl_fa4 && mkdir -p .whl_fa4/a .whl_fa4/b .whl_fa4/tmp
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLAT -d .whl_fa4/b \
    "flash-attn-4==$FA4" "quack-kernels>=0.5.3" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext \
    "nvidia-cutlass-dsl==$DSL" "nvidia-cutlass-dsl-libs-base==$DSL" "nvidia-cutlass-dsl-libs-core==$DSL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLAT \
    -d .whl_fa4/tmp "nvidia-cutlass-dsl-libs-cu13==$DSL"
mkdir -p .whl_fa4/tmp/unpacked
python3 -m zipfile -e .whl_fa4/tmp/nvidia_cutlass_dsl_libs_cu13-*.whl .whl_fa4/tmp/unpacked
tar -C .whl_fa4/tmp/unpacked -cf - . | xz -9e -T0 > .whl_fa4/tmp/libs.tar.xz
split -b "${CUT}M" -d .whl_fa4/tmp/libs.tar.xz .whl_fa4/tmp/libs.tar.xz.
mv .whl_fa4/tmp/libs.tar.xz.00 .whl_fa4/a/
find .whl_fa4/tmp -maxdepth 1 -name 'libs.tar.xz.[0-9]*' -exec mv {} .whl_fa4/b/ \;
rm -rf .whl_fa4/tmp
du -sh .whl_fa4/a .whl_fa4/b
