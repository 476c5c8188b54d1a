"""The start-up floor of any torchrun job: import torch, form the process group, one
all_reduce, tear down, exit. ``torchrun --standalone --nproc-per-node=N bench/floor.py``.

NCCL (with ``device_id``, as distlib does) when CUDA is available, gloo otherwise. Rank 0
prints one JSON line: seconds from its process start (from /proc) to each stage.
"""

import json
import os
import time


def _process_start() -> float:
    with open("/proc/self/stat") as f:
        stat = f.read()
    ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime in clock ticks after boot
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def main() -> None:
    start = _process_start()
    stamps = {"python_start": time.time() - start}
    import torch
    import torch.distributed as dist

    stamps["import_torch"] = time.time() - start
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    kwargs = {}
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the CUDA context
        stamps["cuda_context"] = time.time() - start
        kwargs = {"backend": "nccl", "device_id": device}
    else:
        device = torch.device("cpu")
        kwargs = {"backend": "gloo"}
    dist.init_process_group(**kwargs)
    stamps["init_process_group"] = time.time() - start
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    assert x.item() == dist.get_world_size()
    stamps["first_all_reduce"] = time.time() - start
    dist.destroy_process_group()
    stamps["destroy"] = time.time() - start
    if rank == 0:
        print(json.dumps({"floor": {k: round(v, 3) for k, v in stamps.items()}}), flush=True)


if __name__ == "__main__":
    main()
