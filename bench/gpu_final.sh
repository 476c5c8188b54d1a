#!/usr/bin/env bash
# The closing device call on the 2-GPU machine (about 7 minutes): the CIFAR recipes over seeds
# with the anchor (bench/gpu_cifar.sh), the GPU tests of GradSync and of the fallback mode's
# node paths, and GradSync's all_reduce bandwidth with 1, 2 and 4 communicators.
# At most 8 files land in $OUT (the device tool's limit).
set -u
OUT=${OUT:-.bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash bench/gpu_cifar.sh
timeout -k 10 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/library/test_grad_sync.py \
  "tests/library/test_comm_fallback_gpu.py::test_two_nodes_match_one_node_with_two_gpus" >"$OUT/gpu_tests.log" 2>&1
timeout -k 10 70 python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m bench.step allreduce \
  --groups 1,2,4 --json "$OUT/ar.json" >"$OUT/ar.log" 2>&1
echo "--- gpu tests"; tail -n 4 "$OUT/gpu_tests.log"
echo "--- allreduce"; grep -v "^W[0-9]* \|OMP_NUM\|^\*\*\*" "$OUT/ar.log" | tail -n 30
