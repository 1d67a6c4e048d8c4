"""The vLLM adapter: :class:`BudgetedEngine` puts a kvbudget Budget in front of vLLM's
``AsyncLLM`` (``adapter``). ``kvbudget.vllm`` is the same module as
:mod:`kvbudget.engines.vllm.adapter`, under its older, shorter name."""

from kvbudget.engines.vllm.adapter import *  # noqa: F403
from kvbudget.engines.vllm.adapter import __all__ as __all__
