"""compile_for_sync: a compiled model under GradSync gets the eager gradients, and the bucket
all_reduces start before its backward ends (the overlap a single compiled graph loses)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlib.parallel.grad_sync import GradSync
from distlib.step.compile import compile_for_sync
from tests.conftest import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-7}  # fp32; a compiled graph may sum in another order than eager


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )


def _compute_nodes(root) -> list:
    """The autograd nodes reachable from ``root``, AccumulateGrad excepted: one per compiled graph."""
    seen, stack, out = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            out.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return out


def _run(ctx, backend: str, mode: str | None = None) -> dict:
    return {
        "eager": _grads_and_launches(ctx, False, backend, mode),
        "compiled": _grads_and_launches(ctx, True, backend, mode),
    }


def _grads_and_launches(ctx, compiled: bool, backend: str, mode: str | None = None) -> dict:
    model = _net().to(ctx.device)
    # 4 buckets, [fc4.bias fc4.weight fc3.bias] [fc3.weight fc2.bias] [fc2.weight fc1.bias] [fc1.weight]
    sync = GradSync(model, bucket_mb=0.016, first_bucket_mb=0.004)
    net = compile_for_sync(model, sync, backend=backend, mode=mode) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(ctx.rank)  # each rank its own data: the average matters
    launches: list[int] = []
    done = [0]
    all_reduce = dist.all_reduce

    def recording(*args, **kwargs):  # the compute nodes run when each bucket is launched
        launches.append(done[0])
        return all_reduce(*args, **kwargs)

    dist.all_reduce = recording
    try:
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g).to(ctx.device), torch.randint(0, 5, (8,), generator=g).to(ctx.device)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's outputs are dead
            loss = F.cross_entropy(net(x), y)
            nodes = _compute_nodes(loss.grad_fn)
            done[0] = 0
            hooks = [n.register_hook(lambda *_: done.__setitem__(0, done[0] + 1)) for n in nodes]
            launches.clear()
            loss.backward()
            for h in hooks:
                h.remove()
            sync.wait()
            grads = [p.grad.cpu() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_reduce = all_reduce
    return {"grads": grads, "launches": list(launches), "nodes": len(nodes), "buckets": len(sync.buckets)}


def _check(results: list[dict], tol: dict) -> None:
    eager, compiled = [r["eager"] for r in results], [r["compiled"] for r in results]
    for e, c in zip(eager, compiled):
        assert c["buckets"] == e["buckets"] == 4
        for ge, gc in zip(e["grads"], c["grads"]):
            torch.testing.assert_close(gc, ge, **tol)
    for r in compiled:
        # Buckets 0 and 1 hold the gradients of the last three Linears: they start while compiled
        # backward graphs are still to run, one graph apart (one graph for the whole model: none would).
        # Buckets 2 and 3 need the first Linear's gradients, which come with the backward's last graph.
        n = r["launches"]
        assert len(n) == r["buckets"] and n == sorted(n), r
        assert n[0] < n[1] < r["nodes"] and n[2] == n[3] == r["nodes"], r


def test_compiled_gradients_match_eager_and_buckets_launch_during_backward():
    # aot_eager: AOTAutograd's one-node backward (what hides the hooks) without inductor's minutes of
    # C++ compilation on a loaded CPU; inductor itself: bench/compile_overlap.py
    _check(run_ranks(_run, 2, "aot_eager", timeout=600), TOL)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_on_two_gpus(mode):
    """Inductor (and its CUDA graphs under reduce-overhead) on NCCL: the same gradients and order."""
    _check(run_ranks(_run, 2, "inductor", mode, backend="nccl", timeout=600), {"rtol": 1e-4, "atol": 1e-5})


def _compiled_graph_vs_eager(ctx) -> dict:
    """compile_for_sync's model stepped eagerly, then inside a CapturedStep (the compiled kernels and
    the bucket all_reduces replayed as one CUDA graph); the lr changes every step."""
    from distlib.step.cuda_graph import CapturedStep

    runs = {}
    for mode in ("eager", "graph"):
        torch._dynamo.reset()
        model = _net().to(ctx.device)
        sync = GradSync(model, bucket_mb=0.016, first_bucket_mb=0.004)
        net = compile_for_sync(model, sync)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

        def loss_fn(x, y, net=net):
            return F.cross_entropy(net(x), y)

        step = CapturedStep(model, opt, loss_fn, sync, warmup_steps=2) if mode == "graph" else None
        losses = []
        for i in range(8):
            g = torch.Generator().manual_seed(100 * i + ctx.rank)  # each rank its own data
            x = torch.randn(32, 16, generator=g).to(ctx.device)
            y = torch.randint(0, 5, (32,), generator=g).to(ctx.device)
            if step is None:
                loss = loss_fn(x, y)
                loss.backward()
                sync.wait()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                loss = step(x, y)
            losses.append(loss.item())
            sched.step()
        runs[mode] = ([p.detach().cpu() for p in model.parameters()], losses)
        if step is not None:
            runs["captured"] = step.captured
            step.close()
        sync.close()
    return runs


@pytest.mark.gpus(2)
def test_compiled_model_inside_the_captured_step_on_two_gpus():
    """The fastest step measured (bench.step distlib-compile-graph): the same training as eager."""
    results = run_ranks(_compiled_graph_vs_eager, 2, backend="nccl", timeout=600)
    for r in results:
        assert r["captured"]
        for a, b in zip(r["eager"][0], r["graph"][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert max(abs(a - b) for a, b in zip(r["eager"][1], r["graph"][1])) < 1e-5
    for a, b in zip(results[0]["graph"][0], results[1]["graph"][0]):  # the ranks agree
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_world_size_one_is_plain_compile_and_bad_input_is_named():
    model = _net()
    sync = GradSync(model)  # world size 1: no buckets
    net = compile_for_sync(model, sync, backend="aot_eager")
    x = torch.randn(3, 16)
    torch.testing.assert_close(net(x), model(x))
    with pytest.raises(TypeError, match="GradSync"):
        compile_for_sync(model, object())
    with pytest.raises(ValueError, match="another model"):
        compile_for_sync(_net(), sync)
    with pytest.raises(ValueError, match="backend='inductor'"):
        compile_for_sync(model, sync, backend="aot_eager", mode="reduce-overhead")
    with pytest.raises(TypeError, match="nn.Module"):
        compile_for_sync(lambda x: x, sync)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))


def _bn_compiled_vs_ddp(ctx) -> dict:
    """A BatchNorm model under compile_for_sync (buffers broadcast by GradSync's forward pre-hook,
    which runs outside the compiled graph) against DDP's default broadcast_buffers, eager."""
    from torch._dynamo.utils import counters

    out = {}
    for mode in ("ddp", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        model = _bn_net()
        if mode == "ddp":
            net, sync = nn.parallel.DistributedDataParallel(model), None
        else:
            sync = GradSync(model, bucket_mb=0.004, first_bucket_mb=0.001)
            net = compile_for_sync(model, sync, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            g = torch.Generator().manual_seed(100 * i + ctx.rank)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
            F.cross_entropy(net(x), y).backward()
            if sync is not None:
                sync.wait()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            evaluated = net(torch.randn(4, 16, generator=torch.Generator().manual_seed(ctx.rank)))
        state = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
        out[mode] = {"state": state, "eval": evaluated, "recompiles": sum(counters["recompiles"].values())}
    return out


def test_compiled_buffers_broadcast_as_ddp():
    for r in run_ranks(_bn_compiled_vs_ddp, 2, timeout=600):
        for a, b in zip(r["ddp"]["state"], r["compiled"]["state"]):
            torch.testing.assert_close(b, a, **TOL)
        torch.testing.assert_close(r["compiled"]["eval"], r["ddp"]["eval"], **TOL)
        # train() to eval() recompiles once (BatchNorm's training flag); the hook's own state does not
        assert r["compiled"]["recompiles"] <= 1, r["compiled"]["recompiles"]


def _inductor_imported(ctx) -> tuple[bool, bool]:
    import sys

    model = _net()
    sync = GradSync(model, bucket_mb=0.016, first_bucket_mb=0.004)
    before = "torch._inductor.compile_fx" in sys.modules
    compile_for_sync(model, sync)  # not called: nothing is compiled
    return before, "torch._inductor.compile_fx" in sys.modules


def test_inductor_is_imported_when_compile_for_sync_is_called_as_by_torch_compile():
    """Not in the first step: its start-up time is compared with torch.compile(DDP(model))'s."""
    for before, after in run_ranks(_inductor_imported, 2, timeout=300):
        assert (before, after) == (False, True)
