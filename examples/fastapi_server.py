"""An OpenAI-compatible HTTP server over :class:`kvbudget.vllm.BudgetedEngine` (FastAPI).

Run it (the tiny test model makes it work on a laptop; the engine start takes ~20 s)::

    python examples/fastapi_server.py --model /tmp/tiny --build-tiny-model --port 8000

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: streaming (server-sent events,
  ``data: {...}\\n\\n`` … ``data: [DONE]\\n\\n``) and not; the official ``openai`` client works.
* ``GET /v1/models``; ``GET /health``.
* ``GET /metrics``: the budget in Prometheus text format (``kvbudget_*`` names, see
  ``docs/operations.md``); ``GET /kvbudget/snapshot``: the budget snapshot as JSON (what
  ``kvbudget inspect URL`` prints).

Budget headers (all optional): ``X-KVBudget-Class`` (service class, default ``interactive``),
``X-KVBudget-Tenant`` (default ``default``), ``X-KVBudget-Task``, ``X-KVBudget-Durable: 1`` (the
request keeps running if the client goes away), ``X-KVBudget-Deadline`` (seconds),
``X-KVBudget-On-Exhausted: continue`` (end with a continuation rather than wait for the grant to
grow).

Behaviour this example owns:

* overload -> HTTP 429, ``Retry-After`` (whole seconds, rounded up), ``retry-after-ms``, and an
  OpenAI-style error body (``{"error": {"type": "overloaded", "code": "rate_limit_exceeded",
  ...}}``); the openai client raises ``openai.RateLimitError``;
* a client that disconnects mid-stream -> the engine generator is closed, which aborts the engine
  request; its KV returns to the budget when the engine confirms (watch ``reserved_blocks`` in
  ``/kvbudget/snapshot``);
* a request that ends with a continuation -> its final chunk (or response) has
  ``finish_reason: "continuation"`` and ``kvbudget: {"continuation_id", "generated_tokens",
  "remaining_tokens"}``; ``finish_reason: "length"`` only ever means the hard maximum.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import pathlib
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _common  # the examples directory is not a package

import kvbudget
import kvbudget.errors
from kvbudget.errors import Forbidden, Unauthorized
from kvbudget.guard import DEFAULT_KEEP_ALIVE_S, RequestGuard, api_key_of, error_body
from kvbudget.observability import PrometheusExporter, snapshot_to_dict
from kvbudget.validate import check_int
from kvbudget.vllm import MAX_PARALLEL_SAMPLES

log = logging.getLogger("kvbudget.examples.fastapi")


# -- errors ----------------------------------------------------------------------------------


def error_response(
    status: int, message: str, type_: str, code: str | int | None = None,
    headers: dict[str, str] | None = None, param: str | None = None,
) -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse(error_body(message, type_, code, param), status_code=status,
                        headers=headers)


def overloaded_response(exc: kvbudget.Overloaded) -> JSONResponse:
    return error_response(
        429,
        f"the server is overloaded ({exc.reason}); retry after {exc.retry_after:.2f}s",
        "overloaded",
        "rate_limit_exceeded",
        headers={
            "Retry-After": str(_common.retry_after_seconds(exc.retry_after)),
            "retry-after-ms": str(_common.retry_after_ms(exc.retry_after)),
        },
    )


def _vllm_client_error(exc: BaseException) -> bool:
    """vLLM's own request validation (``VLLMClientError``: not a ValueError)."""
    return any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__)


def exception_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, kvbudget.Overloaded):
        return overloaded_response(exc)
    if isinstance(exc, _common.ModelNotFound):
        return error_response(404, str(exc), "NotFoundError", 404, param="model")
    if isinstance(exc, Unauthorized):
        return error_response(401, str(exc), "invalid_request_error", "invalid_api_key")
    if isinstance(exc, Forbidden):
        return error_response(403, str(exc), "permission_error", "permission_denied",
                              param=_common.HEADER_CLASS)
    if isinstance(exc, _common.BadRequest):
        return error_response(400, str(exc), "invalid_request_error", param=exc.param)
    if isinstance(exc, kvbudget.InvalidInput):
        return error_response(400, str(exc), "invalid_request_error", param=exc.field)
    if isinstance(exc, kvbudget.errors.UnknownName):
        return error_response(400, str(exc), "invalid_request_error", param=exc.kind)
    if _vllm_client_error(exc) or type(exc).__name__ == "ValueError":  # vLLM's validation
        return error_response(400, str(exc), "invalid_request_error")
    if isinstance(exc, kvbudget.EngineError):
        return error_response(500, str(exc), "engine_error", "engine_error")
    return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")


