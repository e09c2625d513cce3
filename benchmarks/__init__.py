"""Benchmarks against transformers (run.py) and their plot (plot.py); scripts, not a library:
``python -m benchmarks.run`` (or ``python benchmarks/run.py``) from the repository root."""
