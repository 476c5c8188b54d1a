"""``python -m distlib.runner.plan RECIPE [a.b=value ...] --nproc N [--gpu-gib G]``: the memory one rank
of a recipe needs at the peak of a training step, in each ``dist.shard`` and activation-checkpointing
mode, and whether it fits a GPU of G GiB. The work is done in ``distlib.runner.training.memory_plan``."""

import sys

from distlib.runner.training.memory_plan import main

if __name__ == "__main__":
    sys.exit(main())
