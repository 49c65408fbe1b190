#!/usr/bin/env bash
# The GPU checks in one device call (~8 minutes on an H100; 2026-11-27 ran this plan, less the profile, in
# 294 s): the two halves of `pytest -m gpu` beside the image tests and the proof's vlm part (transformers 5.24
# from .whl/vlm/ where the image's is older than 5.18), then the 1B throughput alone (lit-hbp beside HF
# Trainer, the memory model) and a profile of its 4K level.
# Here first: bash bench/gpu_wheels.sh. Device run: carry [".whl", "demo_data"], `bash bench/gpu_checks.sh`.
# Eleven files come back in $OUT: env.txt (the timeline), t_attn.log, t_other.log, t_vis.log, vlm/proof.*, throughput.log,
# profile.log (Lightning's per-hook host times of the 4K level under the config's HBPDDPStrategy), step_overhead.log
# (the run's optimizer step beside a bare loop, on the GPU, HBPStrategy ZeRO-2 among its modes), mixer_batches.log
# (a hybrid's mixers over a pack of 64 documents: one call a document, or the documents as a few batches' rows).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_checks}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
at() { echo "$1 at $(( $(date +%s) - T0 )) s" >> $OUT/env.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_vlm .whl/vlm/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
at install
PYT="python3 -m pytest -m gpu -v --tb=short -rfE -p no:cacheprovider"
( timeout 240 $PYT tests/test_attention.py > $OUT/t_attn.log 2>&1; at "attention exit $?" ) &
( timeout 260 $PYT tests --ignore=tests/test_attention.py --ignore=tests/test_vision.py > $OUT/t_other.log 2>&1; at "other exit $?" ) &
(
  timeout 60 $PYT tests/test_vision.py > $OUT/t_vis.log 2>&1; at "vision (image transformers) exit $?"
  # 5.24: the five exact families on the chosen backend and two on Flex, each tower on lit-hbp's tower attention
  # beside torch's varlen kernel and Flex (transformers' flash beside flash-attn 2/3)
  PYTHONPATH=/tmp/site_vlm:$PYTHONPATH timeout 150 $PYT tests/test_vision.py >> $OUT/t_vis.log 2>&1; at "vision (5.24) exit $?"
  timeout 150 python3 bench/gpu_proof.py --parts vlm --out $OUT/vlm > /dev/null 2>&1; at "vlm part exit $?"
) &
wait
# Each level alone in every mode, timed alike (one device synchronization per level's window), HF Trainer and
# TRL's BFD compiled as the config compiles lit-hbp's layers (torch_compile)
timeout 300 python3 bench/gpu_throughput.py --config configs/llama_1b_1gpu.yaml --steps 12 --warmup 4 --modes hbp_alone,hf_sdpa,trl_bfd --data.demo_dir=demo_data > $OUT/throughput.log 2>&1
at "throughput exit $?"
# Where a 4K step's time goes outside its forward and backward (82 of 306 ms on the H100, 2026-11-27):
# Lightning's per-hook host times, the 4K level only.
timeout 90 python3 bench/gpu_throughput.py --config configs/llama_1b_1gpu.yaml --steps 12 --warmup 4 --modes hbp \
    --data.demo_dir=demo_data '--data.levels=[{pack_len: 4096}]' --data.over_length=truncate --trainer.profiler=simple \
    > $OUT/profile.log 2>&1
at "profile exit $?"
# The fixed cost per optimizer step on the GPU: Trainer.fit's step beside a bare loop (bf16), 16 layers at width 64.
timeout 60 python3 bench/step_overhead.py --device cuda --layers 16 --rounds 2 > $OUT/step_overhead.log 2>&1
at "step overhead exit $?"
# A hybrid's Mamba2 mixers (Bamba) over SFT-like packs: the documents as a few batches' rows beside one call each.
timeout 60 python3 bench/mixer_batches.py --device cuda --family bamba --docs 64 --pack-len 4096 --steps 4 --warmup 1 \
    --rounds 2 > $OUT/mixer_batches.log 2>&1
at "mixer batches exit $?"
cat $OUT/env.txt
