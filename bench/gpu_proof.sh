#!/usr/bin/env bash
# The GPU proof in one command, on a bare GPU machine without network (one H100 or H200: under 8 minutes).
#
#   bash bench/gpu_wheels.sh             # once, where pip reaches an index: .whl/ gets what a GPU image lacks
#   bash bench/gpu_proof.sh [--out DIR]  # on the GPU machine, from the checkout with .whl/ in it
#   bash bench/gpu_proof.sh --dry-run    # a CPU: the same parts on the tiny config (part of the test suite)
#
# Installs the carried wheels (.whl/*.whl, not in a dry run) into /tmp/site, puts the checkout on PYTHONPATH
# (lit-hbp needs no install), then runs bench/gpu_proof.py: pytest -m gpu, gpu_throughput.py
# (tokens/s, MFU, memory model against max_memory_allocated, attention backends), peers.py at 1B, an
# sp 2 level with 2+ GPUs. Results: proof.json, proof.md, proof.log in --out (default $OUT, else
# runs/gpu_proof). Exit status 0 when every part passed, 1 when one failed, 3 when the install failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the parts run scripts from bench/: lit_hbp from here
DRY=0
for arg in "$@"; do [ "$arg" = --dry-run ] && DRY=1; done
if [ $DRY = 1 ]; then
    echo "gpu_proof: dry run: the wheels in .whl/ (for the GPU machine's Python) are not installed here"
elif compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_proof: installing .whl/ failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec $PY bench/gpu_proof.py "$@"
