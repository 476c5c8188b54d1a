"""torch.compile for a model whose gradients GradSync averages, keeping the all_reduces overlapped:
per block (``compile_blocks``), or the whole model cut at the bucket ends (``compile_for_sync``).

AOTAutograd runs a compiled graph's whole backward as one autograd node, so the post-accumulate-grad
hooks (and with them every bucket's all_reduce) fire only once the whole backward is done.
``compile_for_sync`` splits the graph that dynamo captures at GradSync's bucket boundaries and
compiles each piece on its own, as torch's DDPOptimizer does for DDP's buckets (it is reused here,
with the split points taken from GradSync's layout): each piece's backward is its own autograd node,
so a bucket's all_reduce starts as soon as the piece holding its last gradient has run.
Compiling each block of a model made of repeated blocks gets the same overlap without any cut
(each block's backward is its own autograd node) and compiles one graph that every block reuses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from distlib.parallel.grad_sync import GradSync

_NEVER = 2**62  # a byte count no bucket reaches: the split points are set by hand below


def _graph_params(gm: torch.fx.GraphModule) -> dict[int, nn.Parameter]:
    """The real parameters a dynamo graph uses, by the id of what DDPOptimizer will see for each
    (the fake example value of a parameter input, or the parameter itself)."""
    out: dict[int, nn.Parameter] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            fake, arg = node.meta.get("example_value"), node.meta.get("grapharg")
            real = arg.example if arg is not None else None
            if fake is not None and isinstance(real, nn.Parameter):
                out[id(fake)] = real
        elif node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, nn.Parameter):
                out[id(value)] = value
        elif node.op == "call_module":
            out.update((id(p), p) for p in gm.get_submodule(node.target).parameters())
    return out


def _split_backend(sync: GradSync, compile_fn: Callable) -> Callable:
    """A dynamo backend that cuts the graph where GradSync's buckets complete, then compiles each piece."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    class BucketSplitter(DDPOptimizer):
        # DDPOptimizer walks the graph from its output back (the order gradients become ready) and
        # starts a new piece once the current one is full; "full" here means: the parameters seen so
        # far complete GradSync's next bucket (the ones of this graph; buckets in launch order).
        def compile_fn(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
            self._params = _graph_params(gm)
            used = {id(p) for p in self._params.values()}
            self._open = [{id(s.param) for s in b.slots} & used for b in sync.buckets]
            self._open = [ids for ids in self._open if ids]
            return super().compile_fn(gm, example_inputs, **kwargs)

        def add_param(self, bucket: Any, param: nn.Parameter, name: str) -> None:
            super().add_param(bucket, param, name)
            real = self._params.get(id(param), param)
            for ids in self._open:
                ids.discard(id(real))
            closes = False
            while self._open and not self._open[0]:
                self._open.pop(0)
                closes = True
            if closes:
                bucket.size = _NEVER

    return BucketSplitter(bucket_bytes_cap=_NEVER, backend_compile_fn=compile_fn, first_bucket_cap=_NEVER).compile_fn


def _backend_fn(backend: str | Callable, mode: str | None, options: dict | None, dynamic: bool | None) -> Callable:
    """The compiler function ``torch.compile(backend=..., mode=..., options=...)`` would use."""
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    if mode is not None or options:
        raise ValueError(f"mode and options go with backend='inductor', got backend={backend!r}")
    if isinstance(backend, str):
        return torch._dynamo.lookup_backend(backend)
    if not callable(backend):
        raise TypeError(f"backend must be a name or a dynamo compiler function, got {type(backend).__name__}")
    return backend


def compile_for_sync(
    model: nn.Module,
    sync: GradSync,
    *,
    backend: str | Callable = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
) -> nn.Module:
    """``torch.compile(model, ...)`` with one compiled graph per GradSync bucket, so that each bucket's
    all_reduce starts during backward, as in eager.

    ``sync`` is the GradSync built for ``model`` (build it first: it broadcasts and lays out the
    buckets). The graph is split when it is compiled (at the first forward, and again at any
    recompilation), from the bucket layout of that moment, and GradSync's one-time re-layout after its
    first step is switched off (compiled, gradients arrive a graph at a time). The split is exact when
    the model compiles to one graph whose forward uses the parameters in GradSync's layout order
    (registration order, unless a step was synced before this call); otherwise a bucket launches at
    the end of the piece that holds its last gradient, still before the backward ends. At world size 1 (no
    buckets) it is plain ``torch.compile``. Returns what ``torch.compile`` returns; the backend, mode,
    options, dynamic and fullgraph arguments mean what they mean there.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_for_sync needs an nn.Module, got {type(model).__name__}")
    if not isinstance(sync, GradSync):
        raise TypeError(f"sync must be a GradSync, got {type(sync).__name__}")
    if sync.model is not model:
        raise ValueError("sync was built for another model: build GradSync(model) for the model compiled here")
    compile_fn = _backend_fn(backend, mode, options, dynamic)
    if backend == "inductor":
        # torch.compile(model) imports inductor's compile_fx here, when it is called; behind a backend
        # function the import (seconds: inductor, its autotuning, triton) would land in the first step
        importlib.import_module("torch._inductor.compile_fx")
    if not sync.buckets or sync.world_size == 1:  # nothing to overlap
        # (shard="optimizer" keeps its buckets at world size 1: cutting there would only compile one
        # graph per bucket, hundreds for a billion-parameter model, for no communication at all)
        return torch.compile(model, backend=backend, mode=mode, options=options, dynamic=dynamic, fullgraph=fullgraph)
    # GradSync re-lays its buckets once, after the first step, in the order the gradients arrived;
    # compiled, they arrive a piece at a time in an order of autograd's choosing, which would move
    # the bucket ends away from the cuts. Keep the layout the cuts are made for.
    sync._rebuilt = True
    sync._arrival = None
    return torch.compile(model, backend=_split_backend(sync, compile_fn), dynamic=dynamic, fullgraph=fullgraph)


def compile_blocks(
    blocks: Iterable[nn.Module],
    *,
    backend: str | Callable = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
) -> int:
    """``block.compile(...)`` on each block (``distlib.find_blocks(model)``): in place, so the model,
    its parameter names and its state_dict stay as they are. Returns the number of blocks compiled.

    Blocks of one class and shape share one compiled graph: dynamo traces the first and every other
    reuses it (its parameters are inputs of the graph, not constants), so the warm-up costs one
    block's compilation, whatever the depth. Each block's backward is its own autograd node, so
    GradSync's buckets launch as the blocks' gradients complete (no cut needed, unlike
    ``compile_for_sync``); with FSDP2 the blocks' all-gather and reduce-scatter hooks run between
    the compiled graphs. Compiles at the first forward; ``backend``, ``mode``, ``options``,
    ``dynamic`` and ``fullgraph`` mean what they mean for ``torch.compile``. A block compiled twice
    is compiled once.
    """
    n = 0
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"compile_blocks needs nn.Modules, got {type(block).__name__}")
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(backend=backend, mode=mode, options=options, dynamic=dynamic, fullgraph=fullgraph)
        n += 1
    if n and backend == "inductor":
        importlib.import_module("torch._inductor.compile_fx")  # as torch.compile does, before the first step
    return n
