"""``python -m distlib.runner.export RUN_DIR OUT_DIR [--dtype bf16|fp32] [--merge]``: a finished run's model as
files other programs load (a Hugging Face folder). The work is done in ``distlib.runner.models.export``."""

import sys

from distlib.runner.models.export import main

if __name__ == "__main__":
    sys.exit(main())
