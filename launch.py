"""Train a recipe from a checkout: ``torchrun --nproc-per-node=N launch.py RECIPE.yaml [a.b=value ...]``
(or ``python launch.py``); the installed command is ``distlib-train`` / ``python -m distlib.runner``.
Exits 0 done, 2 bad input (``error: ...``), 1 a collective failed or a bug, 130/143 stopped by SIGINT/SIGTERM.
"""

from distlib.runner.cli import run

if __name__ == "__main__":
    run()  # its stop handlers first, then the imports of the run

from distlib.runner.main import main, parse_args  # noqa: E402, F401  (tests call launch.main)
