#!/usr/bin/env bash
# The GPU checks in one device call (~8 minutes on an H100; 2026-11-27 ran this plan, less the profile, in
# 294 s): the two halves of `pytest -m gpu` beside the image tests and the proof's vlm part (transformers 5.24
# from .whl/vlm/ where the image's is older than 5.18), then the 1B throughput alone (lit-hbp beside HF
# Trainer and TRL's BFD, the memory model), a torch.profiler trace of its 4K level, the step's fixed cost and
# a hybrid's mixers.
# Here first: bash bench/gpu_wheels.sh. Device run: carry [".whl", "demo_data"], `bash bench/gpu_checks.sh`.
# Eight files come back in $OUT (the device tool returns at most 8); the logs are gathered from a scratch
# folder at the end:
#   env.txt         the timeline (each part's exit status and when it ended)
#   tests.log       pytest -m gpu (attention; the other files; the image tests with the image's transformers
#                   and with 5.24), each part under a header
#   vlm_proof.md    the proof's vlm part (its proof.log appended to tests.log)
#   vlm_proof.json
#   throughput.log  bench/gpu_throughput.py: each level alone in every mode, timed alike
#   profile.txt     bench/step_profile.py on the 4K level: wall ms a step, the device's busy share, waits for
#                   the device, Lightning's actions' host time, the top operations by device and host time
#   trace.json.gz   that profile's trace (Perfetto)
#   bench.log       bench/step_overhead.py (the run's optimizer step beside a bare loop, HBPStrategy ZeRO-2
#                   among its modes) and bench/mixer_batches.py (a hybrid's mixers over 64-document packs)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_checks}; mkdir -p "$OUT"
TMP=$(mktemp -d)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
at() { echo "$1 at $(( $(date +%s) - T0 )) s" >> $OUT/env.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_vlm .whl/vlm/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
at install
PYT="python3 -m pytest -m gpu -v --tb=short -rfE -p no:cacheprovider"
( timeout 240 $PYT tests/test_attention.py > $TMP/t_attn.log 2>&1; at "attention exit $?" ) &
( timeout 260 $PYT tests --ignore=tests/test_attention.py --ignore=tests/test_vision.py > $TMP/t_other.log 2>&1; at "other exit $?" ) &
(
  timeout 60 $PYT tests/test_vision.py > $TMP/t_vis.log 2>&1; at "vision (image transformers) exit $?"
  # 5.24: the five exact families on the chosen backend and two on Flex, each tower on lit-hbp's tower attention
  # beside torch's varlen kernel and Flex (transformers' flash beside flash-attn 2/3)
  PYTHONPATH=/tmp/site_vlm:$PYTHONPATH timeout 150 $PYT tests/test_vision.py > $TMP/t_vis524.log 2>&1; at "vision (5.24) exit $?"
  timeout 150 python3 bench/gpu_proof.py --parts vlm --out $TMP/vlm > /dev/null 2>&1; at "vlm part exit $?"
) &
wait
for part in t_attn t_other t_vis t_vis524 vlm/proof; do
  [ -f $TMP/$part.log ] && { echo "===== $part.log"; cat $TMP/$part.log; } >> $OUT/tests.log
done
[ -f $TMP/vlm/proof.md ] && cp $TMP/vlm/proof.md $OUT/vlm_proof.md
[ -f $TMP/vlm/proof.json ] && cp $TMP/vlm/proof.json $OUT/vlm_proof.json
# Each level alone in every mode, timed alike (one device synchronization per level's window), HF Trainer and
# TRL's BFD compiled as the config compiles lit-hbp's layers (torch_compile)
timeout 300 python3 bench/gpu_throughput.py --config configs/llama_1b_1gpu.yaml --steps 12 --warmup 4 --modes hbp_alone,hf_sdpa,trl_bfd --data.demo_dir=demo_data > $OUT/throughput.log 2>&1
at "throughput exit $?"
# Where a 4K step's time goes (82 of 306 ms were its forward and backward on the H100, 2026-11-27): three steps
# of the config's 4K level after four, traced (kernels, the device's idle time, Lightning's hooks on the host).
timeout 120 python3 bench/step_profile.py --config configs/llama_1b_1gpu.yaml --level 4096 --steps 3 --warmup 4 \
    --out $OUT --data.demo_dir=demo_data > $TMP/profile_run.log 2>&1
at "profile exit $?"
[ -f $OUT/profile.txt ] || tail -40 $TMP/profile_run.log > $OUT/profile.txt
# The fixed cost per optimizer step on the GPU: Trainer.fit's step beside a bare loop (bf16), 16 layers at width 64.
echo "===== step_overhead" >> $OUT/bench.log
timeout 60 python3 bench/step_overhead.py --device cuda --layers 16 --rounds 2 >> $OUT/bench.log 2>&1
at "step overhead exit $?"
# A hybrid's Mamba2 mixers (Bamba) over SFT-like packs: the documents as a few batches' rows beside one call each.
echo "===== mixer_batches" >> $OUT/bench.log
timeout 60 python3 bench/mixer_batches.py --device cuda --family bamba --docs 64 --pack-len 4096 --steps 4 --warmup 1 \
    --rounds 2 >> $OUT/bench.log 2>&1
at "mixer batches exit $?"
rm -rf "$TMP"
cat $OUT/env.txt
