#!/usr/bin/env bash
# Installs flash-attn 4 into a folder from the two halves bench/fa4_wheels.sh made: .fa4_stage/ (what the
# gpu_checks part fa4stage kept on the machine from .whl_fa4/a/) and .whl_fa4/b/ (carried with the fa4 call).
#   bash bench/fa4_install.sh TARGET      then PYTHONPATH=$(cat TARGET/.pythonpath):...
# TARGET/.pythonpath holds TARGET and the folders its .pth files add (the DSL's `cutlass` lives in
# nvidia_cutlass_dsl/dsl_packages, which its .pth puts on sys.path in a site-packages; a PYTHONPATH folder runs
# no .pth: "No module named 'cutlass'" on the H200, 2026-12-04).
# The small wheels first, then the CuTe DSL's compiler library over them: both put files under nvidia_cutlass_dsl/,
# which pip --target would either skip or replace as a whole.
set -eu
cd "$(dirname "$0")/.."
TARGET=${1:?the folder to install into}
STAGED=${FA4_STAGED:-.fa4_stage}
[ -e "$STAGED/libs.tar.xz.00" ] || { echo "no $STAGED/libs.tar.xz.00: run the fa4stage part first, on this machine" >&2; exit 3; }
mkdir -p "$TARGET"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TARGET" .whl_fa4/b/*.whl
cat "$STAGED"/libs.tar.xz.* .whl_fa4/b/libs.tar.xz.* | python3 -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as tar:
    tar.extractall(sys.argv[1], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))
' "$TARGET"
ls -d "$TARGET"/*.dist-info | sed "s|$TARGET/||"
python3 -c '
import site, sys
target = sys.argv[1]
before = list(sys.path)
site.addsitedir(target)
print(":".join([target] + [p for p in sys.path if p not in before and p != target]))
' "$(cd "$TARGET" && pwd)" > "$TARGET/.pythonpath"
echo "PYTHONPATH entries: $(cat "$TARGET/.pythonpath")"
