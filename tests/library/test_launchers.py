"""Launchers other than torchrun: srun, a Kubeflow PyTorchJob, mpirun; SLURM's host lists; the refusals."""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch

import distlib
from distlib.distributed.launchers import detect, expand_hostlist, expand_tasks_per_node, slurm_port
from distlib.distributed.process_group import EnvError, EnvInfo, _gpu_index
from tests.conftest import ROOT, free_port, run_ranks

# ---- SLURM's compressed lists -----------------------------------------------------------------


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("localhost", ["localhost"]),
        ("a,b", ["a", "b"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # the padding of the range's start
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),  # several groups multiply
        ("x-[1-2].lan,y", ["x-1.lan", "x-2.lan", "y"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist, message",
    [
        ("gpu[01-04", "unclosed '['"),
        ("gpu01]", "']' without '['"),
        ("gpu[1-[2]]", "nested '['"),
        ("gpu[4-1]", "range 4-1 runs backwards"),
        ("gpu[a-b]", "'a-b' in [a-b] is not a number or a range"),
        ("a,,b", "empty host name"),
    ],
)
def test_malformed_hostlist_is_named(hostlist, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(err.value)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert expand_tasks_per_node("2") == [2]
    with pytest.raises(EnvError, match=r"'4\(2\)' is not a count or count\(xN\)"):
        expand_tasks_per_node("4(2)")


def test_slurm_port():
    ports = {slurm_port(job, step) for job in range(123000, 123100) for step in range(3)}
    assert len(ports) == 300  # consecutive jobs and the steps of a job all differ
    assert all(20000 <= p < 30000 for p in ports)
    assert slurm_port(987654, 2) == slurm_port(987654, 2)


# ---- which launcher ---------------------------------------------------------------------------


def srun_env(rank: int, *, world: int = 8, per_node: int = 4, **extra: str) -> dict[str, str]:
    """What srun sets for task ``rank`` of an sbatch job with --nodes=2 --ntasks-per-node=4."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURMD_NODENAME": f"gpu0{7 + rank // per_node}",
    }
    return {**env, **extra}


def fields(info: EnvInfo) -> tuple:
    return info.launcher, info.rank, info.local_rank, info.world_size, info.local_world_size


def test_srun():
    info = detect(srun_env(5))
    assert fields(info) == ("srun", 5, 1, 8, 4)
    assert (info.master_addr, info.master_port) == ("gpu07", slurm_port(4242, 0))
    assert detect(srun_env(0)).master_addr == "gpu07"
    moved = detect(srun_env(5, MASTER_ADDR="10.0.0.1", MASTER_PORT="29999"))  # exported in the batch script
    assert (moved.master_addr, moved.master_port) == ("10.0.0.1", 29999)


def test_srun_port_follows_the_step_id():
    # two srun steps of one job at once (two trainings in one allocation): each its own port; the
    # default fixture's step 0 cannot tell the derivation from one that ignores the step
    ports = {step: detect(srun_env(5, SLURM_STEP_ID=str(step))).master_port for step in (0, 1, 3)}
    assert ports == {step: slurm_port(4242, step) for step in (0, 1, 3)}
    assert len(set(ports.values())) == 3
    assert detect(srun_env(5, SLURM_STEP_ID="batch")).master_port == slurm_port(4242, 0)  # not a number: step 0


def test_srun_uneven_tasks_per_node():
    env = srun_env(2, world=3, SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_NODEID="1", SLURM_LOCALID="0")
    assert fields(detect(env)) == ("srun", 2, 0, 3, 1)
    env = srun_env(1, world=3, SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_NODEID="0", SLURM_LOCALID="1")
    assert fields(detect(env)) == ("srun", 1, 1, 3, 2)


def test_a_step_smaller_than_the_job_ignores_the_jobs_tasks_per_node():
    # srun --ntasks-per-node=1 in a job of 4 per node, without SLURM_STEP_TASKS_PER_NODE: the job's
    # SLURM_TASKS_PER_NODE (8 tasks in all) does not describe this step of 2, SLURM_NTASKS_PER_NODE does
    env = srun_env(1, world=2, per_node=1, SLURM_TASKS_PER_NODE="4(x2)")
    del env["SLURM_STEP_TASKS_PER_NODE"]
    assert fields(detect(env)) == ("srun", 1, 0, 2, 1)


def test_one_srun_task_is_world_size_1():
    info = detect(srun_env(0, world=1, per_node=1))
    assert fields(info) == ("srun", 0, 0, 1, 1) and info.master_addr is None


TORCHRUN_WORKER = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "gpu07",
    "MASTER_PORT": "29400",
}


def test_torchrun_wins_over_the_surrounding_slurm_job():
    # `srun torchrun --nnodes=2 --nproc-per-node=4`: one srun task per node, torchrun's workers below
    step = srun_env(1, world=2, per_node=1)
    assert fields(detect({**step, **TORCHRUN_WORKER})) == ("torchrun", 5, 1, 8, 4)
    # torchrun in the batch script itself (no srun): the job's SLURM_NTASKS=8, no step
    batch = {k: v for k, v in srun_env(0).items() if not k.startswith("SLURM_STEP")}
    assert fields(detect({**batch, **TORCHRUN_WORKER})) == ("torchrun", 5, 1, 8, 4)


def test_python_in_the_batch_script_of_several_tasks_is_refused():
    batch = {k: v for k, v in srun_env(0).items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(EnvError) as err:
        detect(batch)
    msg = str(err.value)
    assert "SLURM_NTASKS=8 but this process was not started by srun (SLURM_STEP_NUM_TASKS is missing)" in msg
    assert "`srun python train.py`" in msg
    assert detect({**batch, "SLURM_NTASKS": "1"}) is None  # one task: this process is the whole job


@pytest.mark.parametrize("key", ["SLURM_PROCID", "SLURM_LOCALID"])
def test_srun_without_its_rank_is_refused(key):
    env = srun_env(1)
    del env[key]
    with pytest.raises(EnvError, match=rf"{key} is missing; start the processes with `srun python train.py`"):
        detect(env)


def test_srun_without_node_list_or_job_id_names_the_override():
    env = {k: v for k, v in srun_env(1).items() if "NODELIST" not in k}
    with pytest.raises(EnvError, match=r"SLURM_STEP_NODELIST is missing.*set MASTER_ADDR"):
        detect(env)
    assert detect({**env, "MASTER_ADDR": "h"}).master_addr == "h"
    env = {k: v for k, v in srun_env(1).items() if k != "SLURM_JOB_ID"}
    with pytest.raises(EnvError, match=r"SLURM_JOB_ID is missing.*set MASTER_PORT"):
        detect(env)


def test_srun_rank_0_elsewhere_than_the_first_host_is_refused():
    with pytest.raises(EnvError, match=r"rank 0 runs on gpu08 but the first host of .* is gpu07; set MASTER_ADDR"):
        detect(srun_env(0, SLURMD_NODENAME="gpu08"))


def test_srun_bad_values():
    with pytest.raises(EnvError, match=r"^SLURM_PROCID='x' is not an integer$"):
        detect(srun_env(0, SLURM_PROCID="x"))
    with pytest.raises(EnvError, match=r"SLURM_PROCID=8 must be in \[0, SLURM_STEP_NUM_TASKS=8\)"):
        detect(srun_env(0, SLURM_PROCID="8"))
    with pytest.raises(EnvError, match=r"SLURM_STEP_NODELIST: unclosed '\['.*set MASTER_ADDR"):
        detect(srun_env(1, SLURM_STEP_NODELIST="gpu[07-08"))


PYTORCHJOB = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


def test_pytorchjob():
    info = detect(PYTORCHJOB)
    assert fields(info) == ("pytorchjob", 2, 0, 3, 1)
    assert (info.master_addr, info.master_port) == ("job-master-0", 23456)
    # several processes per pod, started by the user's own script with LOCAL_WORLD_SIZE
    assert fields(detect({**PYTORCHJOB, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}))[1:] == (3, 1, 4, 2)
    with pytest.raises(EnvError, match=r"LOCAL_WORLD_SIZE=2 must be >= 1 and divide WORLD_SIZE=3"):
        detect({**PYTORCHJOB, "LOCAL_WORLD_SIZE": "2"})
    assert detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "1"}).world_size == 3


def test_pytorchjob_with_several_processes_per_pod_needs_torchrun():
    with pytest.raises(EnvError) as err:
        detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"})
    assert "PET_NPROC_PER_NODE=4" in str(err.value) and "torchrun" in str(err.value)


def test_pytorchjob_without_master_is_half_set():
    with pytest.raises(EnvError) as err:
        detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    msg = str(err.value)
    assert "MASTER_PORT missing" in msg and "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT" in msg


def ompi(rank: int, world: int, local_rank: int, local_world: int, **extra: str) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_world),
        **extra,
    }


def test_mpirun_on_one_node():
    info = detect(ompi(1, 4, 1, 4))
    assert fields(info) == ("mpirun", 1, 1, 4, 4)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 29500)
    derived = detect(ompi(1, 4, 1, 4, OMPI_MCA_ess_base_jobid="3416981505")).master_port
    assert (
        20000 <= derived < 30000
        and derived == detect(ompi(3, 4, 3, 4, OMPI_MCA_ess_base_jobid="3416981505")).master_port
    )


def test_mpirun_port_from_open_mpi_5s_pmix_namespace():
    # Open MPI 5 names the job in PMIX_NAMESPACE (no OMPI_MCA_ess_base_jobid): every rank derives the
    # same port from it, another job another port, and neither is the fixed default
    ports = [detect(ompi(r, 4, r, 4, PMIX_NAMESPACE="prterun-gpu07-12345@1")).master_port for r in range(4)]
    other = detect(ompi(0, 4, 0, 4, PMIX_NAMESPACE="prterun-gpu07-12399@1")).master_port
    assert len(set(ports)) == 1 and 20000 <= ports[0] < 30000
    assert ports[0] != other and 29500 not in (ports[0], other)


def test_mpirun_on_several_nodes_needs_master_addr():
    with pytest.raises(EnvError) as err:
        detect(ompi(5, 8, 1, 4))
    msg = str(err.value)
    assert "more than one node (OMPI_COMM_WORLD_LOCAL_SIZE=4)" in msg and "MASTER_ADDR is not set" in msg
    assert "mpirun -x MASTER_ADDR=" in msg
    info = detect(ompi(5, 8, 1, 4, MASTER_ADDR="gpu07", MASTER_PORT="29400"))
    assert fields(info) == ("mpirun", 5, 1, 8, 4) and (info.master_addr, info.master_port) == ("gpu07", 29400)


def test_mpirun_half_set_names_what_is_missing():
    env = ompi(0, 2, 0, 2)
    del env["OMPI_COMM_WORLD_LOCAL_SIZE"]
    with pytest.raises(EnvError, match=r"OMPI_COMM_WORLD_LOCAL_SIZE missing; start with `mpirun -np N"):
        detect(env)


def test_mpirun_out_of_range_names_open_mpis_variables():
    with pytest.raises(EnvError) as err:
        detect(ompi(4, 4, 0, 4))
    assert str(err.value) == "OMPI_COMM_WORLD_RANK=4 must be in [0, OMPI_COMM_WORLD_SIZE=4)"
    with pytest.raises(EnvError) as err:
        detect(ompi(0, 2, 0, 4))
    assert str(err.value) == "OMPI_COMM_WORLD_LOCAL_SIZE=4 must be <= OMPI_COMM_WORLD_SIZE=2"


def test_mpirun_inside_a_slurm_job():
    # mpirun starts one daemon per node with srun: the ranks inherit the daemons' step variables
    daemons = srun_env(0, world=2, per_node=1)
    assert fields(detect({**daemons, **ompi(1, 8, 1, 4, MASTER_ADDR="gpu07")})) == ("mpirun", 1, 1, 8, 4)
    assert fields(detect({**daemons, **ompi(0, 8, 0, 4, MASTER_ADDR="gpu07")})) == ("mpirun", 0, 0, 8, 4)


def test_mpich_pmi():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h"}
    assert fields(detect(env)) == ("mpirun", 3, 1, 4, 2)
    with pytest.raises(EnvError, match=r"PMI_SIZE=4 but MPI_LOCALRANKID and MPI_LOCALNRANKS, .* are missing"):
        detect({"PMI_RANK": "3", "PMI_SIZE": "4"})
    # srun --mpi=pmi2 sets PMI_* for the same ranks as srun's: srun's variables (and host list) serve
    assert fields(detect({**srun_env(5), "PMI_RANK": "5", "PMI_SIZE": "8"})) == ("srun", 5, 1, 8, 4)


def test_nothing_and_master_alone():
    assert detect({}) is None
    assert detect({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}) is None
    with pytest.raises(EnvError, match=r"MASTER_PORT present but RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR missing"):
        detect({"MASTER_PORT": "1"})


def test_gpu_of_each_process():
    info = detect(srun_env(5))  # local rank 1 of 4 tasks on its node
    assert _gpu_index(info, 4, 1, {}) == 1
    assert _gpu_index(info, 1, 1, {"SLURM_GPUS_PER_TASK": "1"}) == 0  # srun hid the other tasks' GPUs
    with pytest.raises(EnvError, match=r"4 processes on this node but only 2 GPU\(s\) visible; start 2 or fewer per "):
        _gpu_index(info, 2, 1, {})
    with pytest.raises(EnvError, match=r"\(--ntasks-per-node\)"):
        _gpu_index(info, 1, 1, {})
    with pytest.raises(EnvError, match=r"\(--nproc-per-node\)"):
        _gpu_index(detect(TORCHRUN_WORKER), 1, 1, {"SLURM_GPUS_PER_TASK": "1"})
    assert _gpu_index(detect(TORCHRUN_WORKER), 1, 2, {}) == 1  # one process drives several GPUs: no check


# ---- real two-process starts without torchrun -------------------------------------------------


def _one_world(ctx) -> dict:
    """What a rank started by the launcher under test sees (run_ranks has called distlib.init)."""
    t = torch.tensor([float(ctx.rank + 1)])
    distlib.all_reduce(t)
    return {"rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
            "local_world_size": ctx.local_world_size, "backend": ctx.backend, "sum": t.item(),
            "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]}  # fmt: skip


LAUNCHER_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "PET_", "TORCHELASTIC_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_slurm_job_id() -> int:
    """A job id whose derived port is free here, so the test exercises the derivation."""
    base = free_port()  # a varying start
    return next(job for job in range(base, base + 1000) if _port_is_free(slurm_port(job, 0)))


def _launcher_envs(launcher: str) -> tuple[list[dict[str, str]], list[tuple[int, int]], tuple[str, int]]:
    """Each process's variables, the expected (local rank, local world size), and the rendezvous."""
    if launcher == "srun":  # two nodes of one task each: 127.0.0.1 and 127.0.0.2 are both this machine
        job = _free_slurm_job_id()
        common = {
            "SLURM_JOB_ID": str(job),
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
        }
        envs = [
            {**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": "0", "SLURM_NODEID": str(r),
             "SLURMD_NODENAME": f"127.0.0.{r + 1}"}
            for r in range(2)
        ]  # fmt: skip
        return envs, [(0, 1), (0, 1)], ("127.0.0.1", slurm_port(job, 0))
    port = free_port()
    if launcher == "pytorchjob":  # one process per pod
        common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return [{**common, "RANK": str(r)} for r in range(2)], [(0, 1), (0, 1)], ("127.0.0.1", port)
    assert launcher == "mpirun"  # one node: the rendezvous at 127.0.0.1 needs no MASTER_ADDR
    envs = [ompi(r, 2, r, 2, MASTER_PORT=str(port)) for r in range(2)]
    return envs, [(0, 2), (1, 2)], ("127.0.0.1", port)


@pytest.mark.parametrize("launcher", ["srun", "pytorchjob", "mpirun"])
def test_two_processes_form_one_world(launcher):
    envs, local, (addr, port) = _launcher_envs(launcher)
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)  # this test may itself run under SLURM
    }
    base.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    # two processes with only the launcher's variables (no torchrun's), each calling distlib.init("gloo")
    outputs = run_ranks(_one_world, 2, rank_envs=[{**base, **env} for env in envs], timeout=180)
    for r, (out, (local_rank, local_world)) in enumerate(zip(outputs, local)):
        assert out["rank"] == r and out["world_size"] == 2 and out["backend"] == "gloo"
        assert (out["local_rank"], out["local_world_size"]) == (local_rank, local_world)
        assert out["sum"] == 3.0  # 1 + 2: one world, not two worlds of size 1
        assert out["master"] == [addr, str(port)]
