"""What every checkpoint of distlib shares, whichever writes it (``Checkpointer``'s one file, the sharded
``ShardedCheckpointer``, the runner's ``RunCheckpoints``): the error, the state protocols, the fingerprint a
checkpoint must match, and a process's RNG states."""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from distlib.errors import DistlibError


class CheckpointError(DistlibError, RuntimeError):
    """No usable checkpoint, a checkpoint from another model or config, or one that could not be written."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


@runtime_checkable
class RankStateful(Protocol):
    """An object with state of its own on each rank besides the shared ``state_dict()``: its
    ``rank_state_dict()`` is saved for every rank and given back to the same rank (when the
    world size is unchanged)."""

    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_rank_state_dict(self, state: dict[str, Any], /) -> Any: ...


# ---- fingerprint ----------------------------------------------------------------------


def fingerprint(model: nn.Module, **settings: Any) -> dict[str, Any]:
    """What must be equal for a checkpoint to be valid for this run: the model's
    state_dict names, shapes and dtypes, and ``settings`` (plain values, e.g.
    ``{"model.name": "small_cnn", "train.batch_size": 128}``)."""
    tensors = {name: f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in model.state_dict().items()}
    return {"tensors": tensors, "settings": dict(settings)}


def differences(saved: Mapping[str, Any], current: Mapping[str, Any], limit: int = 8) -> list[str]:
    """Human-readable differences between two fingerprints (empty when compatible)."""
    out = []
    s_set, c_set = saved.get("settings", {}), current.get("settings", {})
    for key in sorted(set(s_set) | set(c_set)):
        if s_set.get(key) != c_set.get(key):
            out.append(f"{key}: checkpoint has {s_set.get(key)!r}, this run has {c_set.get(key)!r}")
    s_t, c_t = saved.get("tensors", {}), current.get("tensors", {})
    missing = [k for k in c_t if k not in s_t]
    unexpected = [k for k in s_t if k not in c_t]
    changed = [f"{k} ({s_t[k]} in the checkpoint, {c_t[k]} here)" for k in c_t if k in s_t and s_t[k] != c_t[k]]

    def short(items: list[str]) -> str:
        more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more

    if changed:
        out.append(f"model tensors of another shape or dtype: {short(changed)}")
    if missing:
        out.append(f"model tensors not in the checkpoint: {short(missing)}")
    if unexpected:
        out.append(f"checkpoint tensors this model does not have: {short(unexpected)}")
    return out


# ---- RNG state ------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")  # only if something imported it
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    np = sys.modules.get("numpy")  # loaded if anything here uses its RNG; never imported by the library
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuples(x: Any) -> Any:
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
