"""``python -m distlib.runner RECIPE.yaml [a.b=value ...]`` (under ``torchrun -m`` too): see ``distlib.runner.cli``."""

from distlib.runner.cli import run

if __name__ == "__main__":
    run()
