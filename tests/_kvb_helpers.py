"""Shared helpers for the budget / sim-engine tests (quiet logging, task counting, specs)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import pytest
import structlog

from kvbudget import RequestSpec


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@pytest.fixture(autouse=True)
def quiet_structlog() -> Iterator[None]:
    """Autouse in every module that imports it: warnings and up only, defaults restored after."""
    quiet_logs()
    yield
    structlog.reset_defaults()


def task_count() -> int:
    return len(anyio.get_running_tasks())


def spec(
    prompt: int = 16,
    max_tokens: int = 256,
    cls: str = "interactive",
    tenant: str = "default",
    **kw: object,
) -> RequestSpec:
    return RequestSpec(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        model_max_len=8192,
        service_class=cls,
        tenant=tenant,
        **kw,  # type: ignore[arg-type]
    )
