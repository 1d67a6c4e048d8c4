"""The old name of :mod:`kvbudget.sim.engine_model` (the simulator's virtual-time engine model),
kept so that existing imports keep working: this name is the same module object. New code
imports :mod:`kvbudget.sim.engine_model`.
"""

import sys

import kvbudget.sim.engine_model as _moved
from kvbudget.sim.engine_model import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _moved
