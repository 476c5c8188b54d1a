"""The output layer and the cross-entropy in chunks of tokens, never holding the whole logits
(``loss.chunks``; docs/loss.md).

At Llama-3's 128k vocabulary and 8 x 2048 tokens the plain loss holds 4 GiB of bf16 logits, their
8 GiB fp32 copy and the gradients of both: the largest single term of a step's peak. Here the
model returns its last hidden states to ``head`` (inside its own forward, so that a fully sharded
output layer is the one FSDP2 gathered for it), which takes the logits of one chunk of tokens at
a time, their summed cross-entropy and, at once, that chunk's share of the gradients of the hidden
states and of the output matrix (the softmax minus the smoothed one-hot, multiplied back); only
those gradients are kept until the backward, which scales them by the loss's gradient. So the
matrix products are the plain loss's three, and one chunk's logits are all that ever exist.

A vocabulary that is not a multiple of ``VOCAB_ALIGN`` (GPT-2's 50257, Granite's 49155) is padded
with zero rows of the output matrix for those products: their rows of logits then have a length
cuBLAS's fast kernels take (an odd row length leaves it kernels that read one element at a time:
on one H100, GPT-2 large's three output-layer products took 51 ms of a 253 ms step in them). The
padded logits are -inf, so they add nothing to the softmax, and their gradient is zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor  # imported by torch itself: free

from distlib.runner.data.text import IGNORED
from distlib.runner.tasks.losses import StepLoss, cross_entropy

if TYPE_CHECKING:
    from distlib.runner.config import Config

VOCAB_ALIGN = 64  # the output matrix's rows padded to a multiple of this (as nanoGPT pads 50257 to 50304)


def _chunk(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, smoothing: float, grads: bool, vocab: int):
    """One chunk: the summed cross-entropy of its trained rows (fp32) and, with ``grads``, the
    gradient of that sum with respect to the chunk's logits (computed in fp32, returned in ``h``'s
    dtype, the products' operand: compiled, the cast is part of the softmax's kernel and no fp32
    gradient of a chunk's logits is ever stored; zero on ignored rows and on the padded columns past
    ``vocab``)."""
    logits = (h @ weight.t()).float()  # in the inputs' dtype, as autocast's linear, then fp32 as the plain loss
    real = torch.arange(logits.shape[-1], device=logits.device) < vocab
    if logits.shape[-1] > vocab:  # the padded rows of the output matrix: no token's logit
        logits = torch.where(real, logits, float("-inf"))
    keep = y != IGNORED
    safe = torch.where(keep, y, 0)
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    if smoothing:
        mean = logits[:, :vocab].mean(-1)
        loss = (1 - smoothing) * nll + smoothing * (lse - mean)
    else:
        loss = nll
    total = torch.where(keep, loss, 0).sum()
    if not grads:
        return total, None
    g = torch.softmax(logits, dim=-1)  # d loss / d logits = softmax - (1 - e) onehot - e / V
    if smoothing:
        g -= torch.where(real, smoothing / vocab, 0.0)
    g.scatter_add_(1, safe.unsqueeze(1), torch.full_like(g[:, :1], -(1 - smoothing)))
    g *= keep.unsqueeze(1)
    return total, g.to(h.dtype)


_compiled: dict[str, object] = {}  # the backend: _chunk compiled with it (one graph a chunk shape)


def _chunk_fn(compile_backend: str | None):
    if compile_backend is None:
        return _chunk
    if compile_backend not in _compiled:
        _compiled[compile_backend] = torch.compile(_chunk, backend=compile_backend, dynamic=False)
    return _compiled[compile_backend]


_fp32_addmm = {"cuda": True}  # where an addmm of 16-bit operands into fp32 works: CUDA (cuBLAS), torch >= 2.11


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in fp32. Operands of ``acc``'s dtype: ``addmm_``. 16-bit operands
    on CUDA: one cuBLAS product that reads and writes ``acc`` in fp32 in place (``addmm``'s
    ``out_dtype``), where the product in the operands' dtype, then added, writes a 16-bit vocabulary x
    width temporary (0.5 GiB at Llama-3's vocabulary) and reads it back for every chunk. Elsewhere
    (the CPU has no such kernel): the product in the operands' dtype, as the plain loss's, summed in
    fp32 (``add_`` promotes each element as it reads it). Fake tensors (the memory plan, which plans
    a GPU's step on the CPU): nothing, as the CUDA product allocates nothing (torch's decomposition of
    the op, which fake tensors would run, makes two fp32 temporaries the kernel does not)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if isinstance(acc, FakeTensor):
        return
    where = acc.device.type
    if _fp32_addmm.get(where, False):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except torch.OutOfMemoryError:  # a failure of the product itself, not of the op's support
            raise
        except (RuntimeError, NotImplementedError, TypeError):  # a torch without it: checked before any write
            _fp32_addmm[where] = False
    acc.add_(a @ b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, chunks: int, smoothing: float,
                grads: bool, weight_grad: bool, compile_backend: str | None):  # fmt: skip
        chunk = _chunk_fn(compile_backend)
        vocab = weight.shape[0]
        if vocab % VOCAB_ALIGN:  # zero rows: aligned products (the module's docstring)
            weight = F.pad(weight, (0, 0, 0, -vocab % VOCAB_ALIGN))
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_h = torch.empty_like(h) if grads else None
        # a frozen output layer (adapters train the rest): no gradient of it to compute or keep
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if grads and weight_grad else None
        start = 0
        for hc, yc in zip(h.chunk(chunks), y.chunk(chunks)):
            part, g = chunk(hc, weight, yc, smoothing, grads, vocab)
            total += part
            if grads:
                torch.mm(g, weight, out=grad_h[start : start + hc.shape[0]])  # its rows of grad_h: no copy
                if grad_w is not None:  # fp32 accumulation over the chunks
                    _accumulate(grad_w, g.t(), hc)
            start += hc.shape[0]
        if grads:
            ctx.save_for_backward(grad_h, grad_w[:vocab].to(weight.dtype) if grad_w is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return grad_h * grad_out.to(grad_h.dtype), grad_w, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    *,
    chunks: int = 8,
    label_smoothing: float = 0.0,
    compile_backend: str | None = None,
) -> torch.Tensor:
    """``cross_entropy(head(hidden), targets, reduction="sum")`` over the targets that are not
    ``IGNORED``, in ``chunks`` chunks of tokens: the same loss and gradients (hidden states, the
    output matrix), never all the logits at once. ``head``: the output layer, a bias-free
    ``nn.Linear`` (anything else is applied whole: the plain loss). Under autocast the products run
    in its dtype, as ``head(hidden)`` would; the softmax in fp32. ``compile_backend``: each chunk's
    work compiled with it (``train.compile``: one kernel from the product's output to its gradient)."""
    weight = getattr(head, "weight", None)
    if type(head) is not nn.Linear or head.bias is not None or weight is None:
        logits = head(hidden)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORED,
                               reduction="sum", label_smoothing=label_smoothing)  # fmt: skip
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    h, w = hidden.flatten(0, -2).to(dtype), weight.to(dtype)
    grads = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)  # evaluation: the loss alone
    # compiled (each chunk; the whole model around it, train.compile=model): the Function kept out of graphs
    apply = _apply_outside_graphs() if compile_backend is not None else _LinearCrossEntropy.apply
    with torch.autocast(device, enabled=False):
        return apply(h, w, targets.flatten(), max(1, chunks), label_smoothing, grads, w.requires_grad,
                     compile_backend)  # fmt: skip


