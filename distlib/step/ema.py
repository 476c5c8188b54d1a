"""An exponential moving average of a model's weights whose update is capturable in a CUDA graph.

``ema.update()`` moves every floating parameter and buffer of ``ema.module`` toward the model's
with foreach kernels and a lerp weight ``1 - decay`` that lives in a device tensor, so a captured
step can include the update and ``set_decay`` (a warm-up ramp) changes it without re-capture.
Same math as ``torch.optim.swa_utils.get_ema_multi_avg_fn`` with ``use_buffers=True``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA(nn.Module):
    """``ema.module`` is the average; call ``ema.update()`` after each optimizer step.

    ``state_dict`` holds the averaged module's tensors (``module.*``, as ``AveragedModel``'s does);
    the decay is a setting, not state. Non-floating buffers (BatchNorm's ``num_batches_tracked``) are copied.
    Parameters frozen when the EMA is made (``requires_grad=False``: a pretrained base under
    adapters) are the model's own in ``module``, not copies: the optimizer never changes them, so
    their average is themselves, and a copy would double the memory of the frozen base. One unfrozen
    later stays shared: the average then follows its current value.
    """

    def __init__(self, model: nn.Module, decay: float):
        super().__init__()
        _check_decay(decay)
        frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
        self.module = copy.deepcopy(model, memo=dict(frozen))  # deepcopy takes what its memo holds as is
        self.module.requires_grad_(False)
        ema_t = [*self.module.parameters(), *self.module.buffers()]
        model_t = [*model.parameters(), *model.buffers()]
        if len(ema_t) != len(model_t):
            raise ValueError("EMA: the model's parameters or buffers changed after the EMA was built")
        floats = [(e, m) for e, m in zip(ema_t, model_t) if e.is_floating_point() and e is not m]
        self._ema = [e for e, _ in floats]
        # the model's own tensors, not detached aliases: an alias keeps the storage it was made from, so
        # the average would stay on the old weights once they move (``param.data = ...``: the sharded
        # optimizer moves every parameter into its flat buffer); update() runs without grad anyway
        self._src = [m for _, m in floats]
        self._copied = [(e, m) for e, m in zip(ema_t, model_t) if not e.is_floating_point() and e is not m]
        device = self._ema[0].device if self._ema else torch.device("cpu")
        self.decay = float(decay)
        self._weight = torch.tensor(1.0 - self.decay, dtype=torch.float32, device=device)

    def set_decay(self, decay: float) -> None:
        """Decay used by the next updates (in place: a captured update reads the new value)."""
        _check_decay(decay)
        if decay != self.decay:
            self.decay = float(decay)
            self._weight.fill_(1.0 - self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """``ema = decay * ema + (1 - decay) * model``, with no host sync (capturable)."""
        if self._ema:
            diff = torch._foreach_sub(self._src, self._ema)
            torch._foreach_mul_(diff, self._weight)  # the Tensor overload: the weight is read on the device
            torch._foreach_add_(self._ema, diff)
        for e, m in self._copied:
            e.copy_(m)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Also reads the state of torch's ``AveragedModel`` (its update count is not needed here)."""
        state_dict = {k: v for k, v in state_dict.items() if k != "n_averaged"}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _check_decay(decay: float) -> None:
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
