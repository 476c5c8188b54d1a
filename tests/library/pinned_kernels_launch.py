"""launch.py with every GPU kernel choice pinned, so that runs of different process layouts
compute the same floating-point operations: ``torchrun ... tests/library/pinned_kernels_launch.py
RECIPE OVERRIDES...``.

- no TF32: fp32 convolutions and matmuls round to fp32, not to a 10-bit mantissa;
- cuDNN's deterministic algorithms only, chosen by its heuristics (a function of shapes, dtype
  and GPU), never by autotuning: autotuning times the candidates, and timing noise picks different
  algorithms (with different rounding) in different processes. launch.py turns autotuning on for
  GPUs, so the switch is made to ignore that.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
type(torch.backends.cudnn).benchmark = property(lambda _: False, lambda _, value: None)  # stays off

if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.argv[0] = os.path.join(ROOT, "launch.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
