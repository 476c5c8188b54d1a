"""Full sharding (parameters, gradients, optimizer state) through torch's FSDP2 ``fully_shard``.

``shard_model`` builds the model with its parameters on the meta device while recording what
initialises each (``deferred_init``), applies ``fully_shard`` per block and then to the root, then
makes each parameter whole on its own and keeps this rank's rows: the weights of a plain build with
the same seed, at every world size, without ever holding the whole model. ``FSDPSync`` is
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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from distlib.distributed import collectives
from distlib.distributed.state_broadcast import broadcast_module, broadcast_tensors
from distlib.log import get_logger
from distlib.parallel.blocks import find_blocks
from distlib.parallel.deferred_init import (
    InitRecording,
    Unreplayable,
    check_recorded,
    parameters_to_meta,
    plain_parameters,
    record_init,
    rng_states,
)
from distlib.parallel.sharded_optimizer import ShardingError

__all__ = ["FSDPSync", "ShardingError", "is_fully_sharded", "shard_model"]


def is_fully_sharded(model: nn.Module) -> bool:
    """True when ``model`` or one of its submodules is managed by FSDP2 (``fully_shard``)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


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


def _build_whole(
    build: Callable[[], nn.Module] | nn.Module, init: Callable[[nn.Module], None] | None, device: torch.device
) -> tuple[nn.Module, list[str]]:
    """The whole model on ``device``, initialised; and the names of the tensors to check for NaN.
    For a model passed built, and the fallback of a model whose initialisation cannot be replayed
    one parameter at a time."""
    if isinstance(build, nn.Module):
        model = build
    elif init is None:  # where it runs, under the caller's random stream: the weights of a plain build
        with torch.device(device):
            model = _checked(build())
    else:
        with parameters_to_meta():
            model = _checked(build())
    if any(p.device.type == "meta" for p in model.parameters()):
        return model, _materialise(model, init, device)
    model.to(device)  # a no-op for a model built under torch.device(device)
    if init is not None:
        with torch.no_grad():
            init(model)
    return model, []


