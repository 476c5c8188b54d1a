"""Deferred initialisation: a model built with its parameters on the meta device while what
initialises each parameter is recorded, then replayed one parameter at a time with the values a
plain build gives.

A plain build (``with torch.device(device): build()``) draws every parameter's initial values from
the device's random stream, in the order the model's code runs. Under ``record_init`` the same code
runs with the parameters on the meta device (no storage) and the buffers real. Every operation that
writes into a parameter (``normal_``, ``uniform_``, ``fill_``, ``mul_``, a ``copy_`` from a real
tensor, through any view of it) is recorded, a random one with its generator's state at that
moment; a random one also runs on a scratch tensor of the same layout on the device, so that the
stream advances exactly as in the plain build (and what draws after the build draws alike).
``InitRecording.materialise`` then runs one parameter's operations on a whole tensor of its own from
those states: the plain build's values, whatever the world size, with one parameter in memory at a
time. A parameter created with values (``nn.Parameter(torch.ones(n))``) is recorded as a copy of
them, kept on the host.

torch's ``trunc_normal_``, ``orthogonal_`` and ``sparse_`` (called as ``nn.init.NAME``) are recorded
as one operation each: they draw into temporaries or branch on the values drawn. What cannot be
replayed raises ``Unreplayable`` while recording: an operation that writes into a parameter from
another meta tensor (a parameter computed from another), one that writes into several parameters at
once, or one that reads a value (``.item()``, a branch on the data).
Design: docs/sharding.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from distlib.distributed import collectives
from distlib.distributed.state_broadcast import broadcast_tensors

__all__ = ["InitRecording", "Unreplayable", "build_converted", "plain_parameters", "record_init"]


class Unreplayable(RuntimeError):
    """The model's initialisation cannot be replayed one parameter at a time."""


@dataclass(frozen=True)
class _View:
    """A view of the recorded tensor's storage: ``as_strided`` on the materialised tensor."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    generator: torch.Generator | None = None
    state: torch.Tensor | None = None


# the factories whose result is uninitialised memory: a parameter made of one has no values yet
_EMPTY = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by its views and ``.data``)."""
    return t.untyped_storage()._cdata


