"""Experiments built on megatron_gspo from the outside: they import the package, it never imports them.

Run them from the repository root as modules, e.g. ``python -m experiments.compare --help``; each
writes only into the output directory it is given.
"""
