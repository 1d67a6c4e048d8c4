"""A gRPC server over :class:`kvbudget.vllm.BudgetedEngine` (``grpc.aio``, ``kvbudget.proto``).

Run it (the engine start takes ~20 s; the port opens when the engine is up)::

    python examples/grpc_server.py --model /tmp/tiny --build-tiny-model --port 50051

The service ``kvbudget.examples.v1.KvBudget`` (see ``examples/kvbudget.proto``) has a
server-streaming ``Generate`` RPC and a unary ``Snapshot`` RPC (the budget snapshot as JSON). No
generated stubs are checked in: :func:`load_protos` builds them from the ``.proto`` at start-up
with ``grpc.protos_and_services`` (grpcio-tools, part of the ``examples`` extra); clients use the
same function::

    import sys; sys.path.insert(0, "examples")
    from grpc_server import load_protos
    pb, svc = load_protos()
    async with grpc.aio.insecure_channel("127.0.0.1:50051") as ch:
        async for msg in svc.KvBudgetStub(ch).Generate(pb.GenerateRequest(prompt="hi",
                                                                          max_tokens=32)):
            print(msg.text, end="")

Behaviour this example owns:

* the service class and tenant come from the request fields, else from the metadata keys
  ``x-kvbudget-class`` / ``x-kvbudget-tenant`` (also ``x-kvbudget-durable``,
  ``x-kvbudget-on-exhausted``, ``x-kvbudget-task``), as the HTTP headers of the FastAPI example;
* the gRPC deadline becomes the kvbudget deadline (``context.time_remaining()`` seconds);
* overload -> ``RESOURCE_EXHAUSTED`` with the retry delay in the trailing metadata
  ``retry-after-ms`` (integer milliseconds);
* client cancellation (or a deadline that expires) cancels the handler, which closes the engine
  generator and so aborts the engine request; its KV returns when the engine confirms;
* a continuation ends the stream with ``finish_reason="continuation"`` and the ``continuation``
  message set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import pathlib
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _common  # the examples directory is not a package

import kvbudget
import kvbudget.errors
from kvbudget.auth import ApiKeys
from kvbudget.errors import Forbidden, Unauthorized
from kvbudget.observability import snapshot_to_dict

log = logging.getLogger("kvbudget.examples.grpc")

HERE = pathlib.Path(__file__).resolve().parent


def load_protos() -> tuple[Any, Any]:
    """``(messages, services)`` modules built from ``examples/kvbudget.proto`` at run time."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return grpc.protos_and_services("kvbudget.proto")  # type: ignore[no-any-return]


def _vllm_client_error(exc: BaseException) -> bool:
    """vLLM's own request validation (``VLLMClientError``: not a ValueError)."""
    return any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__)


