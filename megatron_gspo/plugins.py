"""User code by its path: the one way the package imports a plug-in (rewards, losses, environments and tools).

A plug-in is ``package.module:name`` or ``path/to/file.py:name``; whatever its module does at import (raise, a syntax
error, ``sys.exit``) is one user error naming the key it came from, never a traceback and never the process's exit.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

from megatron_gspo.errors import ConfigError


def load_plugin_module(module_name: str, where: str, error: type[Exception] = ConfigError):
    """Import a plug-in's module (a dotted name or a .py file): the one way the package imports user code (rewards;
    environments and tools, env/tools.py). Whatever its import raises, SystemExit included (a module that calls
    sys.exit), is an ``error`` (ConfigError, or the caller's: EnvError) naming ``where`` and the module; only Ctrl-C
    goes through. A .py file is imported once per process, under a name made of its absolute path."""
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise error(f"{where}: file {module_name} not found")
            plugin_name = "_plugin_" + re.sub(r"\W", "_", os.path.abspath(module_name))
            if plugin_name in sys.modules:
                return sys.modules[plugin_name]
            spec = importlib.util.spec_from_file_location(plugin_name, module_name)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[plugin_name] = module  # as an import does: a dataclass or a pickle looks its module up there
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[plugin_name]
                raise
            return module
        try:
            return importlib.import_module(module_name)
        except ImportError as e:
            missing = getattr(e, "name", None) or ""
            if missing and (module_name == missing or module_name.startswith(missing + ".")):  # it does not exist
                raise error(f"{where}: cannot import module {module_name!r}: {e}") from None
            raise
    except (ConfigError, error, KeyboardInterrupt):
        raise
    except BaseException as e:  # the plug-in's own code failed while loading (syntax, imports, sys.exit, ...)
        raise error(f"{where}: loading {module_name} failed: {type(e).__name__}: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    """An import error's message on one line (a SyntaxError's str() is its message and (file, line))."""
    return " ".join(str(e).split())