def error_payload(exc: BaseException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(bytes(exception_response(exc).body))
    return body


# -- one generation, as a sequence of events --------------------------------------------------


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    index: int = 0  # the choice (n > 1: one per sample)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Finish:
    reason: str
    generated: int
    kvbudget: dict[str, Any] | None = None
    index: int = 0


async def run_generation(
    engine: Any, prompt_ids: list[int], sampling: Any, request_id: str,
    opts: _common.RequestOptions,
) -> AsyncGenerator[Delta | Finish, None]:
    """Drive ``engine.generate`` and turn its ``RequestOutput``s into deltas and one finish per
    choice (``n`` of each for ``n`` samples: the adapter runs them as ``n`` budget requests
    that share the prompt's blocks).

    Closing this generator closes the engine's generator, which aborts the engine request (unless
    the request is durable). Overloaded/EngineError propagate; a continuation becomes a Finish
    (with ``n > 1`` the first continuation ends every sample).
    """
    from vllm import TokensPrompt

    generated: dict[int, int] = {}
    ended: set[int] = set()
    sink = _durable_sink if opts.durable else None
    stream = engine.generate(
        TokensPrompt(prompt_token_ids=prompt_ids), sampling, request_id, sink=sink,
        **opts.kwargs(),
    )
    try:
        async for out in stream:
            for comp in out.outputs:
                i = comp.index
                n = len(comp.token_ids)
                generated[i] = generated.get(i, 0) + n
                if n or comp.text:
                    yield Delta(comp.text, list(comp.token_ids), i)
                if comp.finish_reason is not None and i not in ended:
                    if comp.finish_reason == "abort":
                        raise kvbudget.EngineError(request_id, "the engine aborted the request")
                    ended.add(i)
                    yield Finish(comp.finish_reason, generated[i], index=i)
            if out.finished:
                return
    except kvbudget.ContinuationRequired as exc:
        cont = exc.continuation
        yield Finish("continuation", cont.generated_tokens, _common.continuation_fields(cont))
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()


def _durable_sink(result: Any) -> None:
    """Where a durable request's result goes when its caller may be gone (here: the log)."""
    log.info("durable request %s ended: %s", result.request_id, getattr(result, "outcome", "?"))


# -- server-sent events with disconnect detection ----------------------------------------------


class SSEResponse(Response):
    """Streams ``chunks`` as server-sent events and watches for the client going away.

    On a disconnect the stream is cancelled and ``chunks`` closed at once (not at the next
    write, not by the garbage collector), so the engine request is aborted promptly even while
    the request waits for admission or for its grant to grow.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[str, None]) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for chunk in self.chunks:
                    await send(
                        {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                    )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # uvicorn's ClientDisconnected: the client is gone
                pass
            finally:
                with anyio.CancelScope(shield=True):
                    await self.chunks.aclose()
                tg.cancel_scope.cancel()


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# -- the app -----------------------------------------------------------------------------------


class Server:
    """The running engine and what the handlers need from it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = _common.model_name(args)
        self.engine: Any = None
        self.tokenizer: Any = None
        self.exporter: PrometheusExporter | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        from prometheus_client import CollectorRegistry

        path = _common.prepare_model(self.args)
        async with _common.running_engine(self.args) as engine:
            self.tokenizer = _common.load_tokenizer(engine, path)
            self.engine = engine
            self.max_model_len = int(engine.max_model_len)
            self.vocab_size = _common.vocab_size(self.tokenizer)
            # a registry of our own: /metrics shows the budget only (vLLM has its own metrics)
            self.exporter = PrometheusExporter(engine, registry=CollectorRegistry())
            print(f"kvbudget example: serving {self.model} on http://{self.args.host}:"
                  f"{self.args.port}", flush=True)
            try:
                yield
            finally:
                self.exporter.unregister()
                self.engine = None

    # -- request parsing -------------------------------------------------------------------------
    # Everything a client sends is checked here, before the budget sees the request: a bad
    # value is a 400 (404 for another model) with an OpenAI-style body, never a 500.

    def sampling(self, body: dict[str, Any], prompt_len: int, default_max: int | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        n = _common.number(body, "n", lo=1, hi=MAX_PARALLEL_SAMPLES, integer=True)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise _common.BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len}", "prompt" if not body.get("messages") else "messages",
            )
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = _common.number(body, name, lo=1, hi=self.max_model_len, integer=True)
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else room
        # the hard max is min(max_tokens, room): what the prompt leaves is the ceiling
        max_tokens = min(max_tokens, room)
        kw: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "ignore_eos": _flag(body, "ignore_eos"),
            "output_kind": RequestOutputKind.DELTA,
            "n": n or 1,
        }
        # the sampling fields this example passes on, in vLLM's ranges; a request whose output
        # a pause would change (seed, penalties, stop strings) is given a grant to its hard max
        # by the adapter (kvbudget.vllm.pause_blockers)
        kw.update(_common.sampling_values(body))
        if kw.get("min_tokens", 0) > max_tokens:
            raise _common.BadRequest("min_tokens must be <= max_tokens", "min_tokens")
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if (not isinstance(stops, list) or len(stops) > 16
                    or not all(isinstance(x, str) and x for x in stops)):
                raise _common.BadRequest(
                    "stop must be a non-empty string or a list of at most 16 of them", "stop"
                )
            if stops:
                kw["stop"] = list(stops)
        try:
            return SamplingParams(**kw)
        except Exception as exc:  # vLLM's own checks (VLLMValidationError is no ValueError)
            if _vllm_client_error(exc) or isinstance(exc, ValueError | TypeError):
                raise _common.BadRequest(str(exc), getattr(exc, "parameter", None)) from None
            raise

    def encode(self, text: str, param: str, **kw: Any) -> list[int]:
        """The token ids of ``text``; text the tokenizer cannot take (a lone surrogate from a
        ``\\ud800`` escape, ...) is the client's mistake."""
        try:
            return list(self.tokenizer.encode(text, **kw))
        except (ValueError, TypeError) as exc:
            raise _common.BadRequest(f"{param} cannot be tokenized: {exc}", param) from None

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = self.encode(prompt, "prompt")
            if not ids:
                raise _common.BadRequest("prompt must not be empty", "prompt")
            return ids
        if isinstance(prompt, list) and prompt and not any(isinstance(t, str) for t in prompt):
            return _common.check_token_ids(prompt, self.vocab_size)
        if prompt is None or prompt == [] or prompt == "":
            raise _common.BadRequest("prompt is required (a string or a list of token ids)",
                                     "prompt")
        raise _common.BadRequest(
            "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
        )

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _common.BadRequest("messages must be a non-empty list", "messages")
        clean: list[dict[str, str]] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise _common.BadRequest(
                    f"messages[{i}] must be an object with a role in {sorted(CHAT_ROLES)}",
                    "messages",
                )
            clean.append({"role": m["role"], "content": _content(m.get("content"), i)})
        try:
            text = self.tokenizer.apply_chat_template(
                clean, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # the model's template refused them (jinja raises anything)
            raise _common.BadRequest(f"the chat template failed: {exc}", "messages") from None
        ids = self.encode(text, "messages", add_special_tokens=False)
        if not ids:
            raise _common.BadRequest("the messages render to an empty prompt", "messages")
        return ids

    def parse(
        self, request: Request, body: Any, chat: bool
    ) -> tuple[_common.RequestOptions, list[int], Any]:
        """The budget options, prompt token ids and sampling params of a request (BadRequest,
        ModelNotFound or Forbidden when something is wrong)."""
        if not isinstance(body, dict):
            raise _common.BadRequest("the body must be a JSON object")
        _common.check_model(body.get("model"), self.model)
        _common.check_supported(body)
        for name in ("stream", "return_token_ids"):
            _flag(body, name)
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or not isinstance(
                so.get("include_usage", False), bool)):
            raise _common.BadRequest("stream_options must be {\"include_usage\": bool}",
                                     "stream_options")
        headers = dict(request.headers)
        opts = _common.options_from_headers(headers)
        opts = _common.apply_api_key(
            opts, api_key_of(request.scope), headers.get(_common.HEADER_CLASS.lower())
        )
        ids = self.chat_prompt(body) if chat else self.completion_prompt(body)
        sampling = self.sampling(body, len(ids), None if chat else 16)
        return opts, ids, sampling

    # -- handlers --------------------------------------------------------------------------------

    async def handle(self, request: Request, chat: bool) -> Response:
        if self.engine is None:
            return error_response(503, "the engine is not running", "server_error")
        received_at = self.engine.budget.now()
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise _common.BadRequest(f"the body is not valid JSON: {exc}") from None
            opts, ids, sampling = self.parse(request, body, chat)
            opts = dataclasses.replace(opts, received_at=received_at)
        except (_common.BadRequest, _common.ModelNotFound, Forbidden) as exc:
            return exception_response(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        events = run_generation(self.engine, ids, sampling, rid, opts)
        try:  # the first event: admission (or Overloaded) happens here, before any header
            first = await events.__anext__()
        except StopAsyncIteration:
            return error_response(500, "the engine produced nothing", "server_error")
        except Exception as exc:
            await events.aclose()
            return exception_response(exc)
        fmt = _Format(
            rid, self.model, chat, len(ids), bool(body.get("return_token_ids")), sampling.n
        )
        if body.get("stream"):
            opts_stream = body.get("stream_options") or {}
            return SSEResponse(
                self.stream(events, first, fmt, bool(opts_stream.get("include_usage")))
            )
        try:
            text: dict[int, list[str]] = {}
            token_ids: dict[int, list[int]] = {}
            finishes: dict[int, Finish] = {}
            event: Delta | Finish | None = first
            while event is not None:
                if isinstance(event, Delta):
                    text.setdefault(event.index, []).append(event.text)
                    token_ids.setdefault(event.index, []).extend(event.token_ids)
                else:
                    finishes[event.index] = event
                event = await anext(events, None)
        except Exception as exc:
            return exception_response(exc)
        finally:
            await events.aclose()
        assert finishes
        choices = [
            ("".join(text.get(i, [])), finishes[i], token_ids.get(i, [])) for i in sorted(finishes)
        ]
        return JSONResponse(fmt.full(choices))

    async def stream(
        self, events: AsyncGenerator[Delta | Finish, None], first: Delta | Finish,
        fmt: _Format, include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        try:
            if fmt.chat:
                for i in range(fmt.n):
                    yield sse(fmt.chunk(None, "", role=True, index=i))
            event: Delta | Finish | None = first
            finishes: list[Finish] = []
            try:
                while event is not None:
                    if isinstance(event, Delta):
                        yield sse(fmt.chunk(
                            None, event.text, token_ids=event.token_ids, index=event.index
                        ))
                    else:
                        finishes.append(event)
                        yield sse(fmt.chunk(event, "", index=event.index))
                    event = await anext(events, None)
            except Exception as exc:  # after the headers: report it in the stream
                yield sse(error_payload(exc))
            if include_usage and finishes:
                yield sse(fmt.usage_chunk(finishes))
            yield sse("[DONE]")
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _common.BadRequest(f"{name} must be true or false", name)
    return value


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, null, or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _common.BadRequest(
        f"messages[{i}].content must be a string or a list of text parts", "messages"
    )


class _Format:
    """OpenAI response shapes for completions and chat completions."""

    def __init__(
        self, rid: str, model: str, chat: bool, prompt_tokens: int, token_ids: bool = False,
        n: int = 1,
    ) -> None:
        self.rid = rid
        self.n = n  # choices (parallel samples)
        self.model = model
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        #: send each choice's output token ids (vLLM's ``return_token_ids`` request field)
        self.token_ids = token_ids
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def usage(self, finishes: list[Finish]) -> dict[str, int]:
        generated = sum(f.generated for f in finishes)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.prompt_tokens + generated,
        }

    def chunk(
        self, finish: Finish | None, text: str, role: bool = False,
        token_ids: list[int] | None = None, index: int = 0,
    ) -> dict[str, Any]:
        reason = finish.reason if finish is not None else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": index, "delta": delta, "logprobs": None, "finish_reason": reason,
            }
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            out = self._head("text_completion")
        if self.token_ids:
            choice["token_ids"] = list(token_ids or [])
        out["choices"] = [choice]
        if finish is not None and finish.kvbudget is not None:
            out["kvbudget"] = finish.kvbudget
        return out

    def usage_chunk(self, finishes: list[Finish]) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = self.usage(finishes)
        return out

    def full(self, choices: list[tuple[str, Finish, list[int]]]) -> dict[str, Any]:
        """The whole answer: (text, finish, token ids) per choice, in index order."""
        out = self._head("chat.completion" if self.chat else "text_completion")
        out["choices"] = []
        for text, finish, token_ids in choices:
            choice: dict[str, Any] = (
                {"index": finish.index, "message": {"role": "assistant", "content": text}}
                if self.chat
                else {"index": finish.index, "text": text}
            )
            choice["logprobs"] = None
            choice["finish_reason"] = finish.reason
            if self.token_ids:
                choice["token_ids"] = token_ids
            out["choices"].append(choice)
            if finish.kvbudget is not None:
                out["kvbudget"] = finish.kvbudget
        out["usage"] = self.usage([f for _, f, _ in choices])
        return out


