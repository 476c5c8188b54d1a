"""Room for the run's checkpoints: at the start, whether the disk of ``run.out_dir`` holds one.

A save that finds the disk full ends the run with one line (``distlib.checkpoint.disk``), the
checkpoints committed before intact; a run whose disk cannot hold even one checkpoint is told so
at its start, once, by rank 0, while there is still time to free space. The checkpoint's size is
estimated from the model before the optimizer's first step has made its state: every tensor of the
model at its global size (a sharded one's whole), the optimizer's state per parameter (AdamW: two
tensors of its shape and dtype; SGD with momentum: one), the weight average's copy. The frozen
parameters of a model that trains others (a LoRA model's base) are not counted: the checkpoints
leave them out, the model rebuilds them at every start.
"""

from __future__ import annotations

import math

from torch import nn

from distlib.checkpoint import disk
from distlib.log import get_logger

# optimizer state per parameter element, in the parameter's dtype: AdamW's two moments, SGD's momentum buffer
_STATE_PER_ELEMENT = {"adamw": 2, "sgd": 1}


def checkpoint_bytes(model: nn.Module, optimizer: str, *, momentum: float = 0.9, ema: bool = False,
                     weights_only: bool = False) -> int:  # fmt: skip
    """About the bytes of one checkpoint of ``model`` trained with ``optimizer`` (train.optimizer), over every
    rank. ``weights_only``: the model (and its average) alone (run.final_checkpoint=weights)."""
    # keep_vars: the parameters themselves, to tell the frozen ones by identity (a tied one has two names)
    state = model.state_dict(keep_vars=True)
    trains = any(p.requires_grad for p in model.parameters())
    tensors = sum(math.prod(t.size()) * t.dtype.itemsize for t in state.values()
                  if not (trains and isinstance(t, nn.Parameter) and not t.requires_grad))  # fmt: skip
    total = tensors * (2 if ema else 1)
    if not weights_only:
        per = _STATE_PER_ELEMENT.get(optimizer, 2) if optimizer != "sgd" or momentum else 0
        # torch's optimizers keep their state in the parameter's dtype (zeros_like)
        total += per * sum(math.prod(p.size()) * p.dtype.itemsize for p in model.parameters() if p.requires_grad)
    return total


def warn_if_no_room(directory: str, need: int) -> bool:
    """Warn (once: call it at the start) when the disk of ``directory`` has less than ``need`` bytes free;
    whether it warned."""
    free = disk.free_bytes(directory)
    if free is None or free >= need:
        return False
    get_logger().warning(
        "%s has %s free, less than one checkpoint of this run needs (about %s): a save will find the disk full "
        "and end the run; free space on that disk, or set run.out_dir to another",
        directory, disk.size(free), disk.size(need),
    )  # fmt: skip
    return True
