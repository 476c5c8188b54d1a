#!/usr/bin/env bash
# The flagship timeline: start-up and end-to-end time of a recipe run, timed from outside, on one machine:
#   the floor (torchrun of bench/floor.py: import torch, process group, one all_reduce),
#   the flagship with a cold decode cache (the first decode of the JPEGs), then with the warm cache,
#   three seeds in all where the time budget allows, then (COLD_AGAIN=1) once more with the cache
#   emptied, on a machine whose libraries are now in the page cache (the decode alone),
#   and the import cost of launch.py and torchvision.
# Usage: bench/flagship.sh DATA_ROOT [OUT_DIR]     (OUT_DIR default: $OUT, else .bench/flagship)
# Env: RECIPE (recipes/cifar.yaml), NPROC (2), SEEDS ("0 1 2"), BUDGET_S (300: no new run starts after it),
#      COLD (1; 0: keep the cache of an earlier call, no floor and no cold run), COLD_AGAIN (0), TAG (run-name prefix),
#      RUN_TIMEOUT_S (150 per run), EXTRA (more key=value overrides), PYTHON, TORCHRUN,
#      WORK (/tmp/distlib-flagship: the runs' out_dirs with their checkpoints, and the decode caches).
# Writes OUT_DIR/logs/*.log, OUT_DIR/runs/<name>/{summary.json,metrics.jsonl}, OUT_DIR/results.json; prints a table.
set -u
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0; fi
DATA=${1:?usage: bench/flagship.sh DATA_ROOT [OUT_DIR]}
OUT_DIR=${2:-${OUT:-.bench/flagship}}
RECIPE=${RECIPE:-recipes/cifar.yaml}
NPROC=${NPROC:-2}
SEEDS=${SEEDS:-0 1 2}
BUDGET_S=${BUDGET_S:-300}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=${WORK:-/tmp/distlib-flagship}
mkdir -p "$OUT_DIR/logs" "$OUT_DIR/runs" "$WORK/runs"
RESULTS="$OUT_DIR/results.jsonl"
COLD=${COLD:-1}
TAG=${TAG:-}
CACHE="$WORK/cache"  # the decode cache of these runs only: the first flagship run finds it empty
if [ "$COLD" = 1 ]; then
  : >"$RESULTS"
  rm -rf "$CACHE" "$WORK/runs"/* "$OUT_DIR/runs"/*
fi
T0=$(date +%s.%N)

now() { date +%s.%N; }
left() { "$PYTHON" -c "import sys; print(int(float(sys.argv[1]) - (float(sys.argv[2]) - float(sys.argv[3]))))" \
  "$BUDGET_S" "$(now)" "$T0"; }

# run NAME KIND SEED CMD...: time CMD from outside, record one JSON line
run() {
  local name=$1 kind=$2 seed=$3
  shift 3
  if [ "$(left)" -le 0 ]; then
    echo "skipped $name: time budget of ${BUDGET_S}s spent" | tee -a "$OUT_DIR/logs/skipped.log"
    return
  fi
  local t1 t2 rc
  t1=$(now)
  timeout -k 10 "$RUN_TIMEOUT_S" "$@" >"$OUT_DIR/logs/$name.log" 2>&1
  rc=$?
  t2=$(now)
  "$PYTHON" bench/flagship_table.py record --name "$name" --kind "$kind" --seed "$seed" --rc "$rc" \
    --wall "$t1" "$t2" --log "$OUT_DIR/logs/$name.log" --run-dir "$WORK/runs/$name" >>"$RESULTS"
  if [ -d "$WORK/runs/$name" ]; then  # the small files only: checkpoints stay in $WORK
    mkdir -p "$OUT_DIR/runs/$name"
    cp "$WORK/runs/$name"/*.json "$WORK/runs/$name"/metrics.jsonl "$OUT_DIR/runs/$name/" 2>/dev/null
  fi
  echo "$name: rc=$rc $("$PYTHON" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}s')" "$t1" "$t2")"
}

flagship() {  # flagship NAME KIND SEED
  run "$1" "$2" "$3" "$TORCHRUN" --standalone --nproc-per-node="$NPROC" launch.py "$RECIPE" "data.root=$DATA" \
    "data.cache_dir=$CACHE" "run.out_dir=$WORK/runs/$1" "train.seed=$3" run.resume=false run.progress=plain ${EXTRA:-}
}

if [ "$COLD" = 1 ]; then
  run floor-1 floor - "$TORCHRUN" --standalone --nproc-per-node="$NPROC" bench/floor.py
  run floor-2 floor - "$TORCHRUN" --standalone --nproc-per-node="$NPROC" bench/floor.py
fi
first=$COLD
for seed in $SEEDS; do
  if [ "$first" = 1 ]; then
    flagship "${TAG}cold-s$seed" cold "$seed"  # decodes the JPEGs and writes the cache
    first=0
  fi
  flagship "${TAG}warm-s$seed" warm "$seed"
done
if [ "${COLD_AGAIN:-0}" = 1 ]; then  # the first decode again, now that the machine's files are cached
  rm -rf "$CACHE"
  flagship "${TAG}cold2-s0" cold2 0
fi
if [ "$COLD" = 1 ]; then
  # import costs in fresh processes (one process each, so that each one pays for the file system)
  run imports - - "$PYTHON" -c "
import time; t = time.time()
import torch; t1 = time.time()
import launch; t2 = time.time()
import torchvision; t3 = time.time()
import matplotlib.pyplot; t4 = time.time()
print(f'IMPORTS torch {t1 - t:.2f}s launch-after-torch {t2 - t1:.2f}s torchvision-after-launch {t3 - t2:.2f}s '
      f'matplotlib {t4 - t3:.2f}s')"
  grep -h IMPORTS "$OUT_DIR/logs/imports.log"
fi
sleep 2  # the curves are drawn by a detached process after each run's exit
"$PYTHON" bench/flagship_table.py table "$RESULTS" --runs "$WORK/runs" --json "$OUT_DIR/results.json"
