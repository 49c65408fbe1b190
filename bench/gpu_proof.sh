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
#
# The image's own torch is the one proven: .whl/ may hold no torch, triton or CUDA wheel (refused), and the
# torch that runs is checked to be the image's after the install. Before any part runs, every installed
# package lit-hbp depends on is checked against pyproject.toml's ranges (Lightning >= 2.6.6, torch >= 2.10,
# ...): a package out of range is named and the proof stops with status 3 (bench/gpu_wheels.sh fetches
# what the GPU image lacks).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the parts run scripts from bench/: lit_hbp from here
DRY=0
for arg in "$@"; do [ "$arg" = --dry-run ] && DRY=1; done
# The torch this Python imports, its version and file, read without importing it (seconds a call)
torch_of() {
    $PY -c 'import importlib.metadata as m, importlib.util as u; print(m.version("torch"), u.find_spec("torch").origin)' \
        2>/dev/null
}
IMAGE_TORCH=$(torch_of)
if [ $DRY = 1 ]; then
    echo "gpu_proof: dry run: the wheels in .whl/ (for the GPU machine's Python) are not installed here"
elif compgen -G ".whl/*.whl" >/dev/null; then
    for wheel in .whl/*.whl; do
        case "$(basename "$wheel" | tr 'A-Z_' 'a-z-')" in
            torch-*|triton-*|nvidia-*|pytorch-triton-*)
                echo "gpu_proof: $wheel would replace the image's torch or its CUDA libraries: remove it from .whl/" >&2
                exit 3 ;;
        esac
    done
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_proof: installing .whl/ failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$(torch_of)" != "$IMAGE_TORCH" ]; then
    echo "gpu_proof: torch is now $(torch_of), not the image's $IMAGE_TORCH: nothing the proof installs may replace it" >&2
    exit 3
fi
$PY - <<'PINS' || exit 3
# Every dependency of lit-hbp (pyproject.toml) that is installed here, against its range.
import importlib.metadata as metadata
import sys
import tomllib

from packaging.requirements import Requirement

with open("pyproject.toml", "rb") as f:
    wanted = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
bad, missing = [], []
for req in wanted:
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(req.name)
        continue
    if not req.specifier.contains(version.split("+")[0], prereleases=True):
        bad.append(f"{req.name} {version} (lit-hbp needs {req.specifier})")
if missing:
    print(f"gpu_proof: not installed here: {', '.join(missing)} (the parts that import them fail)", file=sys.stderr)
if bad:
    print(f"gpu_proof: outside lit-hbp's pins: {'; '.join(bad)}: bench/gpu_wheels.sh fetches what the image lacks",
          file=sys.stderr)
    sys.exit(1)
print(f"gpu_proof: every installed dependency within lit-hbp's pins (torch {metadata.version('torch')}, "
      f"lightning {metadata.version('lightning')}, transformers {metadata.version('transformers')})")
PINS
exec $PY bench/gpu_proof.py "$@"
