"""Benchmarks and their baselines (not part of the library): one entry point per kind of
measurement (``bench/run.sh --help`` lists them; docs/benchmarks.md says how they measure), the
hand-written baselines in ``bench/baselines/``. They may use the recipe runner (``distlib.runner``:
models, environment report); the library never imports them."""
