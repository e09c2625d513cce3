"""Deprecated: ``megatron_gspo.rewards`` moved to ``megatron_gspo.data.rewards``; this alias goes in 0.3.

Importing it warns once (FutureWarning) and binds this name to the module itself, so every name,
class identity and monkeypatch is the new module's.
"""

import sys
import warnings

from megatron_gspo.data import rewards as _moved

warnings.warn("megatron_gspo.rewards is deprecated and will be removed in 0.3: import megatron_gspo.data.rewards",
              FutureWarning, stacklevel=2)
sys.modules[__name__] = _moved