_outside: dict[str, Callable] = {}  # "apply": the Function's apply behind torch.compiler.disable, made once


def _apply_outside_graphs() -> Callable:
    """The loss's autograd Function, never traced into a graph around it: compiled whole
    (``train.compile=model``), the model's graph ends at the hidden states and this runs between its
    forward and backward, as under compiled blocks. Traced, its forward's gradients (intermediates
    it fills in place and keeps for the backward) are what dynamo cannot carry out of the Function's
    graph: torch 2.14 refuses them ("an intermediate tensor ... aliases an input or output"), and
    torch 2.11 drops them, so the model trains nothing. Each chunk is still compiled with its
    ``compile_backend``. Made at the first call, not at import: ``torch.compiler.disable`` imports
    dynamo, which a run that compiles nothing never needs (tests/runner/test_startup_imports.py)."""
    if "apply" not in _outside:
        _outside["apply"] = torch.compiler.disable(_LinearCrossEntropy.apply)
    return _outside["apply"]


def _apply(hidden: torch.Tensor, head: nn.Module, *, targets: torch.Tensor, chunks: int, label_smoothing: float,
           compile_backend: str | None) -> torch.Tensor:  # fmt: skip
    return linear_cross_entropy(hidden, head, targets, chunks=chunks, label_smoothing=label_smoothing,
                                compile_backend=compile_backend)  # fmt: skip


def chunks_applied(cfg: Config) -> int:
    """The chunks a run of ``cfg`` applies its loss in, given a model that takes ``head`` (else 0: the
    plain loss): ``loss.chunks`` for the built-in cross_entropy (``loss.args`` at most its
    label_smoothing). The task's loss and the memory plan both ask here, so the plan is that of the
    loss that runs."""
    c = cfg.loss
    if not c.chunks or c.name != "cross_entropy" or set(c.args) - {"label_smoothing"}:
        return 0
    return c.chunks


def chunked_cross_entropy(chunks: int, label_smoothing: float = 0.0, compile_backend: str | None = None) -> StepLoss:
    """The causal-LM cross-entropy as a ``StepLoss`` whose ``head(targets)`` the model applies to its
    hidden states and output layer (``model(x, head=...)``) and returns the summed loss of. Given
    logits instead (a step that called the model without the head: dist.mode=fallback, where
    Replicas calls the model), the plain summed cross-entropy. ``compile_backend``: see
    ``linear_cross_entropy``."""
    plain = functools.partial(cross_entropy, label_smoothing=label_smoothing, reduction="sum")
    if compile_backend is not None:  # made here, before any graph of the model traces the loss
        _apply_outside_graphs()

    def head(targets: torch.Tensor) -> Callable[[torch.Tensor, nn.Module], torch.Tensor]:
        return functools.partial(_apply, targets=targets, chunks=chunks, label_smoothing=label_smoothing,
                                 compile_backend=compile_backend)  # fmt: skip

    def parts(out: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = out if out.dim() == 0 else plain(out, targets)
        return total, torch.zeros((), device=total.device)

    return StepLoss(parts, head=head)


__all__ = ["chunked_cross_entropy", "chunks_applied", "linear_cross_entropy"]
