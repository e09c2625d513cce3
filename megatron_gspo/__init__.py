"""megatron-gspo: GSPO (and GRPO) reinforcement-learning post-training of MoE models on megatron-core."""

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict) -> tuple:
    """``(__getattr__, __dir__)`` for a package whose names (``exports``: name -> its submodule) are imported
    from their submodule on first use, so that importing one submodule does not import the whole package."""
    import importlib
    import sys

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
        return value

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