class KvBudgetServicer:
    """The ``KvBudget`` service over one running BudgetedEngine."""

    def __init__(
        self, engine: Any, tokenizer: Any, max_model_len: int, pb: Any, model: str = "",
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.pb = pb
        self.model = model
        self.api_keys = api_keys
        self.vocab_size = _common.vocab_size(tokenizer)

    def _options(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        metadata = {
            k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)
        }
        key = None
        if self.api_keys is not None:  # Unauthorized: before anything else is looked at
            key = self.api_keys.authenticate(metadata.get("authorization"))
        opts = _common.options_from_headers(metadata)
        deadline = context.time_remaining()
        opts = _common.RequestOptions(
            service_class=request.service_class or opts.service_class,
            tenant=request.tenant or opts.tenant,
            task=opts.task,
            durable=request.durable or opts.durable,
            on_exhausted="continue" if request.allow_continuation else opts.on_exhausted,
            deadline=max(deadline, 1e-3) if deadline is not None else opts.deadline,
        )
        asked = request.service_class or metadata.get(_common.HEADER_CLASS.lower()) or None
        return _common.apply_api_key(opts, key, asked)

    def _prompt(self, request: Any) -> list[int]:
        if len(request.prompt_token_ids):
            return _common.check_token_ids(
                list(request.prompt_token_ids), self.vocab_size, "prompt_token_ids"
            )
        ids = list(self.tokenizer.encode(request.prompt)) if request.prompt else []
        if not ids:
            raise _common.BadRequest("prompt or prompt_token_ids is required", "prompt")
        return ids

    def _sampling(self, request: Any, prompt_len: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = self.max_model_len - prompt_len
        if room < 1:
            raise _common.BadRequest(
                f"the prompt has {prompt_len} tokens; the model's context is {self.max_model_len}"
            )
        if request.max_tokens > self.max_model_len:
            raise _common.BadRequest(
                f"max_tokens={request.max_tokens} cannot be greater than max_model_len="
                f"{self.max_model_len}", "max_tokens",
            )
        fields = {"temperature": float(request.temperature)}
        if request.HasField("seed"):
            fields["seed"] = int(request.seed)
        kw: dict[str, Any] = {
            # the hard max is min(max_tokens, room) whatever was asked: vLLM caps it too
            "max_tokens": min(request.max_tokens or room, room),
            "ignore_eos": request.ignore_eos,
            "output_kind": RequestOutputKind.DELTA,
            **_common.sampling_values(fields),
        }
        try:
            return SamplingParams(**kw)
        except Exception as exc:
            if _vllm_client_error(exc) or isinstance(exc, ValueError | TypeError):
                raise _common.BadRequest(str(exc)) from None
            raise

    async def Generate(  # the RPC name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        from vllm import TokensPrompt

        pb = self.pb
        received_at = self.engine.budget.now()
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            opts = dataclasses.replace(self._options(request, context), received_at=received_at)
            if request.model and request.model != self.model:
                raise _common.ModelNotFound(request.model)
            ids = self._prompt(request)
            sampling = self._sampling(request, len(ids))
        except Unauthorized as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        except Forbidden as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            return
        except _common.ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            return
        except (ValueError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        stream = self.engine.generate(
            TokensPrompt(prompt_token_ids=ids), sampling, rid, **opts.kwargs()
        )
        generated = 0
        try:
            async for out in stream:
                comp = out.outputs[0]
                generated += len(comp.token_ids)
                reason = ""
                if out.finished:
                    reason = comp.finish_reason or "stop"
                    if reason == "abort":
                        raise kvbudget.EngineError(rid, "the engine aborted the request")
                yield pb.GenerateResponse(
                    request_id=rid, text=comp.text, token_ids=list(comp.token_ids),
                    generated_tokens=generated, finish_reason=reason,
                )
                if out.finished:
                    return
        except kvbudget.ContinuationRequired as exc:
            c = exc.continuation
            yield pb.GenerateResponse(
                request_id=rid, generated_tokens=c.generated_tokens,
                finish_reason="continuation",
                continuation=pb.Continuation(
                    continuation_id=c.continuation_id, generated_tokens=c.generated_tokens,
                    remaining_tokens=c.remaining_tokens,
                ),
            )
        except kvbudget.Overloaded as exc:
            retry_ms = str(_common.retry_after_ms(exc.retry_after))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"overloaded ({exc.reason}); retry after {exc.retry_after:.3f}s",
                trailing_metadata=(("retry-after-ms", retry_ms),),
            )
        except (kvbudget.InvalidInput, kvbudget.errors.UnknownName) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except kvbudget.EngineError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except Exception as exc:
            if _vllm_client_error(exc):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        finally:
            # cancellation (client gone, deadline) lands here too: closing the engine generator
            # aborts the engine request
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await asyncio.shield(aclose())

    async def Snapshot(  # the RPC name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        data = snapshot_to_dict(self.engine.snapshot())
        data["names"] = self.engine.budget.names.to_dict()
        return self.pb.SnapshotResponse(json=json.dumps(data))


async def serve(argv: list[str] | None = None) -> None:
    parser = _common.make_parser("gRPC server over kvbudget + vLLM", 50051)
    args = parser.parse_args(argv)
    _common.api_keys(args)  # a bad keys file stops the server before the engine starts
    _common.configure_env()
    _common.configure_logging(args.events)
    pb, services = load_protos()
    path = _common.prepare_model(args)
    async with _common.running_engine(args) as engine:
        tokenizer = _common.load_tokenizer(engine, path)
        max_model_len = int(engine.max_model_len)
        server = grpc.aio.server()
        services.add_KvBudgetServicer_to_server(
            KvBudgetServicer(
                engine, tokenizer, max_model_len, pb, _common.model_name(args),
                _common.api_keys(args),
            ),
            server,
        )
        address = f"{args.host}:{args.port}"
        server.add_insecure_port(address)
        await server.start()
        print(f"kvbudget example: gRPC on {address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=2.0)


def main() -> None:
    asyncio.run(serve())


if __name__ == "__main__":  # required: vLLM's engine core and workers are processes
    main()