def _checked(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ShardingError(f"shard_model: build() returned {type(model).__name__}, not an nn.Module")
    return model


def _buffers_to(model: nn.Module, device: torch.device) -> list[str]:
    """The model's buffers on ``device``, those on the meta device (no value) filled with NaN;
    returns the names of those, to be checked once the initialisation has run."""
    filled = []
    for mname, m in model.named_modules():
        for bname, b in list(m._buffers.items()):
            if b is None:
                continue
            if b.device.type == "meta":
                b = torch.empty_like(b, device=device)
                if b.is_floating_point() or b.is_complex():
                    b.fill_(float("nan"))
                    filled.append(f"{mname}.{bname}" if mname else bname)
            m._buffers[bname] = b.to(device)
    return filled


def _record(
    build: Callable[[], nn.Module] | nn.Module, init: Callable[[nn.Module], None] | None, device: torch.device
) -> tuple[nn.Module, InitRecording, list[str]]:
    """The model with its parameters on the meta device and what initialises each recorded
    (``deferred_init``); its buffers on ``device``. Returns the model, the recording and the
    buffers to check for NaN."""
    if isinstance(build, nn.Module):  # on the meta device: its init or reset_parameters(), recorded
        model = build
        if not all(p.device.type == "meta" for p in model.parameters()):
            raise ShardingError("shard_model: some parameters are on the meta device and some are not; build it on one")
        filled = _buffers_to(model, device)
        with record_init(device, model) as rec, torch.no_grad():
            (init or _default_init)(model)
        plain_parameters(model)
        check_recorded(model, rec)
        return model, rec, filled
    if init is not None:  # the model's own initialisation skipped (on the meta device), init(model) recorded
        with parameters_to_meta():
            model = _checked(build())
        filled = _buffers_to(model, device)
        with record_init(device, model) as rec, torch.no_grad():
            init(model)
        plain_parameters(model)
        check_recorded(model, rec)
        return model, rec, filled
    # the plain build's code, where it runs, under the caller's random stream
    with torch.device(device), record_init(device) as rec:
        model = _checked(build())
    plain_parameters(model)
    check_recorded(model, rec)
    return model, rec, []


def _raise_uninitialised(bad: list[str], how: str) -> None:
    shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    raise ShardingError(
        f"shard_model: {how} left {len(bad)} tensor(s) of the meta-device model uninitialised: {shown}; "
        "initialise every parameter and buffer in init=, or pass a function that builds the model "
        "(shard_model(lambda: Model(...))), which builds it with its own initialisation"
    )


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
    offload: bool = False,
    empty: bool = False,
    convert: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """The model with ``fully_shard`` applied to each block and then to the root: each rank holds
    1/world of every parameter, gradient and (once the optimizer is built on ``model.parameters()``)
    optimizer state. A collective: every rank must call it, in the same order.

    ``build``: a function that constructs the model, or a model already built (materialised, or
    with its parameters on the meta device). The same seed gives the same weights as a plain build,
    in every shard mode and at every world size, and no rank ever holds the whole model: ``build()``
    runs on ``device`` (``with torch.device(device)``) under the caller's random stream with its
    parameters on the meta device, what initialises each parameter recorded (``deferred_init``)
    and the stream advanced as a plain build advances it; the model is sharded on the meta device,
    then each parameter is made whole on its own from rank 0's recorded random states and each rank
    keeps its rows. With ``init`` (``init(model)`` initialises it in place), the model's own
    initialisation is skipped (its parameters on the meta device) and ``init`` is what is recorded;
    a model passed on the meta device is initialised the same way, by ``init`` or else by its
    ``reset_parameters()`` (the root's if it has one, else every submodule's). A parameter or buffer
    left uninitialised raises ShardingError naming it. An initialisation that cannot be replayed
    one parameter at a time (one that computes a parameter from a temporary tensor derived from
    another) falls back, with a warning, to building the model whole on ``device`` first.
    A model passed materialised is broadcast from rank 0 and sharded (it is whole already).
    ``empty=True``: the parameters are sharded without values (NaN), nothing drawn, for weights
    read into the shards afterwards (a pretrained folder, a checkpoint).
    ``seed``: None, the caller's random stream; an int, ``torch.manual_seed(seed)`` first.
    ``convert(model)``: run on the model once built (its parameters still on the meta device when
    their initialisation is recorded) and before ``fully_shard``: a conversion that swaps layers for
    others holding the same parameters under the same names (``distlib.convert_to_float8``). Done by
    ``build`` itself, it would replace the recorded parameters, and the model would be built whole.

    ``blocks`` (modules of the model) or ``block_types`` (classes or class names) name the units
    sharded one by one, whose parameters are all-gathered just before they run; by default the
    entries of ``model.blocks`` when there is one (``distlib.find_blocks``). ``param_dtype`` /
    ``reduce_dtype``: FSDP2's mixed precision (compute and gradient reduce-scatter dtypes; the
    sharded master weights keep their dtype).
    ``reshard_after_forward``: free each block's gathered parameters after its forward (ZeRO-3; the
    last block keeps them, as backward starts with it), or keep them until backward. ``offload``:
    the sharded parameters, their gradients and (built on them) the optimizer state on the host
    (FSDP2's ``CPUOffloadPolicy``), copied to the device block by block. ``device``: default this
    rank's GPU, else the CPU. Tied parameters stay tied (FSDP2 keeps one shard for them).
    """
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(build, nn.Module) and is_fully_sharded(build):
        raise ShardingError("shard_model: the model is already sharded (fully_shard was applied); pass it unsharded")
    if not isinstance(build, nn.Module) and not callable(build):
        raise ShardingError(f"shard_model: build must be a function returning the model or a model, got {build!r}")
    on_meta = isinstance(build, nn.Module) and any(p.device.type == "meta" for p in build.parameters())
    if isinstance(build, nn.Module) and empty and not on_meta:
        raise ShardingError("shard_model: empty=True needs a builder or a model on the meta device, not a built model")
    _ensure_group(device)
    if seed is not None:
        torch.manual_seed(seed)
    rec, filled = None, []
    if empty:
        if isinstance(build, nn.Module):
            model = build
        else:
            with torch.device(device), parameters_to_meta():
                model = _checked(build())
        _buffers_to(model, device)
    elif isinstance(build, nn.Module) and not on_meta:
        model, filled = _build_whole(build, init, device)
    else:
        states = rng_states(device)
        try:
            model, rec, filled = _record(build, init, device)
        except (Unreplayable, NotImplementedError) as e:
            if isinstance(build, nn.Module):
                plain_parameters(build)
            for g, s in states:  # the stream as the caller left it: the whole build draws it again
                g.set_state(s)
            name = type(build).__name__ if isinstance(build, nn.Module) else getattr(build, "__name__", "the model")
            get_logger().warning(
                f"shard_model: {name}'s initialisation cannot be replayed one parameter at a time ({e}); it is "
                "built whole on the device instead, then sharded (one whole copy of the model on every device "
                "while it is built): initialise each parameter in place, or pass init="
            )
            model, filled = _build_whole(build, init, device)
    how = (
        "init(model)"
        if init is not None
        else (f"{type(model).__name__}'s reset_parameters()" if on_meta else f"{type(model).__name__}'s construction")
    )
    if empty:
        broadcast_tensors(list(model.buffers()))
    elif rec is None:
        broadcast_module(model)  # the shards each rank keeps come from one model
        # after the broadcast: every rank judges rank 0's values, and raises alike
        if bad := _uninitialised(model, filled):
            _raise_uninitialised(bad, how)
    else:
        broadcast_tensors(list(model.buffers()))
        rec.broadcast()  # every rank replays rank 0's draws
    meta_params = dict(model.named_parameters())  # before sharding: the recorded tensors by name
    if convert is not None:
        convert(model)  # the same names: the shards are filled from meta_params by name
    _shard_units(model, blocks, block_types, device, param_dtype, reduce_dtype, reshard_after_forward, offload)
    if rec is not None or empty:
        bad_buffers = _uninitialised(model, filled)  # of a meta model: reported with the parameters
        _fill_shards(model, meta_params, rec, device, offload, how, bad_buffers)
    return model


def _shard_units(
    model: nn.Module,
    blocks: Sequence[nn.Module] | None,
    block_types: Iterable[type | str] | None,
    device: torch.device,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    offload: bool,
) -> None:
    """``fully_shard`` on each block, then on the root; with gloo, SUM reductions."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pinned host memory for the copies to the GPU; there is none without one
    offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
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
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and not keep, mp_policy=policy,
                    offload_policy=offload_policy)  # fmt: skip
    # the root last (embeddings, final norm, a tied output layer: the parameters outside the blocks);
    # FSDP2 keeps the root's gathered after forward, as backward needs them first
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                offload_policy=offload_policy)  # fmt: skip
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


@torch.no_grad()
def _fill_shards(
    model: nn.Module,
    meta_params: dict[str, nn.Parameter],
    rec: InitRecording | None,
    device: torch.device,
    offload: bool,
    how: str,
    bad_buffers: list[str],
) -> None:
    """The sharded parameters (on the meta device) given storage for this rank's shards only,
    then each parameter made whole on its own (``rec``'s replay, else NaN) and this rank's rows
    copied into its shard: one whole parameter in memory at a time."""
    buffers = {n: b for n, b in model.named_buffers()}
    model.to_empty(device="cpu" if offload else device)  # the shards only; FSDP2 re-pads them
    for n, b in model.named_buffers():  # to_empty left garbage in the buffers: their values back
        b.copy_(buffers[n])
    bad = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if rec is None:
            if local.is_floating_point():
                local.fill_(float("nan"))  # a row no file gives shows up
            continue
        source = meta_params[name]
        if source.device.type == "meta":
            full, written = rec.materialise(source, device)
        else:  # made with its values outside what the recording sees (kept whole until now)
            full, written = source.detach().to(device), True
        if isinstance(p, DTensor):  # this rank's rows, as FSDP2 cuts them: no communication
            part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        else:
            part = full
        local.copy_(part)
        # every rank replays rank 0's draws: the whole tensor is the same on each, so they judge alike
        if not written or ((full.is_floating_point() or full.is_complex()) and torch.isnan(full).any()):
            bad.append(name)
        del full, part
    if bad or bad_buffers:
        _raise_uninitialised(bad + bad_buffers, how)


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
