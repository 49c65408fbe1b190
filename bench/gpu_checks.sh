#!/usr/bin/env bash
# The GPU checks, by part, for one device call or two (a session has 900 s of device time, a machine's start
# about 30 s of it; on the H200 of 2026-11-30 `speed tests+graphs,bench` took 593 s):
#   bash bench/gpu_checks.sh [PART ...]        (default: speed tests bench; `profile` on demand)
#   PARTs joined by + run at once, by , one after the other (`speed tests+graphs,bench`: speed alone, then the
#   tests beside graphs followed by bench; say so beside any figure a part timed while another ran)
#   speed    ~340 s  bench/gpu_throughput.py, the 1B config: lit-hbp (each level alone) beside HF Trainer
#                    padding-free on SDPA and on FlexAttention, decoder layers compiled as lit-hbp's (HF's own
#                    whole-model torch_compile took ~100 s a level on the H200: --peer-compile model)
#   tests    ~240 s  pytest -m gpu in two parts at once: attention and the hybrids' mixers; the rest
#   mixers   ~240 s  pytest -m gpu tests/test_mixers_gpu.py alone: the hybrids' packs on the GPU (issue 55); on the H200
#                    of 2026-12-04 bamba, lfm2, mamba passed in ~20 s and qwen3_next (flash-linear-attention's Triton
#                    kernels compiling) was still running when a 120 s box cut it
#   bench    ~160 s  bench/step_overhead.py (the run's step beside a bare loop), bench/op_overhead.py (the attention
#                    op's host time around torch's varlen kernel) and bench/mixer_batches.py
#   trl      ~250 s  TRL's BFD on the same levels (bench/gpu_throughput.py --modes trl_bfd)
#   vision   ~150 s  the image tests on transformers 5.24 (.whl/vlm/): passed on the H200, 2026-11-29
#   profile  ~100 s  bench/step_profile.py on the 4K level with one pack a step (taken on the H200, 2026-11-29)
#   fa4stage  ~10 s  flash-attn 4, first call: keeps .whl_fa4/a/ (bash bench/fa4_wheels.sh here) on the machine in
#                    .fa4_stage/ (git-ignored, so the next call finds it while the machine is still held); carry
#                    [".whl_fa4/a"] alone, and call `fa4` right after (a machine idle 30 s is taken back)
#   fa4     ~330 s  flash-attn 4, second call (carry [".whl", "demo_data", ".whl_fa4/b"]): installed from both halves,
#                    lit-hbp's reason if it cannot run it, pytest -m gpu of its attention and compiled-op tests, then
#                    bench/gpu_throughput.py's hbp_alone on flash_attn_4 and on torch_varlen in one call (16K MFU;
#                    FA4_BACKENDS=flash_attn_4 for the first alone: ~210 s on the H200 of 2026-12-04). Side by side
#                    with the peers in one call (the 1.5x HF / 1.2x TRL bars; the peers run their own attention):
#                    FA4_BACKENDS=flash_attn_4 FA4_TESTS=0 FA4_MODES=hbp_alone,hf_flex_attention,trl_bfd
#                    FA4_SPEED_S=420 (timeout_s 500)
#   graphs   ~200 s  bench/graph_modes.py: the 1B config's layers at its 4K level, one pack a step, compiled
#                    dynamic (the run's), static and under CUDA graphs (with inductor's graph partitions, which
#                    stopped on the H200 of 2026-11-30, and without): whether one graph per level pays
# Here first: bash bench/gpu_wheels.sh. Device run: carry [".whl", "demo_data"], timeout_s = the parts' sum
# + 40, e.g. `bash bench/gpu_checks.sh trl graphs` (timeout_s 500), then `bash bench/gpu_checks.sh bench`.
# At most eight files come back in $OUT (the device tool returns no more):
#   env.txt         the device, the versions, the timeline (each part's exit status and when it ended)
#   throughput.log  speed and trl: every mode and level, each result printed as it is measured
#   throughput.json speed's table, the memory per level and the attention backends
#   tests.log       tests and vision: pytest -m gpu, each part under a header
#   bench.log       bench's three benchmarks
#   graphs.log      graphs: bench/graph_modes.py's table
#   profile.txt     profile: wall ms a step, each micro-batch's host ms, the device's busy share, waits, compilations
#   trace.json.gz   that profile's trace (Perfetto)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_checks}; mkdir -p "$OUT"
TMP=$(mktemp -d)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
at() { echo "$1 at $(( $(date +%s) - T0 )) s" >> $OUT/env.txt; }
PARTS=${*:-speed tests bench}
for part in ${PARTS//[+,]/ }; do
  case $part in speed|trl|tests|mixers|vision|bench|profile|graphs|fa4stage|fa4) ;; *) echo "unknown part $part (speed, trl, tests, mixers, vision, bench, profile, graphs, fa4stage, fa4)" >&2; exit 2 ;; esac