def create_app(args: argparse.Namespace) -> FastAPI:
    from starlette.exceptions import HTTPException

    server = Server(args)
    app = FastAPI(title="kvbudget OpenAI-compatible example", lifespan=server.lifespan)
    app.state.server = server
    # outermost: size limits (413) and, with --api-keys, the key (401) before any handler
    app.add_middleware(
        RequestGuard, api_keys=_common.api_keys(args), max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
    )

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # unknown path, wrong method: OpenAI-style too
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error",
                              exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(_request: Request, exc: Exception) -> Response:
        log.exception("unexpected error", exc_info=exc)
        return exception_response(exc)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": server.model, "object": "model", "created": server.created,
                "owned_by": "kvbudget", "max_model_len": server.max_model_len,
            }],
        }

    @app.get("/health")
    async def health() -> Response:
        ok = server.engine is not None
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if server.exporter is None:
            return Response("engine not running\n", status_code=503, media_type="text/plain")
        body, content_type = server.exporter.render()
        return Response(body, media_type=content_type)

    @app.get("/kvbudget/snapshot")
    async def snapshot() -> Response:
        if server.engine is None:
            return error_response(503, "the engine is not running", "server_error")
        data = snapshot_to_dict(server.engine.snapshot())
        data["names"] = server.engine.budget.names.to_dict()
        return JSONResponse(data)

    @app.get("/kvbudget/engine-profile")
    async def engine_profile(since: float | None = None, until: float | None = None) -> Response:
        # the simulator's model of this engine, fitted from the steps it ran since start, or
        # in a stretch of time.monotonic() (kvbudget simulate --engine-profile FILE reads it)
        if server.engine is None:
            return error_response(503, "the engine is not running", "server_error")
        status, body = server.engine.engine_profile_answer(since, until)
        return JSONResponse(body, status_code=status)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = _common.make_parser("OpenAI-compatible server over kvbudget + vLLM", 8000)
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    parser.add_argument(
        "--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE_S, metavar="SECONDS",
        help=f"idle keep-alive connections close after this (default {DEFAULT_KEEP_ALIVE_S}: "
             "longer than clients pool them, so a stalled client never reuses a closed one)",
    )
    args = parser.parse_args(argv)
    check_int("--timeout-keep-alive", args.timeout_keep_alive, minimum=1)
    _common.configure_env()
    _common.configure_logging(args.events)
    uvicorn.run(
        create_app(args), host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive,
    )


if __name__ == "__main__":  # required: vLLM's engine core and workers are processes
    main()