def _writes(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes into: its in-place and ``out=`` arguments."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _generator(device: torch.device, kwargs: dict) -> torch.Generator:
    """The generator a random operation on ``device`` draws from."""
    if kwargs.get("generator") is not None:
        return kwargs["generator"]
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class _RecordedParameter(nn.Parameter):
    """A parameter on the meta device whose initialisation is recorded. It says it is not on the
    meta device: torch's ``trunc_normal_`` and ``orthogonal_`` return at once on a meta tensor
    ("sampling is a no-op"), and would leave it uninitialised; told otherwise they run, and their
    operations are recorded (or found unreplayable). Swapped back for a plain parameter
    (``plain_parameters``) before anything else sees the model."""

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False


def _recorded(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return _RecordedParameter(t, requires_grad=requires_grad)


def plain_parameters(model: nn.Module) -> None:
    """Every recorded parameter of ``model`` replaced by a plain one on the same storage (a
    parameter several modules share stays one)."""
    swapped: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if isinstance(p, _RecordedParameter):
                if id(p) not in swapped:
                    swapped[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                m._parameters[n] = swapped[id(p)]


def _view(t: torch.Tensor) -> _View:
    return _View(tuple(t.size()), tuple(t.stride()), t.storage_offset())


@dataclass
class InitRecording:
    """What initialises each recorded tensor (the model's parameters): its operations, by storage."""

    device: torch.device
    ops: dict[int, list[_Op]] = field(default_factory=dict)
    # the recorded tensors, kept alive so that no other storage takes their identity
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    fresh: set[int] = field(default_factory=set)  # real storages holding uninitialised memory

    def track(self, t: torch.Tensor) -> None:
        """Record what writes into ``t`` (a meta tensor) from now on."""
        k = _key(t)
        if k not in self.ops:
            self.ops[k] = []
            self.tensors[k] = t

    def recorded(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta" and _key(t) in self.ops

    def broadcast(self, src: int = 0) -> None:
        """Take global rank ``src``'s generator states and recorded values, so that every rank
        replays ``src``'s initialisation even where the ranks' random streams differ. A collective:
        every rank must call it, having recorded the same build."""
        if not collectives.active():
            return
        ops = [op for key in self.ops for op in self.ops[key]]
        states = [op.state for op in ops if op.state is not None]
        values = list({id(v): v for op in ops for v in tree_flatten((op.args, op.kwargs))[0]
                       if isinstance(v, torch.Tensor)}.values())  # fmt: skip
        nccl = dist.get_backend() == "nccl"
        comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        if states:
            flat = torch.cat([s.reshape(-1) for s in states]).to(comm)
            broadcast_tensors([flat], src)
            for s, part in zip(states, flat.cpu().split([s.numel() for s in states])):
                s.copy_(part.view(s.shape))
        for v in values:  # few and small: the values of parameters created with them (norms' ones)
            moved = v.to(comm) if nccl and v.device.type != "cuda" else v
            broadcast_tensors([moved], src)
            if moved is not v:
                v.copy_(moved)

    @torch.no_grad()
    def materialise(self, t: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, bool]:
        """``t`` (a recorded meta tensor) whole on ``device`` (default the recording's), with the
        values its recorded operations give, and whether something wrote into it. What they do not
        write holds NaN (floating-point tensors). The generators' states are left as they were."""
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device or self.device)
        if out.is_floating_point() or out.is_complex():
            out.fill_(float("nan"))
        ops = self.ops[_key(t)]
        saved = {id(op.generator): (op.generator, op.generator.get_state()) for op in ops if op.generator is not None}
        try:
            for op in ops:
                args, kwargs = tree_map(lambda v: out.as_strided(v.size, v.stride, v.offset) if isinstance(v, _View)
                                        else v, (op.args, op.kwargs))  # fmt: skip
                if op.generator is not None:
                    op.generator.set_state(op.state)
                op.func(*args, **kwargs)
        finally:
            for g, s in saved.values():
                g.set_state(s)
        return out, bool(ops)


class _Recorder(TorchDispatchMode):
    """Records the operations that write into recorded meta tensors; advances the random stream
    for every random operation on a meta tensor as the plain build would."""

    def __init__(self, rec: InitRecording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            raise Unreplayable("it reads a value of a tensor without values (.item(), a data-dependent branch)")
        if not any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_flatten((args, kwargs))[0]):
            out = func(*args, **kwargs)
            self._track_fresh(func, args, kwargs, out)
            return out
        writes = [t for t in _writes(func, args, kwargs) if t.device.type == "meta"]
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        targets = {_key(t) for t in writes if self.rec.recorded(t)}
        if len(targets) > 1:
            raise Unreplayable(f"{func} writes into several parameters at once")
        if targets:
            (key,) = targets

            def spec(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.device.type == "meta":
                    if _key(v) != key:
                        raise Unreplayable(
                            f"a parameter is initialised from another tensor that has no values yet ({func}): "
                            "its initialisation reads a meta tensor"
                        )
                    return _view(v)
                return v

            op = _Op(func, *tree_map(spec, (args, kwargs)))
            if seeded:
                op.generator = _generator(self.rec.device, kwargs)
                op.state = op.generator.get_state()
            self.rec.ops[key].append(op)
        if seeded and writes:
            # the plain build draws here: the same draw into a scratch tensor of the same layout
            # advances the stream alike (one tensor in memory, for the moment of the draw)
            t = writes[0]
            scratch = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=self.rec.device)
            a, k = tree_map(lambda v: scratch if v is t else v, (args, kwargs))
            func(*a, **k)
            del scratch, a, k
        return func(*args, **kwargs)

    def _track_fresh(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Which real storages hold uninitialised memory (torch.empty's): a parameter made of one
        has no values to keep."""
        for t in _writes(func, args, kwargs):
            self.rec.fresh.discard(_key(t))
        returns = func._schema.returns
        if isinstance(out, torch.Tensor) and out.device.type != "meta" and returns and returns[0].alias_info is None:
            # a new storage (not a view): uninitialised only from an empty factory
            if func in _EMPTY:
                self.rec.fresh.add(_key(out))
            else:
                self.rec.fresh.discard(_key(out))


@contextlib.contextmanager
def parameters_to_meta(rec: InitRecording | None = None) -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers keep their real values.

    Under ``torch.device("meta")`` a buffer computed in ``__init__`` (a causal mask, rotary
    frequencies, a non-persistent constant) would be meta too, and ``to_empty()`` would leave
    garbage in it. Here only parameters move (each one allocated for the moment of its
    registration). With ``rec``, each is recorded; one created with values (not torch.empty's
    uninitialised memory) is recorded as a copy of them, kept on the host.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and type(param) is nn.Parameter:
            if param.device.type != "meta":
                values = param.detach()
                meta = values.to("meta")
                param = (
                    nn.Parameter(meta, requires_grad=param.requires_grad)
                    if rec is None
                    else _recorded(meta, param.requires_grad)
                )
                if rec is not None:
                    rec.track(param)
                    if _key(values) not in rec.fresh:
                        host = values.cpu() if values.device.type != "cpu" else values
                        rec.ops[_key(param)].append(_Op(torch.Tensor.copy_, (_view(param), host), {}))
            elif rec is not None:
                param = _recorded(param.detach(), param.requires_grad)
                rec.track(param)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# torch's initialisations that draw into a temporary, or resample what falls out of bounds (a branch
# on the values drawn): each is recorded as one operation on the parameter, from the generator's state
_WHOLE_INITS = ("trunc_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _whole_inits(rec: InitRecording) -> Iterator[None]:
    """``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_`` and ``sparse_`` on a recorded parameter
    recorded as one operation each: run on a scratch tensor (the stream advances as in the plain
    build), replayed from the generator's state before it."""
    originals = {name: getattr(nn.init, name) for name in _WHOLE_INITS}

    def wrap(original: Any) -> Any:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not rec.recorded(tensor):
                return original(tensor, *args, **kwargs)
            gen = _generator(rec.device, kwargs)
            op = _Op(original, (_view(tensor), *args), kwargs, gen, gen.get_state())
            rec.ops[_key(tensor)].append(op)
            scratch = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=rec.device)
            original(scratch, *args, **kwargs)
            return tensor

        return init

    for name, original in originals.items():
        setattr(nn.init, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@contextlib.contextmanager
def record_init(device: torch.device, model: nn.Module | None = None) -> Iterator[InitRecording]:
    """Inside, parameters registered go to the meta device (and those of ``model``, already on
    it, are recorded as they are): every operation that writes into them is recorded, and every
    random one advances ``device``'s stream as it would in a plain build there. Call
    ``plain_parameters(model)`` once the model is built."""
    rec = InitRecording(torch.device(device))
    if model is not None:
        swapped: dict[int, nn.Parameter] = {}
        for m in model.modules():
            for n, p in list(m._parameters.items()):
                if p is not None and p.device.type == "meta":
                    if id(p) not in swapped:
                        swapped[id(p)] = _recorded(p.detach(), p.requires_grad)
                        rec.track(swapped[id(p)])
                    m._parameters[n] = swapped[id(p)]
    with parameters_to_meta(rec), _whole_inits(rec), _Recorder(rec):
        yield rec


def check_recorded(model: nn.Module, rec: InitRecording) -> None:
    """Every parameter on the meta device is one the recording knows (not one a conversion such as
    ``model.to(dtype)`` replaced by a new tensor); raises Unreplayable naming those it does not."""
    unknown = [n for n, p in model.named_parameters() if p.device.type == "meta" and not rec.recorded(p)]
    if unknown:
        raise Unreplayable(f"{', '.join(unknown[:3])} were replaced by tensors made from them (a conversion)")


def rng_states(device: torch.device) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The states of the generators a build on ``device`` draws from (the CPU's, and the GPU's there),
    to put back before a build that must draw the stream again."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    return [(g, g.get_state()) for g in gens]


def build_converted(
    build: Callable[[], nn.Module], convert: Callable[[nn.Module], object], device: torch.device | str
) -> nn.Module:
    """``build()`` on ``device`` with ``convert(model)`` applied to it, without ever holding the plain
    build's parameters all at once: the model is built with its parameters on the meta device (what
    initialises each recorded, the random stream advanced as a plain build advances it), converted
    there, then each parameter made whole on its own from the recording and turned into the dtype
    the conversion gave it. A conversion that casts a frozen base to bf16 (a LoRA model's) so costs
    the bf16 model and one fp32 parameter, not the fp32 model; the values are those of a plain build
    followed by the conversion, bit for bit. ``convert`` must keep the parameters' names (it may
    replace parameters or swap layers that hold them). A parameter nothing initialises holds NaN (a
    pretrained model's, read afterwards). Where the initialisation cannot be replayed one parameter
    at a time (``Unreplayable``), the model is built whole on ``device`` and converted, as plainly."""
    device = torch.device(device)
    states = rng_states(device)
    try:
        with torch.device(device), record_init(device) as rec:
            model = build()
        plain_parameters(model)
        check_recorded(model, rec)
    except (Unreplayable, NotImplementedError):
        for g, s in states:  # the stream as the caller left it: the whole build draws it again
            g.set_state(s)
        with torch.device(device):
            model = build().to(device)  # .to: a no-op, unless the model put a tensor on a device of its own
        convert(model)
        return model
    recorded = dict(model.named_parameters())  # before the conversion, by name
    convert(model)
    made: dict[int, nn.Parameter] = {}  # a tied parameter made once, the same object in each place
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type != "meta":  # made with its values outside the recording (kept as it is)
                continue
            source = recorded[name]
            whole = rec.materialise(source, device)[0] if rec.recorded(source) else source.detach()
            made[id(p)] = nn.Parameter(whole.to(p.dtype), requires_grad=p.requires_grad)
            del whole  # the fp32 draw of a cast parameter: one at a time
    for m in model.modules():  # the buffers are real already: only the parameters were on the meta device
        for n, p in list(m._parameters.items()):
            if p is not None and id(p) in made:
                m._parameters[n] = made[id(p)]
    return model.to(device)  # a buffer the model put on a device of its own moved, as a plain build's .to
