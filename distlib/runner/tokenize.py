"""``python -m distlib.runner.tokenize INPUT... OUT_DIR --tokenizer PATH``: text files to token
shards the ``token_file`` data source reads. The work is done in ``distlib.runner.data.tokenize``."""

import sys

from distlib.runner.data.tokenize import main

if __name__ == "__main__":
    sys.exit(main())
