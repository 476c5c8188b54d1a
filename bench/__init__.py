"""Benchmarks and their baselines (not part of the library): ``python -m bench.step --help``,
``bench/fallback_bench.py``, ``bench/baselines/``. They may use the recipe runner
(``distlib.runner``: models, environment report); the library never imports them."""
