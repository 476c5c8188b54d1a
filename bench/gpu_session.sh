#!/usr/bin/env bash
# One session on the GPU machine (one process per GPU; 2 GPUs for the step part), in parts that each fit one command (PARTS, space-separated):
#   tests     the whole GPU suite: pytest -m gpu
#   step      ResNet18-CIFAR images/s at 512 per GPU: DDP eager, DDP + compile (default and
#             reduce-overhead), GradSync eager / whole-step graph with 1, 2 and 4 communicators,
#             GradSync + compile_for_sync eager and inside the whole-step graph; STEP_BEFORE=1 adds the
#             eager GradSync step of the code in $BEFORE (an older checkout), side by side
#   flagship  bench/flagship.sh (floor, cold and warm flagship runs, summary.json) for cifar.yaml,
#             cifar_accuracy.yaml and cifar.yaml + EMA, the hand-written DDP baseline; BEFORE_RUNS=1
#             adds the same flagship command on the code in $BEFORE (cold and warm)
#   startup   the flagship cold and warm, without cuDNN autotuning, with train.compile; the step
#             with and without cuDNN autotuning
#   sweep     bench/recipe_sweep.sh (recipe candidates), when it exists
# BYTECODE_CACHE=1: keep Python bytecode in /tmp/pycache (the GPU machine forbids writing it; docs/startup.md).
# Needs the CIFAR-10 JPEG archive at $DATA (default .bench/cifar10-jpeg.tar.gz). Logs land in $OUT
# (at most 8 files come back from the machine: the many small ones are packed into one .tgz per part).
set -u
PARTS=${PARTS:-tests step}
OUT=${OUT:-.bench/out}
DATA=${DATA:-.bench/cifar10-jpeg.tar.gz}
BEFORE=${BEFORE:-.bench/before}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "${BYTECODE_CACHE:-0}" = 1 ]; then  # a bytecode cache for every command, the floor's too (docs/startup.md)
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=/tmp/pycache
fi
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c GPU)}  # one process per GPU
export NPROC
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node=$NPROC"
T0=$SECONDS
summary="$OUT/summary.txt"

lim() {  # lim NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, note the outcome
    local name=$1 limit=$2 t=$SECONDS rc
    shift 2
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t))" | tee -a "$summary"
}

{ nvidia-smi -L; python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision",
  torchvision.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'; } | tee -a "$summary"
# the commit sent (write it to .bench/COMMIT before the call: the device copy's .git may be stale)
echo "commit $(cat .bench/COMMIT 2>/dev/null || git rev-parse --short HEAD)" | tee -a "$summary"

for part in $PARTS; do
    case $part in
    tests)
        lim gpu_tests "${TESTS_S:-540}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=15 tests
        tail -n 25 "$OUT/gpu_tests.log"
        ;;
    step)
        if [ "${STEP_BEFORE:-0}" = 1 ]; then
            (cd "$BEFORE" && lim step_before 90 $TORCHRUN -m distlib.bench step --modes ddp-eager,distlib-eager)
        fi
        lim step_new "${STEP_S:-240}" $TORCHRUN -m bench.step step \
            --modes ddp-eager,ddp-compile,single-graph,distlib-eager,distlib-graph --comm-groups "${COMM_GROUPS:-1,2,4}" \
            --json "$OUT/step_new.json"
        # torch.compile's kernels: eager, and replayed inside distlib's whole-step graph; DDP reduce-overhead again
        lim step_compile "${COMPILE_S:-300}" $TORCHRUN -m bench.step step \
            --modes ddp-eager,ddp-compile,distlib-compile-graph,single-compile-graph,distlib-compile,ddp-compile-default \
            --json "$OUT/step_compile.json"
        for f in step_before step_new step_compile; do [ -f "$OUT/$f.log" ] && echo "== $f" && tail -n 22 "$OUT/$f.log"; done
        ;;
    flagship)
        abs_data=$(realpath "$DATA")
        # cifar.yaml: the floor, the first (cold) run, three warm seeds, the cold run again (decode only)
        lim flagship "${FLAGSHIP_S:-270}" env BUDGET_S=210 COLD_AGAIN=1 bash bench/flagship.sh "$DATA" /tmp/flagship
        lim baseline_ddp_cifar 90 env TAR="$abs_data" EPOCHS=18 BATCH=256 $TORCHRUN bench/baselines/ddp_cifar.py
        # the accuracy recipe, then cifar.yaml with the weight EMA, three seeds each, on the warm cache
        lim accuracy 200 env COLD=0 TAG=acc- RECIPE=recipes/cifar_accuracy.yaml BUDGET_S=140 \
            bash bench/flagship.sh "$DATA" /tmp/flagship
        lim ema "${EMA_S:-110}" env COLD=0 TAG=ema- EXTRA=train.ema=0.99 BUDGET_S=70 bash bench/flagship.sh "$DATA" /tmp/flagship
        if [ "${BEFORE_RUNS:-0}" = 1 ]; then
            rm -rf /tmp/before-cache /tmp/before-runs
            (cd "$BEFORE" && lim before_cold 120 $TORCHRUN launch.py recipes/cifar.yaml \
                "data.root=$abs_data" data.cache_dir=/tmp/before-cache run.out_dir=/tmp/before-runs/cold run.progress=plain)
            (cd "$BEFORE" && lim before_warm 90 $TORCHRUN launch.py recipes/cifar.yaml \
                "data.root=$abs_data" data.cache_dir=/tmp/before-cache run.out_dir=/tmp/before-runs/warm run.progress=plain)
        fi
        tail -n 40 "$OUT/ema.log"
        grep -h "test acc\|test_acc\|RESULT" "$OUT/baseline_ddp_cifar.log" | tail -n 4
        tar -czf "$OUT/flagship_runs.tgz" -C /tmp flagship before-runs 2>/dev/null
        ;;
    startup)
        # what start-up costs: the flagship cold and warm; without cuDNN autotuning; with train.compile
        # (its first run compiles with an empty inductor cache, the second finds it); the step with and
        # without autotuning
        lim startup "${STARTUP_S:-330}" bash -c '
            BUDGET_S=100 SEEDS="0 1" bash bench/flagship.sh "$1" /tmp/flagship
            COLD=0 TAG=nobench- SEEDS=0 EXTRA=train.cudnn_benchmark=false bash bench/flagship.sh "$1" /tmp/flagship
            COLD=0 TAG=compile- SEEDS="0 1" EXTRA=train.compile=true RUN_TIMEOUT_S=150 bash bench/flagship.sh "$1" /tmp/flagship' \
            _ "$DATA"
        lim step_cudnn 100 bash -c "$TORCHRUN -m bench.step step --modes single-graph,distlib-graph --steps 100 &&
            $TORCHRUN -m bench.step step --modes single-graph,distlib-graph --steps 100 --no-cudnn-benchmark"
        python3 -c "import os, torch; d = os.path.dirname(torch.__file__)
print('bytecode cached next to torch._dynamo:', os.path.isdir(os.path.join(d, '_dynamo', '__pycache__')),
      '; site-packages writable:', os.access(d, os.W_OK))"
        tail -n 30 "$OUT/startup.log"
        grep -A4 "^mode" "$OUT/step_cudnn.log"
        tar -czf "$OUT/startup_runs.tgz" -C /tmp flagship 2>/dev/null
        ;;
    sweep)
        [ -f bench/recipe_sweep.sh ] && lim sweep 330 bash bench/recipe_sweep.sh "$DATA" && tail -n 12 "$OUT/sweep.log"
        ;;
    esac
done
echo "== session parts done in $((SECONDS - T0)) s"
cat "$summary"