done
if [ "$PARTS" = fa4stage ]; then  # the first of flash-attn 4's two calls: nothing to install or run yet
  mkdir -p .fa4_stage && cp .whl_fa4/a/* .fa4_stage/ || exit 3
  ls -l .fa4_stage > $OUT/env.txt
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c 'import sys, torch, transformers, lightning, deepspeed; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "lightning", lightning.__version__, "deepspeed", deepspeed.__version__)'
} >> $OUT/env.txt 2>&1
at "install (parts: $PARTS)"
PYT="python3 -m pytest -m gpu -v --tb=short -rfEs -p no:cacheprovider"
THROUGHPUT="python3 bench/gpu_throughput.py --config configs/llama_1b_1gpu.yaml --steps 8 --warmup 4 --data.demo_dir=demo_data"
run_part() {
  local part=$1
  case $part in
  speed)
    timeout 360 $THROUGHPUT --modes hbp_alone,hf_sdpa,hf_flex_attention --json $OUT/throughput.json >> $OUT/throughput.log 2>&1
    at "speed exit $?" ;;
  trl)
    timeout 250 $THROUGHPUT --modes trl_bfd >> $OUT/throughput.log 2>&1
    at "trl exit $?" ;;
  tests)
    ( timeout 240 $PYT tests/test_attention.py tests/test_mixers_gpu.py > $TMP/t_attn.log 2>&1; at "attention and mixers exit $?" ) &
    ( timeout 240 $PYT tests --ignore=tests/test_attention.py --ignore=tests/test_vision.py \
        --ignore=tests/test_mixers_gpu.py > $TMP/t_other.log 2>&1; at "other exit $?" ) &
    wait
    for log in t_attn t_other; do { echo "===== $log.log"; cat $TMP/$log.log; } >> $OUT/tests.log; done ;;
  mixers)
    timeout 240 $PYT tests/test_mixers_gpu.py > $TMP/t_mix.log 2>&1
    at "mixers exit $?"
    { echo "===== t_mix.log"; cat $TMP/t_mix.log; } >> $OUT/tests.log ;;
  vision)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_vlm .whl/vlm/*.whl || exit 3
    PYTHONPATH=/tmp/site_vlm:$PYTHONPATH timeout 150 $PYT tests/test_vision.py > $TMP/t_vis524.log 2>&1
    at "vision (5.24) exit $?"
    { echo "===== t_vis524.log"; cat $TMP/t_vis524.log; } >> $OUT/tests.log ;;
  bench)
    echo "===== step_overhead" >> $OUT/bench.log
    timeout 90 python3 bench/step_overhead.py --device cuda --layers 16 --rounds 2 >> $OUT/bench.log 2>&1
    at "step overhead exit $?"
    echo "===== op_overhead" >> $OUT/bench.log
    timeout 30 python3 bench/op_overhead.py --device cuda --backend torch_varlen --tokens 4096 --calls 500 \
        --rounds 5 >> $OUT/bench.log 2>&1
    echo "===== mixer_batches" >> $OUT/bench.log
    timeout 40 python3 bench/mixer_batches.py --device cuda --family bamba --docs 64 --pack-len 4096 --steps 4 \
        --warmup 1 --rounds 2 >> $OUT/bench.log 2>&1
    at "mixer batches exit $?" ;;
  fa4)
    { echo "===== fa4: install"; bash bench/fa4_install.sh /tmp/site_fa4; } >> $OUT/tests.log 2>&1
    at "fa4 install exit $?"
    export PYTHONPATH=$(cat /tmp/site_fa4/.pythonpath):$PYTHONPATH  # with the folders its .pth files add
    { echo "===== fa4: why_not"; python3 -c 'import torch; from lit_hbp.model.attention.backends import why_not
for dt in (torch.bfloat16, torch.float16): print(dt, why_not("flash_attn_4", "cuda", dt, frozenset()) or "runs")'
    } >> $OUT/tests.log 2>&1
    if [ "${FA4_TESTS:-1}" = 1 ]; then
      timeout 150 $PYT tests/test_attention.py tests/test_compile.py -k "flash_attn_4 and not 16 and not softcap and not sinks" \
          > $TMP/t_fa4.log 2>&1  # each case compiles its own kernels: head dim 64, plain, windowed, all features
      at "fa4 tests exit $?"
      { echo "===== t_fa4.log"; cat $TMP/t_fa4.log; } >> $OUT/tests.log
    fi
    for backend in ${FA4_BACKENDS:-flash_attn_4 torch_varlen}; do
      echo "===== attn_backend $backend" >> $OUT/throughput.log
      timeout ${FA4_SPEED_S:-180} $THROUGHPUT --modes ${FA4_MODES:-hbp_alone} --model.attn_backend=$backend \
          >> $OUT/throughput.log 2>&1
      at "fa4 speed ($backend) exit $?"
    done ;;
  graphs)
    timeout 200 python3 bench/graph_modes.py --device cuda --layers 16 --width 2048 --pack-len 4096 --docs 8 \
        --steps 10 --warmup 4 --rounds 2 >> $OUT/graphs.log 2>&1
    at "graph modes exit $?" ;;
  profile)
    # TORCH_LOGS=recompiles: why the H200's third profiled step compiled the decoder layer again (2026-11-29)
    TORCH_LOGS=recompiles timeout 100 python3 bench/step_profile.py --config configs/llama_1b_1gpu.yaml --level 4096 \
        --steps 3 --warmup 4 --out $OUT --data.demo_dir=demo_data \
        '--data.levels=[{pack_len: 4096, sp: 1}, {pack_len: 16384, sp: 1}]' > $TMP/profile_run.log 2>&1
    at "profile exit $?"
    [ -f $OUT/profile.txt ] || tail -40 $TMP/profile_run.log > $OUT/profile.txt
    { echo; echo "recompilations (TORCH_LOGS=recompiles):"; grep -A4 "Recompiling" $TMP/profile_run.log | head -60; } \
        >> $OUT/profile.txt ;;
  esac
}
for group in $PARTS; do
  for member in ${group//+/ }; do ( for part in ${member//,/ }; do run_part $part; done ) & done
  wait
done
rm -rf "$TMP"
cat $OUT/env.txt
grep -h "^measured\|^memory of" $OUT/throughput.log 2>/dev/null
