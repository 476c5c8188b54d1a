#!/usr/bin/env bash
# Issue 5 in one device call on the 2-GPU machine: the recipes over seeds on 2 GPUs and 1 GPU,
# and the baseline bench/baselines/ddp_cifar.py in the same call. Data: .bench/cifar10-jpeg.tar.gz (carried).
# Results: $OUT/cifar2.json, $OUT/cifar1.json, $OUT/anchor_ddp_cifar.log; a table is printed last.
set -u
OUT=${OUT:-.bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DATA=.bench/cifar10-jpeg.tar.gz
SEEDS=${SEEDS:-0 1 2}
timeout -k 10 ${T2:-330} python3 bench/cifar_runs.py --nproc 2 --data $DATA --out /tmp/runs2 --json "$OUT/cifar2.json" \
  ${RUNS2:---run "fast:recipes/cifar.yaml" --run "accuracy:recipes/cifar_accuracy.yaml"} --seeds $SEEDS >"$OUT/cifar2.log" 2>&1
timeout -k 10 ${T1:-60} python3 bench/cifar_runs.py --nproc 1 --data $DATA --out /tmp/runs1 --json "$OUT/cifar1.json" \
  --run "fast:recipes/cifar.yaml" --seeds 0 >"$OUT/cifar1.log" 2>&1
(cd bench/baselines && TAR=../../.bench/cifar10-jpeg.tar.gz EPOCHS=18 BATCH=256 timeout -k 10 ${TA:-90} \
  torchrun --nproc-per-node=2 ddp_cifar.py >"$OUT/anchor_ddp_cifar.log" 2>&1)
grep RESULT "$OUT/anchor_ddp_cifar.log"
tail -n 12 "$OUT/cifar2.log"; tail -n 3 "$OUT/cifar1.log"
