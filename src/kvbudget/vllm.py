"""The old name of :mod:`kvbudget.engines.vllm.adapter` (the vLLM adapter), kept so that existing
imports keep working: this name is the same module object. New code imports
:mod:`kvbudget.engines.vllm.adapter`.
"""

import sys

import kvbudget.engines.vllm.adapter as _moved
from kvbudget.engines.vllm.adapter import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _moved
