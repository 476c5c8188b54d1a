#!/usr/bin/env bash
# One session on the 2-GPU machine: GradSync (bench/gpu_gradsync.sh), the fallback mode (tests
# and bench/fallback_bench.py), the other GPU tests, and one graph-mode CIFAR run. Every part has
# its own time limit; all logs are packed into $OUT/logs.tgz, a summary is printed last.
set -u
FINAL_OUT=${OUT:-.bench/out}
export OUT=/tmp/gpu_call
mkdir -p "$OUT" "$FINAL_OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
lim() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout -k 10 "$l" "$@" >"$OUT/$n.log" 2>&1; echo "=== $n: exit $? after $((SECONDS - t0)) s"; }
PARTS=${PARTS:-gradsync fallback tests cifar}
for p in $PARTS; do
  case $p in
    gradsync) TAIL=0 bash bench/gpu_gradsync.sh >"$OUT/gradsync_all.log" 2>&1; echo "=== gradsync done" ;;
    fallback)
      lim fallback_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/library/test_comm_fallback_gpu.py tests/library/test_example_dataparallel_to_fallback.py
      lim fallback_bench 200 python3 bench/fallback_bench.py --anchor bench/baselines --json "$OUT/fallback_bench.json" ;;
    tests) lim other_gpu_tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests --ignore=tests/library/test_comm_fallback_gpu.py --ignore=tests/library/test_example_dataparallel_to_fallback.py --ignore=tests/library/test_grad_sync.py ;;
    cifar) lim cifar 240 python3 bench/cifar_runs.py --nproc 2 --data .bench/cifar10-jpeg.tar.gz --out "$OUT/runs" --json "$OUT/cifar.json" ${CIFAR_RUNS:---run "graph:recipes/cifar.yaml train.cuda_graph=true train.eval_every=6"} ;;
  esac
done
tar -C "$OUT" -czf "$FINAL_OUT/logs.tgz" .
for f in fallback_tests other_gpu_tests; do [ -f "$OUT/$f.log" ] && { echo "--- $f"; tail -n 15 "$OUT/$f.log"; }; done
[ -f "$OUT/fallback_bench.log" ] && { echo "--- fallback_bench"; tail -n 40 "$OUT/fallback_bench.log"; }
[ -f "$OUT/gradsync_all.log" ] && { echo "--- gradsync"; grep -v "^W[0-9]* \|OMP_NUM\|^\*\*\*" "$OUT/gradsync_all.log" | tail -n 70; }
[ -f "$OUT/cifar.log" ] && { echo "--- cifar"; tail -n 8 "$OUT/cifar.log"; }
