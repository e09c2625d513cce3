"""Deprecated: ``megatron_gspo.hooks`` moved to ``megatron_gspo.trainer.hooks``; this alias goes in 0.3.

Importing it warns once (FutureWarning) and binds this name to the module itself, so every name,
class identity and monkeypatch is the new module's.
"""

import sys
import warnings

from megatron_gspo.trainer import hooks as _moved

warnings.warn("megatron_gspo.hooks is deprecated and will be removed in 0.3: import megatron_gspo.trainer.hooks",
              FutureWarning, stacklevel=2)
sys.modules[__name__] = _moved
