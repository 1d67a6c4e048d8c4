"""The old name of :mod:`kvbudget.engines.fake` (the real-time fake engine with fault injection),
kept so that existing imports keep working: this name is the same module object. New code
imports :mod:`kvbudget.engines.fake`.
"""

import sys

import kvbudget.engines.fake as _moved
from kvbudget.engines.fake import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _moved
