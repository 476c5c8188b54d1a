"""Full sharding (parameters, gradients, optimizer state) through torch's FSDP2 ``fully_shard``.

``shard_model`` builds the model where it runs (the weights of a plain build with the same seed, at
every world size), applies ``fully_shard`` per block and then to the root, each rank keeping its
shards; a model on the meta device is made whole and initialised first. ``FSDPSync`` is
the step interface GradSync also offers (``no_sync()``, ``wait()``, global-norm clipping), with
the fixes for FSDP2's known traps (gloo's averaging, accumulation, clipping). Design: docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from distlib.distributed import collectives
from distlib.distributed.state_broadcast import broadcast_module
from distlib.log import get_logger
from distlib.parallel.blocks import find_blocks
from distlib.parallel.sharded_optimizer import ShardingError

__all__ = ["FSDPSync", "ShardingError", "is_fully_sharded", "shard_model"]


def is_fully_sharded(model: nn.Module) -> bool:
    """True when ``model`` or one of its submodules is managed by FSDP2 (``fully_shard``)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


# ---- building on the meta device ---------------------------------------------------------------
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers keep their real values.

    Under ``torch.device("meta")`` a buffer computed in ``__init__`` (a causal mask, rotary
    frequencies, a non-persistent constant) would be meta too, and ``to_empty()`` would leave
    garbage in it. Here only parameters move (each one allocated on the host, uninitialised, for
    the moment of its registration): the buffers are kept, with their values, to be restored
    after ``to_empty()``.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta" and type(param) is nn.Parameter:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _ensure_group(device: torch.device) -> None:
    """World size 1 without a process group: a one-rank group, so that FSDP2 (which needs a device
    mesh) runs the same code as on several ranks; ``distlib.shutdown()`` destroys it."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _blocks_of(
    model: nn.Module, blocks: Sequence[nn.Module] | None, block_types: Iterable[type | str] | None
) -> list[nn.Module]:
    if blocks is not None and block_types is not None:
        raise ShardingError("shard_model: give blocks= or block_types=, not both")
    if block_types is not None:  # classes or class names; the outermost matches
        return find_blocks(model, tuple(block_types))
    if blocks is None:
        return find_blocks(model)  # model.blocks: GPT and most transformer layouts
    owned = {id(m) for m in model.modules()}
    for b in blocks:
        if id(b) not in owned or b is model:
            raise ShardingError(
                f"shard_model: a block ({type(b).__name__}) is not a submodule of the model; pass the "
                "model's own submodules (e.g. blocks=model.blocks), or a builder and block_types="
            )
    return list(blocks)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _default_init(model: nn.Module) -> None:
    """The model's own initialisation: its ``reset_parameters()`` if the root has one (GPT's reaches
    every layer), else every submodule's (torch's layers)."""
    if callable(getattr(model, "reset_parameters", None)):
        model.reset_parameters()
        return
    for m in model.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


@torch.no_grad()
def _materialise(model: nn.Module, init: Callable[[nn.Module], None] | None, device: torch.device) -> list[str]:
    """A model whose parameters are on the meta device, made whole on ``device``: ``to_empty()``,
    its real buffers' values put back, every floating-point tensor without a value filled with NaN,
    then ``init(model)`` (or the model's own initialisation). Returns the names of the tensors
    filled, to be checked for NaN once the initialisation has run."""
    if not all(p.device.type == "meta" for p in model.parameters()):
        raise ShardingError("shard_model: some parameters are on the meta device and some are not; build it on one")
    # buffers computed in __init__ (a causal mask, rotary frequencies) keep their values: to_empty()
    # would leave garbage in them
    real = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    filled = []
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if n in real:
            t.copy_(real[n])
        elif t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))  # what init leaves as it is shows up, rather than yesterday's memory
            filled.append(n)
    (init or _default_init)(model)
    return filled


def _uninitialised(model: nn.Module, names: list[str]) -> list[str]:
    """Of the tensors ``names``, those holding a NaN (one device synchronisation for them all)."""
    if not names:
        return []
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    flags = torch.stack([torch.isnan(tensors[n]).any() for n in names]).tolist()
    return [n for n, bad in zip(names, flags) if bad]


def _build(
    build: Callable[[], nn.Module] | nn.Module, init: Callable[[nn.Module], None] | None, device: torch.device
) -> tuple[nn.Module, list[str]]:
    """The whole model on ``device``, initialised; and the names of the tensors to check for NaN."""
    if isinstance(build, nn.Module):
        model = build
        if is_fully_sharded(model):
            raise ShardingError(
                "shard_model: the model is already sharded (fully_shard was applied); pass it unsharded"
            )
    elif callable(build):
        if init is None:  # where it runs, under the caller's random stream: the weights of a plain build
            with torch.device(device):
                model = build()
        else:
            with _parameters_on_meta():
                model = build()
        if not isinstance(model, nn.Module):
            raise ShardingError(f"shard_model: build() returned {type(model).__name__}, not an nn.Module")
    else:
        raise ShardingError(f"shard_model: build must be a function returning the model or a model, got {build!r}")
    if any(p.device.type == "meta" for p in model.parameters()):
        return model, _materialise(model, init, device)
    model.to(device)  # a no-op for a model built under torch.device(device)
    if init is not None:
        with torch.no_grad():
            init(model)
    return model, []


def shard_model(
    build: Callable[[], nn.Module] | nn.Module,
    *,
    blocks: Sequence[nn.Module] | None = None,
    block_types: Iterable[type | str] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    init: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> nn.Module:
    """The model with ``fully_shard`` applied to each block and then to the root: each rank holds
    1/world of every parameter, gradient and (once the optimizer is built on ``model.parameters()``)
    optimizer state. A collective: every rank must call it, in the same order.

    ``build``: a function that constructs the model, or a model already built (materialised, or
    with its parameters on the meta device). The same seed gives the same weights as a plain build,
    in every shard mode and at every world size: without ``init``, ``build()`` runs on ``device``
    (``with torch.device(device)``) under the caller's random stream, which it leaves where a plain
    build would. Rank 0's weights are then broadcast and each rank keeps its shard (the whole copy
    is freed): during the build every device holds one whole copy of the model. With ``init``
    (``init(model)`` initialises it in place), ``build()`` runs with its parameters on the meta
    device (buffers real), which are then made whole on ``device``, filled with NaN and given to
    ``init``; a model passed on the meta device is made whole the same way, by ``init`` or else by
    its ``reset_parameters()`` (the root's if it has one, else every submodule's). A parameter or
    buffer still NaN after that raises ShardingError naming it.
    ``seed``: None, the caller's random stream; an int, ``torch.manual_seed(seed)`` first.

    ``blocks`` (modules of the model) or ``block_types`` (classes or class names) name the units
    sharded one by one, whose parameters are all-gathered just before they run; by default the
    entries of ``model.blocks`` when there is one (``distlib.find_blocks``). ``param_dtype`` /
    ``reduce_dtype``: FSDP2's mixed precision (compute and gradient reduce-scatter dtypes; the
    sharded master weights keep their dtype).
    ``reshard_after_forward``: free each block's gathered parameters after its forward (ZeRO-3; the
    last block keeps them, as backward starts with it), or keep them until backward. ``device``:
    default this rank's GPU, else the CPU. Tied parameters stay tied (FSDP2 keeps one shard for them).
    """
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _ensure_group(device)
    if seed is not None:
        torch.manual_seed(seed)
    model, filled = _build(build, init, device)
    broadcast_module(model)  # the shards each rank keeps come from one model
    # after the broadcast: every rank judges rank 0's values, and raises alike
    if bad := _uninitialised(model, filled):
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        how = "init(model)" if init is not None else f"{type(model).__name__}'s reset_parameters()"
        raise ShardingError(
            f"shard_model: {how} left {len(bad)} tensor(s) of the meta-device model uninitialised: {shown}; "
            "initialise every parameter and buffer in init=, or pass a function that builds the model "
            "(shard_model(lambda: Model(...))), which builds it whole with its own initialisation"
        )
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = _blocks_of(model, blocks, block_types)
    if not units and world > 1:
        get_logger().warning(
            "shard_model: no blocks (no model.blocks, blocks= or block_types=): the whole model is one unit, "
            "all-gathered whole for forward and backward; name its layers to shard them one by one"
        )
    for i, block in enumerate(units):
        # the last block's parameters stay gathered after its forward: backward starts with them
        # (torchtitan's default too: one all-gather less per step)
        keep = i == len(units) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and not keep, mp_policy=policy)
    # the root last (embeddings, final norm, a tied output layer: the parameters outside the blocks);
    # FSDP2 keeps the root's gathered after forward, as backward needs them first
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    if dist.get_backend() == "gloo":
        # gloo's ReduceOp.AVG reduce-scatter has silently summed (pytorch/pytorch#162338, open; torch
        # 2.14 averaged in our tests): reduce with SUM and let FSDP2 divide by the world size itself,
        # as it does for dtypes at risk of overflow, so that the result does not depend on gloo's AVG
        if hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        else:  # an older torch
            get_logger().warning("shard_model: this torch cannot force SUM reductions on gloo; its AVG is trusted")
    return model


# ---- the step interface -------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPSync:
    """GradSync's step interface for a model from ``shard_model``: ``loss.backward(); sync.wait();
    opt.step()``, ``with sync.no_sync():`` for accumulation micro-batches, ``clip_grad_norm_``.

    FSDP2 reduce-scatters each block's gradients during backward, and backward returns once they
    are done: ``wait()`` has nothing left to do. ``accumulate="unsharded"`` (default): inside
    ``no_sync()`` nothing is communicated, gradients accumulate unsharded (the full gradient of
    every parameter on each rank, as DDP holds) and the next synced backward reduce-scatters the
    sum. ``accumulate="sharded"``: every micro-batch is reduce-scattered and only the gradient
    shards accumulate, for models whose full gradients do not fit (more communication, 1/world of
    the gradient memory).
    """

    def __init__(self, model: nn.Module, *, accumulate: Literal["unsharded", "sharded"] = "unsharded"):
        if not isinstance(model, FSDPModule):
            raise ShardingError(
                f"FSDPSync needs the model returned by distlib.shard_model (fully_shard on its root), got "
                f"{type(model).__name__}; build it with shard_model(...), or use GradSync for a replicated model"
            )
        if accumulate not in ("unsharded", "sharded"):
            raise ShardingError(f"FSDPSync: accumulate must be 'unsharded' or 'sharded', got {accumulate!r}")
        self.accumulate = accumulate
        self.model = model
        self.world_size = collectives.world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]

    def wait(self) -> None:
        """Nothing: FSDP2's backward ends with its reduce-scatters finished. Kept so that the step
        reads the same as with GradSync."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without any reduce-scatter (with
        ``accumulate="sharded"``: reduce-scattered, the shards accumulate)."""
        if self.accumulate == "sharded":
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def join(self) -> contextlib.AbstractContextManager[None]:
        """Not available: GradSync's ``join()`` for uneven inputs has no counterpart in FSDP2."""
        raise ShardingError(
            "FSDPSync has no join(): with full sharding every rank must run the same number of steps "
            "(distributed_loader pads the shards to equal length unless exact=True)"
        )

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their norm over the whole model (every rank's shards) is at
        most ``max_norm``; returns that total norm (a plain tensor, the same on every rank), as
        ``torch.nn.utils.clip_grad_norm_`` does for one process. A collective: every rank must call it.
        """
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        device = grads[0].device if grads else next(self.model.parameters()).device
        norm_type = float(norm_type)
        if grads:
            norms = torch._foreach_norm(grads, norm_type)
            stacked = torch.stack([n.float() for n in norms])
            local = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()
        else:
            local = torch.zeros((), device=device)
        if collectives.active():
            # a process group over every rank: the shards of every parameter, each counted once
            dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return total

    def sync_buffers(self) -> None:
        """Average the floating-point buffers over the ranks and take rank 0's others (buffers are
        replicated, not sharded). A collective."""
        collectives.sync_buffers(self.model)

    def model_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Bytes of model state this rank holds: its parameter shards, gradient shards and (given the
        optimizer) optimizer state, counted by the storages behind them (FSDP2's padding included)."""
        seen: dict[tuple, int] = {}

        def add(t: torch.Tensor | None) -> None:
            if isinstance(t, torch.Tensor):
                s = _local(t).untyped_storage()
                seen[(s.device, s.data_ptr())] = s.nbytes()

        for p in self.model.parameters():
            add(p)
            add(p.grad)
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    add(v)
        return sum(seen.values())

    def close(self) -> None:
        """Nothing to release (kept for the same interface as GradSync)."""
