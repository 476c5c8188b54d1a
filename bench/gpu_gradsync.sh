#!/usr/bin/env bash
# Issue 3 on the 2-GPU machine, in ONE device call (about 4 minutes; every part has its own
# time limit, and the whole stays under the 10-minute limit of one call even if something hangs):
#
#   bash bench/gpu_gradsync.sh        # from the repository root; the baselines in bench/baselines
#
# 1. python -m bench.step all on 2 GPUs: all_reduce bus bandwidth (raw vs GradSync's buckets
#    spread over 1, 2 and 4 communicators, 1 MB ... 1 GB, a synthetic 100M-parameter model per
#    value) and ResNet18-CIFAR images/s at 512 per GPU for single-eager, single-graph, ddp-eager,
#    distlib-eager and distlib-graph (the distlib modes with comm_groups 1 and 2) -> bench.json
#    and the fallback mode (one process, both GPUs)
# 2. the anchors in the same call: rn18_throughput.py MODE=single and MODE=ddp, allreduce_bw.py
# 3. the GPU tests: NCCL equivalence on 2 GPUs, captured step == eager step on 1 and 2 GPUs
#    (on 2 GPUs also with the buckets on 2 communicators)
# 4. anchor/graph_step.py on 2 processes under a hang alarm: where it hangs (see distlib/cuda_graph.py)
# 5. bench/gradsync_report.py: a Markdown summary with the ratios -> gradsync_summary.md
#
# Logs and results go to $OUT (the device tool's output folder; default .bench/out).
set -u
OUT=${OUT:-.bench/out}
ANCHOR=${ANCHOR:-bench/baselines}
mkdir -p "$OUT"
# NVLink multicast stays off on these machines (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node=2"

part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, show the tail
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0)) s"
    grep -v "^W[0-9]* \|OMP_NUM_THREADS\|^\*\*\*\*" "$OUT/$name.log" | tail -n "${TAIL:-40}"
}

{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'; } >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

TAIL=55 part bench 210 $TORCHRUN -m bench.step all --groups 1,2,4 --comm-groups 1,2 \
    --json "$OUT/bench.json" --hang-timeout-s 90
# the fallback mode: one process drives both GPUs
part bench_fallback 50 python3 -m bench.step step --modes fallback --json "$OUT/bench_fallback.json"
part anchor_single 55 env MODE=single BATCH=512 python3 "$ANCHOR/rn18_throughput.py"
part anchor_ddp 65 env MODE=ddp BATCH=512 $TORCHRUN "$ANCHOR/rn18_throughput.py"
part anchor_allreduce_bw 45 $TORCHRUN "$ANCHOR/allreduce_bw.py"
part gpu_tests 120 python3 -m pytest -m gpu tests/test_grad_sync.py -q -p no:cacheprovider
part graph_step_probe 45 env BATCH=512 $TORCHRUN bench/hang_probe.py 32 "$ANCHOR/graph_step.py"
python3 bench/gradsync_report.py "$OUT"
