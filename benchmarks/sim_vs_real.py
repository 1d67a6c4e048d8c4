"""serve_bench's workloads through the real engine and through the simulator, side by side.

    .venv/bin/python benchmarks/sim_vs_real.py                  # real run + simulation
    .venv/bin/python benchmarks/sim_vs_real.py --real /tmp/sb    # a serve_bench --out DIR
    .venv/bin/python benchmarks/sim_vs_real.py --real sb.json --workload burst
    .venv/bin/python benchmarks/sim_vs_real.py --sim-only        # the simulator alone

This module owns the comparison of issue 13 (part 3): for every workload of
``benchmarks/serve_bench.py`` (its :data:`serve_bench.WORKLOADS`, imported, not copied) and for two
servers -- ``vllm`` (vLLM's own OpenAI server) and ``kvbudget`` (the FastAPI example over
:class:`kvbudget.vllm.BudgetedEngine`) -- it puts the real run's good / late / rejected beside the
simulator's, with the relative error.

The real side. Either this script runs ``serve_bench.py --servers vllm,kvbudget --out DIR`` once
(a subprocess; ~10 min for all workloads on the tiny CPU model), or ``--real FILE_OR_DIR`` reads a
run made before: a serve_bench ``--out`` directory (``records-<workload>-<server>-r<k>.json``; the
per-request records also feed the translation check below) or a file whose last JSON line is
serve_bench's result (``{"workloads": {NAME: {SERVER: {...}}}, ...}``). The requests simulated are
the ones that run sent: its workloads, ``--bench-arg``, seed, scale, policy and the policy's
settings among its ``--example-arg`` (``--first-token-pause-share``) come from the run
(its directory's ``settings.json``, its result's ``meta``); one given here that differs is refused.
So does the engine they ran on (serve_bench's ``--kv-blocks`` and ``--max-num-seqs``): the
simulated engine has that cache and batch limit whatever profile it is given.
A run made before serve_bench recorded them takes this command's, and the output warns (line and
JSON ``translation_mismatch``) where the simulated lengths are not the run's.

The simulated side (:func:`simulate_workloads`). The same requests: vLLM's random dataset is
re-drawn as ``vllm bench serve`` draws it (:func:`vllm_random_plan`: ``numpy.random.
default_rng(seed)`` integers for the input and output lengths exactly as
``vllm.benchmarks.datasets.utils.get_sampling_params``; arrivals from ``numpy.random.seed(seed)``
gamma gaps with shape ``burstiness`` and scale ``1 / (rate * burstiness)``, rescaled to end at ``n /
rate``, as ``vllm.benchmarks.serve.get_request``; ``rate inf``: all at 0); the prompt length is the
sampled one plus the tokenizer's special tokens (the BOS the server adds) plus the shared
``--random-prefix-len``, which becomes a shared system prompt whose full blocks the simulated
engine's prefix cache holds once. vLLM's ``prefix_repetition`` dataset (``multi-prefix``) is planned
as :func:`vllm_prefix_repetition_plan` draws it: each request's prefix after vLLM's shuffle, one
shared system prompt per prefix. ``--bench-arg`` is serve_bench's (with ``--real``, the run's own):
vLLM's general ``--input-len`` / ``--output-len`` replace the datasets' lengths as vLLM maps them,
and one naming the dataset, the count or the seed replaces serve_bench's; another dataset is
refused by name, and the output warns (JSON ``meta.unmodelled``) of options the simulated
requests do not follow, and of those (``--max-concurrency``, the ramp-up) that only the real
client's send times carry where the planned ones stand in.
Where the real run's records are at hand (an ``--out`` directory), each server's requests
arrive when the real client sent them to it (``--send-times``, default ``auto``; ``planned`` keeps
the plan): a client that is not scheduled for a while sends what fell due at once, and those
bursts are what a budget's turn-away reacts to. The client's send
times are the workload as it was really offered; what the servers did with it is still predicted.
The simulated streams are also read as that client read them: serve_bench records when the
client's own loop was stalled (``client_stalls``), and a token that comes during a stall is
timed at its end, and the simulated engine runs at ``--stall-speed`` of its speed meanwhile
(default 0.3: fitted on one run, where it put 11 of 12 cells within the target, against 8 with
the engine untouched and 6 on the planned send times; 1 leaves the engine alone). That figure
is fitted, not understood: those stalls (0.3-5 s, in most runs before serve_bench niced the
server's session as well as its processes) were the client starved by the server, not the
machine stopped, and since then runs have had none, so for them the replay is the send times
alone.
A run of several repeats is simulated once per repeat, with that repeat's send times, and compared
as the medians the real side reports. The abandonment workload is serve_bench's own
:func:`serve_bench.abandon_plan` (same seed, same vocabulary), and a leaving client disconnects
once it has received its planned number of tokens
(``SimRequest.abandon_after_tokens``). The mixed workload is serve_bench's own
:func:`serve_bench.mixed_plan`: its backlog asks for the ``batch`` class, as its header does
(vLLM's baseline, like vLLM's server, does not look at the class), and a batch request is good
when it completes within ``serve_bench.BATCH_DEADLINE_S``. Every request asks for exactly its
output length (``max_tokens`` = length, ``ignore_eos``).

Servers in the simulator: ``vllm`` is the ``reserve-current`` baseline (vLLM v1 FCFS, no queue cap,
victims freed at once); each ``vllm-cap<N>`` of the real run (serve_bench's vLLM server with
``--max-num-queued-reqs N``) the same baseline with that cap (a caller refused with HTTP 503
when the requests not yet finished would be more than N, as ``AsyncLLM`` refuses it), paced by
its own streams as ``vllm`` is, and ranked with the others in the order check; ``kvbudget`` is
the example's policy (``--policy``, default ``calibrated``, with ``--first-token-pause-share``
where the run's ``--example-arg`` set it)
with the example's service classes (``kvbudget.DEFAULT_CLASSES``: every request is ``interactive``
but the mixed workload's backlog:
TTFT objective 2 s, admission wait at most 2 s, latency floor 200 ms) and the
``SchedulerConfig`` the vLLM adapter sets (:func:`simulated_config`: 4 tokens charged past every
grant's boundary); ``kvbudget-serve``, where the real run has it (``kvbudget serve``: vLLM's own
OpenAI app over the same ``BudgetedEngine``), is the same policy and budget (its
``--kvbudget-policy``, with ``--kvbudget-first-token-pause-share`` where the run's ``--serve-arg``
set it) on its own engine: the profile fitted from its own steps in each run and the pace of its
own streams, so what its heavier front end costs the engine comes in as that pace.
The engine is a fitted profile (``--engine-profile``): ``run`` (the default) is
the profile the kvbudget server fitted from its own engine steps over the real run (serve_bench
keeps it as ``engine-profile-kvbudget.json`` in its ``--out`` directory; with rotated repeats its
first start's, each run's own beside it): the same engine on the
same machine in the same stretch of time, so the machine's speed, which varies by tens of percent
between runs, is the real run's; without it (or with ``--real`` naming a JSON file or an older run)
the shipped ``vllm-cpu-tiny``. A file or a shipped name picks one explicitly. The engine's timing
and (where the records are at hand) the client's send times are the only things read from the run:
good / late / rejected are predicted from them. As in the real run, one server process serves the
workloads one after the other, so the budget's length and step-cost models are carried from one
workload to the next in serve_bench's order; each repeat starts from fresh models, as a server
serve_bench restarts for each repeat (``--rotate``, its default) does.

What the example's turn-away at arrival had learned (``--wait-outcomes``). It turns a caller away
on its forecast wait only where few recent queued callers forecast at about its pressure were
admitted in time (``SchedulerConfig.turn_away_wait_quantile``), so what it does in one workload
hangs on the outcomes the workloads before left it, band by band of pressure. serve_bench records
the real server's (its snapshot's ``wait_outcomes_by_band``) before each run, and the output sets
them beside the simulator's at each workload's start. By default (``sim``) the simulated server
starts each workload from what its simulated workloads before taught it: the state is predicted
too. With ``real`` (where the run recorded them) it starts from what the real server had
learned then, so one workload is predicted from the real state rather than from a carried one
that may have drifted: a diagnosis, not the default, since over the thirty-fifth session's four
recorded runs it missed 2 cells where the carried state missed 1 (docs/benchmarks-history.md). Why
it exists (the thirty-fifth session): in one run the real example turned callers of the overload
away from a forecast about twice their bound, in another of the same tree only past 2.8 times it,
and the simulator, whose carried outcomes put the moderate workload's callers at a higher pressure
than the real ones', followed the second; in a default run the simulated example's carried outcomes
had 11 of 43 callers forecast at 2.8-4x their bound served in time where the real one had none of 12
(and 12 of 54 past 4x, where the simulated one had none), and it served 57 of the multi-prefix
workload against the real 49 (51 from the real state; docs/benchmarks-history.md). The release rate
each server's budget started a workload from is set beside the simulated one's the same way
(serve_bench's ``release_rate``, the snapshot's ``release_rate_blocks_per_s``; the summary's
``release_rate_at_start``): it runs on a clock that stops while the engine holds no blocks, so a
wave's first callers are judged by the rate at which the workload before ended, and whether a fresh
caller takes the headroom or waits for those releases hangs on it (the thirty-seventh session's
multi-prefix miss). It is shown, not seeded.

vLLM's server's pace (``--pace run``, the default where the run's records are at hand). Nothing in
the run times the steps of vLLM's own server's engine, and the example's profile is its own engine's
pace over the whole run; on this 2-core machine the same server ran the same workload 20-25 % slower
in one repeat than in the next (its streams' mean gap between tokens 9.6 against 11.6 ms, and 145
against 112 good), and vLLM's server ran up to 52 % slower than the example's profile in two runs
and 10-17 % faster in another (docs/benchmarks-history.md: over six runs 11 of 18 vLLM cells missed
the target at the profile's pace, 5 at their own). So each of vLLM's cells is simulated at the pace
of its own repeat's streams: every step time (and the abort latency) scaled by one factor, found by
simulating (:func:`paced_simulation`: ``scale *= real gap / simulated gap`` until they agree within
2 %), where the gap is the mean time between consecutive tokens over the repeat's completed streams
(:func:`real_stream_gap`, what vLLM's inter-token latency histogram averages: decode steps, the
prefills mixed into them and preempted requests' waits). The shape of the step time stays the
profile's; what is still predicted is who waits and how long: good, late, rejected, TTFT. ``--pace
phases`` (the default) finds one such factor per window of the run: the run while its requests were
being sent and the run after are two phases, each cut into up to :data:`MAX_PHASE_WINDOWS` windows
of at least :data:`MIN_WINDOW_STREAMS` completed streams (:func:`phased_simulation`, each window
from the streams whose middle came in it, :func:`real_phase_gaps`); it falls back to one factor
where a phase has too few streams (:data:`MIN_PHASE_STREAMS`). Where the client stalled as well, the
engine runs in each of its stalls at ``--stall-speed`` of its window's speed (:func:`merged_spans`;
until the eighteenth session such a run fell back to one factor: vLLM's overload in one run then
came out 36 good simulated against 24 real, and 24 with the windows). In some runs vLLM's server ran
1.5x slower while 160 requests came in than after (its first streams 11.6 ms between tokens, later
ones 6-7 ms), and in one (the seventh session's second run) twice as slow in the first 6 s of the 14
s in which moderate's requests came, then at the later pace: one factor for the run, or one per
phase, then had the first streams finish early and the next callers admitted in time (34 good real,
58 simulated). With two phases only, over five runs (docs/benchmarks-history.md) it missed 2 of
vLLM's 26 cells against 6 with one factor; with windows, none of vLLM's cells in the 13 real runs
kept here. The example runs on its own engine profile of each run where serve_bench kept one (fitted
from its engine's steps in that run alone, ``engine-profile-kvbudget-<workload>-r<k>.json``,
:func:`stretch_profiles`; else the run's), and since the eighteenth session is paced by its streams
too, with each stream's pause left out of its gaps (its longest gap, where that is over
:data:`PAUSE_GAP_S`, serve_bench's stall; each stream gives way at most once): the pauses are its
policy's doing and what is predicted, not the engine's pace. Its streams went 7-15 % slower than
that profile (the front end's share between the steps), and the scheduler decides its pauses from
the pace its streams get: on its own profile the simulator had 42 of 66 frozen streams on shared
prefix and 52 of 76 on multi-prefix (``/tmp/sb18a``), 59 and 59 paced. ``--pace none`` runs both at
the run's profile's pace.

A what-if, not a prediction: ``--pace-of vllm`` runs every other server on vLLM's server's
engine as the replay paced it (its profile, and its step-time scale or window scales), each
still sent and read by its own client. The servers ran one after another, each on the same
2-core machine as its front end: what a heavier front end and the machine's drift between their
turns did to each engine's pace is then left out, and what is compared is the servers'
decisions on one engine (the summaries say ``paced_as``; docs/benchmarks-history.md, forty-first
session).

The servers' front ends (``--front-end run``; off by default). serve_bench counts the CPU time
of each server's front-end process over each workload; :func:`front_ends_of` fits each server's
cost per request and per streamed output from those counts
(:func:`kvbudget.sim.profile.fit_front_end`) and the simulated server gets that front end
(:class:`kvbudget.sim.engine_model.FrontEndModel`: one thread, first come first served, between
the clients and the engine). Measured here, both front ends used 18-40 % of a core over every
workload (140-240 us per streamed token), far from the saturation at which their queue would
shift good / late; the fit cannot tell the per-request cost from the per-token cost on these
workloads (their requests and tokens grow together), and the modelled front end moves no cell.
So it stays off by default, for a server whose front end is its bottleneck.

Outcomes, the same rule on both sides (serve_bench's :func:`serve_bench.classify`): ``good`` =
every requested token, TTFT <= 2 s and mean TPOT = (last token - first token) / (tokens - 1) <=
100 ms; ``late`` = complete but over either objective; ``rejected`` = turned away (HTTP 429 or
503); ``failed``; abandon also ``abandoned`` (the client left as planned). The sim's TTFT/TPOT
are per request from the driver's records (``simulate(..., keep_requests=True)``). The model's
context (``MAX_MODEL_LEN``) acts as on both real servers (:class:`ContextLimits`): a prompt it
cannot hold is refused before the engine and fails; a request whose output does not fit after
its prompt runs to the context's end and fails, short of the tokens it asked for.

Output: per workload and server a line of real and simulated good / late / rejected / abandoned,
the relative error of good and whether it meets the issue's target (within 15 % or 5 requests), the
pace band (the simulated good with every step time 2 % faster and slower, from the same start:
``good_at_pace_band``, :data:`PACE_BAND`; the pace is fitted only to within that, and where waves
of streams straddle the 2 s objective such a difference moves a whole wave, so the last line also
names a miss met within it, and ``error.within_target_in_pace_band`` says so; the target's verdict
stays the fitted pace's), real and simulated median TTFT and TPOT, per workload whether the servers
come in the same order (and ``same_order_in_pace_band``: whether the real order is within reach of
each server's band, named on the last line where the order differs); then the translation check
(records given: per request, the prompt length, output length and send time the real client used
against the simulated request's), the engine-speed check (vLLM's median TPOT real over simulated on
the lightly loaded abandonment workload: how fast the engine ran against the profile), the notes on
what the simulator does not model, and as the LAST line one JSON object ``{"workloads": {NAME:
{"vllm": {"real": {...}, "sim": {...}, "error": {...}}, "kvbudget": {...}, "same_order": bool,
"same_order_in_pace_band": bool}}, "notes": [...], "translation": {...}, "speed_check": {...},
"meta": {...}}``. ``--step-scale F`` is a what-if (every step-time figure times F), never the
default; ``meta.step_scale`` records it.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import attrs
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT / "src"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import serve_bench as sb  # noqa: E402

from kvbudget.core.config import SchedulerConfig  # noqa: E402
from kvbudget.core.cost import CostModel, StepTimeModel  # noqa: E402
from kvbudget.core.forecast import ForecastMemory, wait_pressure_band_from  # noqa: E402
from kvbudget.core.lengths import LengthModel  # noqa: E402
from kvbudget.core.model import Capacity  # noqa: E402
from kvbudget.core.policy import Policy, make_policy  # noqa: E402
from kvbudget.core.scheduler import Scheduler  # noqa: E402
from kvbudget.engines.vllm.adapter import (  # noqa: E402
    DEFAULT_SLACK_TOKENS,
    PREFILL_PROBES,
    prefill_probe_lengths,
    sampling_profile,
    stop_profile,
)
from kvbudget.policy_options import (  # noqa: E402
    POLICY_DEFAULT,
    add_first_token_pause_option,
    server_policy,
)
from kvbudget.sim.driver import simulate  # noqa: E402
from kvbudget.sim.engine_model import EngineModel, FrontEndModel  # noqa: E402
from kvbudget.sim.profile import EngineProfile, FrontEndRecord, fit_front_end  # noqa: E402
from kvbudget.sim.report import RequestRecord  # noqa: E402
from kvbudget.sim.scenario import Scenario, SimRequest, apply_scenario  # noqa: E402
from kvbudget.sim.workload import TraceRequest, Workload  # noqa: E402

_T = TypeVar("_T")

#: the two servers every comparison has: vLLM's own and the kvbudget example (vLLM's own server
#: with ``--max-num-queued-reqs N``, serve_bench's ``vllm-cap<N>``, and ``kvbudget serve`` are
#: compared too where the real run has them: :func:`serve_bench.queue_cap`, :data:`SERVE`)
SERVERS = ("vllm", "kvbudget")
#: ``kvbudget serve`` (vLLM's own OpenAI app over the budget), simulated where the real run has
#: it: the example's policy and budget on its own engine pace
SERVE = "kvbudget-serve"
#: the servers with a budget in front of the engine (the example and ``kvbudget serve``)
BUDGETED_SERVERS = ("kvbudget", SERVE)
#: ``kvbudget serve``'s option for the policy's first-token pause share (the example's is
#: ``--first-token-pause-share``)
SERVE_PAUSE_FLAG = "--kvbudget-first-token-pause-share"
#: the engine's speed while the client was stalled (``--stall-speed``): fitted on one run
#: (docs/benchmarks-history.md)
STALL_SPEED = 0.3
#: the simulator's stand-in for vLLM's own server
VLLM_POLICY = "reserve-current"

DEFAULT_PROFILE = "vllm-cpu-tiny"
#: ``--engine-profile run``: the profile serve_bench kept from the kvbudget server of the real run
RUN_PROFILE = "run"
RUN_PROFILE_FILE = "engine-profile-kvbudget.json"
#: ... or, in a run without the example, the one ``kvbudget serve`` fitted
SERVE_PROFILE_FILE = "engine-profile-kvbudget-serve.json"
#: the issue's target: simulated good within 15 % or 5 requests of the real run
TARGET_SHARE = 0.15
TARGET_REQUESTS = 5
COUNTS = ("good", "late", "rejected", "failed", "abandoned")

#: what the simulator does not model, printed with every comparison
NOTES = (
    "the engine is a fitted step-time profile (--engine-profile; by default the one the kvbudget "
    "example fitted from its own engine steps over the run, timed whole: from one step's stats "
    "to the next as its front end received them), the same shape for both servers; with "
    "--pace phases (the default where the run's records are at hand) vLLM's server runs it at "
    "the pace its own streams show in each repeat, in windows of the run while requests were "
    "sent and after (every step time scaled by one factor per window until the simulated "
    "streams' mean gap between tokens there is the real one's; --pace run: one factor): "
    "its API server's work around each "
    "step, its CPU contention with the engine core and the machine's speed in its stretch come "
    "in as those factors, not as their own shapes; the example's engine runs on "
    "the profile fitted from its steps in each repeat where serve_bench kept one (else the "
    "run's), paced the same way by its streams' gaps without their pauses (the pauses are "
    "predicted); where the client's stalls were "
    "recorded, the engine is taken to run at --stall-speed in them, one figure for every stall "
    "(fitted, not measured)",
    "the servers' front ends are not modelled unless --front-end run (measured here at 18-40 % "
    "of a core, their queue moves no cell); what taking in a request costs the machine "
    "(parsing, tokenizing, handing it to the engine core, on the cores the engine shares) is "
    "one figure, the intake (--intake-ms; the shipped profile's, measured from bursts of "
    "arrivals), added to the engine's next step for each request that arrived, the same for "
    "both servers: a server's own shape of that cost is not modelled",
    "prompt lengths are vLLM's sampled lengths plus the BOS; the few tokens its decode/re-encode "
    "adds or drops are not modelled (the translation check counts them when records are given)",
    "abandon: a client leaves exactly when its k-th token is generated; a real client reads "
    "streamed chunks late and may find the whole stream there already (left_after_finish)",
    "burst: greedy outputs are not compared (the sim has no text); prefix cache: a request's "
    "blocks are allocated at admission, not chunk by chunk",
)


# -- the workloads, as the simulator sees them --------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One request of a workload: when it is sent, its lengths, and when its client leaves."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int = 0
    system_prompt: int | None = None  # which shared prefix (None: no shared prefix)
    leave_after: int | None = None
    service_class: str = "interactive"  # (mixed: "batch" for its backlog)
    #: the calibration key's sampling and stop parts, as the adapter reads them off the
    #: request's sampling params (:func:`request_profiles`)
    sampling: str = "default"
    stops: str = "default"


@dataclass(frozen=True)
class TokenizerInfo:
    """What of the tokenizer the workloads depend on."""

    num_special: int  # tokens the tokenizer adds to a text prompt (the BOS)
    vocab_size: int
    special_ids: tuple[int, ...]


#: the tiny model of kvbudget.engines.tiny_model (tests use it without building the model)
TINY_TOKENIZER = TokenizerInfo(num_special=1, vocab_size=1024, special_ids=(0, 1, 2, 3, 4))


def tokenizer_info(model_dir: Path) -> TokenizerInfo:
    """Read :class:`TokenizerInfo` from ``model_dir/tokenizer.json`` (the ``tokenizers`` library,
    as vLLM's client loads the same file)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    post = tok.post_processor
    specials = tuple(sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special))
    return TokenizerInfo(
        num_special=int(post.num_special_tokens_to_add(False)) if post is not None else 0,
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
        special_ids=specials,
    )


_BENCH_DEFAULTS = {
    "random_input_len": 1024.0,
    "random_output_len": 128.0,
    "random_prefix_len": 0.0,
    "random_range_ratio": 0.0,
    "request_rate": math.inf,
    "burstiness": 1.0,
    # vLLM's prefix_repetition dataset
    "prefix_repetition_prefix_len": 256.0,
    "prefix_repetition_suffix_len": 256.0,
    "prefix_repetition_num_prefixes": 10.0,
    "prefix_repetition_output_len": 128.0,
}


#: ``vllm bench serve`` options the plan reads besides :data:`_BENCH_DEFAULTS`: vLLM's general
#: lengths (``--input-len``, ``--output-len``), and the dataset, count and seed that serve_bench
#: passes itself and a ``--bench-arg`` may override (the last one given wins, as in argparse)
_BENCH_PLANNED = frozenset({"input_len", "output_len", "dataset_name", "num_prompts", "seed"})
#: options that change neither what is sent nor when: sampling (every request runs to its length,
#: ``ignore_eos``), reporting and connection
_BENCH_NO_EFFECT = frozenset({
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "ignore_eos", "percentile_metrics", "metric_percentiles", "goodput",
    "save_result", "save_detailed", "append_result", "result_dir", "result_filename", "label",
    "metadata", "disable_tqdm", "plot_timeline", "plot_dataset_stats", "timeline_itl_thresholds",
    "backend", "base_url", "host", "port", "endpoint", "model", "served_model_name", "tokenizer",
    "tokenizer_mode", "trust_remote_code", "header", "insecure", "ready_check_timeout_sec",
    "request_id_prefix", "extra_body",
})
#: options that shape when requests are sent, which the planned send times leave out: only the
#: real client's send times (a run's records) carry them
_BENCH_SEND_TIMES = frozenset(
    {"max_concurrency", "ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps"}
)
#: the datasets the plan draws as vLLM's client does
_PLANNED_DATASETS = ("random", "prefix_repetition")


def bench_options(workload: sb.Workload) -> dict[str, float]:
    """The dataset and arrival options of a ``vllm-bench`` workload (vLLM's defaults where its
    ``bench_args`` say nothing). vLLM's general ``--input-len`` and ``--output-len`` replace the
    datasets' own lengths whatever their order, as ``vllm.benchmarks.serve.main`` maps them
    ("Map general length options to dataset-specific arguments")."""
    flags = sb.bench_flags(workload.bench_args)
    out = dict(_BENCH_DEFAULTS)
    for key in out:
        value = flags.get(key)
        if value is not None:
            out[key] = float(value)
    if flags.get("input_len") is not None:
        out["random_input_len"] = float(flags["input_len"] or 0)
    if flags.get("output_len") is not None:
        out["random_output_len"] = out["prefix_repetition_output_len"] = float(
            flags["output_len"] or 0
        )
    return out


def unmodelled_bench_args(workload: sb.Workload) -> tuple[list[str], list[str]]:
    """The ``--bench-arg`` options of ``workload`` the simulated requests do not follow: (those
    the plan does not read at all, those only a run's real send times carry). Options that do not
    change what is sent or when (:data:`_BENCH_NO_EFFECT`) are neither."""
    if workload.kind in sb.OWN_CLIENT_PLANS:
        return [], []  # (serve_bench's own client reads only its own options)
    ignored: list[str] = []
    send_times: list[str] = []
    for key in sb.bench_flags(workload.bench_args):
        if key in _BENCH_DEFAULTS or key in _BENCH_PLANNED or key in _BENCH_NO_EFFECT:
            continue
        flag = "--" + key.replace("_", "-")
        (send_times if key in _BENCH_SEND_TIMES else ignored).append(flag)
    return ignored, send_times


def vllm_random_plan(
    workload: sb.Workload, n: int, seed: int, tok: TokenizerInfo
) -> list[Planned]:
    """The requests ``vllm bench serve --dataset-name random`` sends for ``workload`` (module
    docstring: the same draws as vLLM's, in the same order)."""
    o = bench_options(workload)
    ratio = o["random_range_ratio"]
    prefix = int(o["random_prefix_len"])
    real_input = max(0, int(o["random_input_len"]) - tok.num_special)
    in_lo, in_hi = math.floor(real_input * (1 - ratio)), math.ceil(real_input * (1 + ratio))
    out_len = int(o["random_output_len"])
    out_lo = max(1, math.floor(out_len * (1 - ratio)))
    out_hi = max(1, math.ceil(out_len * (1 + ratio)))
    rng = np.random.default_rng(seed)
    inputs = rng.integers(in_lo, in_hi + 1, size=n)
    outputs = rng.integers(out_lo, out_hi + 1, size=n)
    arrivals = bench_arrivals(o, n, seed)
    shared = tok.num_special + prefix if prefix > 0 else 0
    return [
        Planned(
            index=i,
            arrival_s=arrivals[i],
            prompt_tokens=tok.num_special + prefix + int(inputs[i]),
            output_tokens=int(outputs[i]),
            shared_prefix_tokens=shared,
            system_prompt=0 if shared else None,
        )
        for i in range(n)
    ]


def bench_arrivals(
    o: Mapping[str, float], n: int, seed: int, legacy: np.random.RandomState | None = None
) -> list[float]:
    """The send times of ``vllm bench serve`` (module docstring), drawn from ``legacy``: numpy's
    global generator as ``get_request`` finds it (default: just seeded, as the random dataset
    leaves it: serve.main_async calls ``np.random.seed(args.seed)``)."""
    rate, burst = o["request_rate"], o["burstiness"]
    if math.isinf(rate):
        return [0.0] * n
    if legacy is None:
        legacy = np.random.RandomState(seed)
    gaps = (
        [1.0 / rate] * n
        if math.isinf(burst)
        else [float(legacy.gamma(shape=burst, scale=1.0 / (rate * burst))) for _ in range(n)]
    )
    arrivals = [float(a) for a in np.cumsum(gaps)]
    if arrivals[-1] > 0:
        scale = (n / rate) / arrivals[-1]
        arrivals = [a * scale for a in arrivals]
    return arrivals


def vllm_prefix_repetition_plan(
    workload: sb.Workload, n: int, seed: int, tok: TokenizerInfo
) -> list[Planned]:
    """The requests of vLLM's ``prefix_repetition`` dataset (``PrefixRepetitionRandomDataset.
    sample``): ``num_prefixes`` prefixes, ``n // num_prefixes`` prompts each of exactly
    prefix + suffix tokens (plus the BOS the server adds), built prefix by prefix and then
    shuffled by Python's ``random`` seeded with ``seed``; every output is ``output_len``. The
    dataset draws its tokens from numpy's global generator, which the arrivals then continue:
    those draws are replayed, but not the few more it makes where a prompt does not decode and
    re-encode to its length (the translation check shows the send times that differ then)."""
    import random

    o = bench_options(workload)
    num_prefixes = int(o["prefix_repetition_num_prefixes"])
    per_prefix = n // num_prefixes
    if per_prefix == 0:
        raise ValueError(f"{n} requests for {num_prefixes} prefixes")
    prefix_len = int(o["prefix_repetition_prefix_len"])
    suffix_len = int(o["prefix_repetition_suffix_len"])
    order = [k for k in range(num_prefixes) for _ in range(per_prefix)]
    random.Random(seed).shuffle(order)
    legacy = np.random.RandomState(seed)
    for _ in range(num_prefixes):
        legacy.randint(0, tok.vocab_size, size=prefix_len)
        for _ in range(per_prefix):
            legacy.randint(0, tok.vocab_size, size=suffix_len)
    arrivals = bench_arrivals(o, len(order), seed, legacy)
    return [
        Planned(
            index=i,
            arrival_s=arrivals[i],
            prompt_tokens=tok.num_special + prefix_len + suffix_len,
            output_tokens=int(o["prefix_repetition_output_len"]),
            shared_prefix_tokens=tok.num_special + prefix_len,
            system_prompt=k,
        )
        for i, k in enumerate(order)
    ]


def own_client_plan(workload: sb.Workload, n: int, seed: int, tok: TokenizerInfo) -> list[Planned]:
    """serve_bench's workloads sent by its own client (``serve_bench.OWN_CLIENT_PLANS``, by
    its kind, with its arguments): token-id prompts (no BOS added), the clients that leave after
    k tokens (abandon), the batch backlog's class (mixed)."""
    plan = sb.OWN_CLIENT_PLANS[workload.kind](
        n, seed, "sim-", tok.vocab_size, tok.special_ids, workload.bench_args
    )
    return [
        Planned(
            index=i, arrival_s=at, prompt_tokens=rec.prompt_len, output_tokens=rec.output_len,
            leave_after=rec.leave_after, service_class=rec.service_class,
        )
        for i, (at, rec, _payload) in enumerate(plan)
    ]


#: the temperature vLLM's server samples at when a request names none (no generation config
#: in the tiny model: ``SamplingParams``' own default)
_SERVER_DEFAULT_TEMPERATURE = 1.0


def request_profiles(workload: sb.Workload) -> tuple[str, str]:
    """The sampling and stop profiles the adapter reads off ``workload``'s requests
    (:func:`kvbudget.vllm.sampling_profile`, :func:`~kvbudget.vllm.stop_profile`): what vLLM's
    client sends (its ``--temperature``, serve_bench's ``--ignore-eos``), or serve_bench's own
    client's request body."""
    if workload.kind in sb.OWN_CLIENT_PLANS:
        body = sb._stream_payload([0], 1)
        params = SimpleNamespace(
            temperature=body.get("temperature", _SERVER_DEFAULT_TEMPERATURE),
            ignore_eos=body.get("ignore_eos", False),
        )
    else:
        value = sb.bench_flags(workload.bench_args).get("temperature")
        temperature = float(value) if value is not None else _SERVER_DEFAULT_TEMPERATURE
        params = SimpleNamespace(temperature=temperature, ignore_eos=True)
    return sampling_profile(params), stop_profile(params)


def plan_workload(
    name: str, seed: int, tok: TokenizerInfo, scale: float = 1.0,
    bench_args: Sequence[str] = (),
) -> list[Planned]:
    """The requests of serve_bench's workload ``name`` (its request count times ``scale``, as
    ``--num-prompts-scale``; ``bench_args`` as serve_bench's ``--bench-arg``), each with the
    calibration key's sampling and stop parts its sampling params give it."""
    workload = sb.WORKLOADS[name].with_args(bench_args)
    sampling, stops = request_profiles(workload)
    return [
        replace(p, sampling=sampling, stops=stops)
        for p in _plan_requests(workload, seed, tok, scale)
    ]


def _plan_requests(
    workload: sb.Workload, seed: int, tok: TokenizerInfo, scale: float
) -> list[Planned]:
    n = sb.num_prompts(workload, scale)
    if workload.kind in sb.OWN_CLIENT_PLANS:
        return own_client_plan(workload, n, seed, tok)
    # (serve_bench passes the dataset and seed before the workload's own arguments)
    flags = sb.bench_flags(workload.bench_args)
    dataset = flags.get("dataset_name") or workload.dataset
    if flags.get("seed") is not None:
        seed = int(flags["seed"] or 0)
    if dataset == "prefix_repetition":
        return vllm_prefix_repetition_plan(workload, n, seed, tok)
    if dataset == "random":
        return vllm_random_plan(workload, n, seed, tok)
    raise ValueError(
        f"{workload.name}: --dataset-name {dataset} is not planned: the simulator draws vLLM's "
        f"{' and '.join(_PLANNED_DATASETS)} datasets as its client does"
    )


def unmodelled_notes(
    workloads: Sequence[str], bench_args: Sequence[str], send_times: str
) -> list[str]:
    """What the simulated requests leave out of ``bench_args`` (:func:`unmodelled_bench_args`),
    one line per kind: options the plan does not read, and options that shape the send times
    where the planned ones stand in for the client's (``send_times`` "planned")."""
    ignored: dict[str, None] = {}
    timing: dict[str, None] = {}
    for name in workloads:
        i, t = unmodelled_bench_args(sb.WORKLOADS[name].with_args(bench_args))
        ignored.update(dict.fromkeys(i))
        timing.update(dict.fromkeys(t))
    notes = []
    if ignored:
        notes.append(f"not modelled: {', '.join(ignored)} (the simulated requests are drawn "
                     "without them)")
    if timing and send_times == "planned":
        notes.append(f"{', '.join(timing)}: when the client sends depends on it, and the "
                     "planned send times leave it out: replay a run that kept its records "
                     "(--real DIR)")
    return notes


def scenario_for() -> Scenario:
    """The overlay: every request interactive (the example's default class, no headers sent;
    the mixed workload's backlog is batch, as its header asks: :func:`sim_requests`),
    one tenant, the engine's context, the SLO of serve_bench and no overlay abandonment."""
    return Scenario(
        interactive_share=1.0,
        tenants=(("default", 1.0),),
        sampling_profiles=(("default", 1.0),),
        stop_profiles=(("default", 1.0),),
        model_max_len=sb.MAX_MODEL_LEN,
        interactive_max_tokens=sb.MAX_MODEL_LEN,
        model=sb.SERVED_MODEL,
        ttft_slo_s=sb.SLO_TTFT_S,
        itl_floor_s=0.2,  # kvbudget.INTERACTIVE.latency_floor_s, the example's class
        batch_deadline_s=sb.BATCH_DEADLINE_S,  # kvbudget.BATCH.default_deadline_s (mixed)
        abandon_share=0.0,
        durable_share=0.0,
    )


def sim_requests(plan: Sequence[Planned]) -> tuple[Scenario, tuple[SimRequest, ...]]:
    """The simulator's requests for ``plan``: each asks for exactly its output length; a shared
    prefix is the first ``shared_prefix_tokens`` of the prompt, one system prompt for all of
    them (vLLM's random dataset draws one prefix per run), whose full blocks the simulated
    engine's prefix cache holds once."""
    scenario = scenario_for()
    workload = Workload(
        "serve_bench", [TraceRequest(p.arrival_s, p.prompt_tokens, p.output_tokens) for p in plan]
    )
    out = []
    for p, r in zip(plan, apply_scenario(workload, scenario), strict=True):
        spec = attrs.evolve(
            r.spec, max_tokens=p.output_tokens, service_class=p.service_class,
            sampling=p.sampling, stops=p.stops,
        )
        shared = p.shared_prefix_tokens
        out.append(
            attrs.evolve(
                r, spec=spec, request_id=f"r{p.index}", abandon_after_tokens=p.leave_after,
                system_prompt=p.system_prompt, system_prompt_tokens=shared,
            )
        )
    return scenario, tuple(out)


@dataclass(frozen=True)
class ContextLimits:
    """What the model's context (serve_bench's ``MAX_MODEL_LEN``) does to a plan, on both
    servers alike: a prompt of that many tokens or more is refused with HTTP 400 before the
    engine sees it (``refused``: how many); a request whose prompt and output do not fit gets
    fewer tokens than it asked for, and serve_bench fails it (``cut``: its simulated request
    id -> the tokens asked for; the simulator runs it to the hard maximum that does fit)."""

    refused: int = 0
    cut: Mapping[str, int] = field(default_factory=dict)


def context_limits(plan: Sequence[Planned]) -> tuple[list[Planned], ContextLimits]:
    """``plan`` without the requests the servers refuse, and :class:`ContextLimits` of it."""
    kept = [p for p in plan if p.prompt_tokens < sb.MAX_MODEL_LEN]
    cut = {
        f"r{p.index}": p.output_tokens
        for p in kept if p.prompt_tokens + p.output_tokens > sb.MAX_MODEL_LEN
    }
    return kept, ContextLimits(refused=len(plan) - len(kept), cut=cut)


# -- classifying simulated requests --------------------------------------------------------------


class ClientView:
    """How a client that was itself stalled at times reads a stream: a token that came while
    its loop did not run is read when the stall ends (``stalls``: ``(begin, seconds)`` on the
    simulation's clock, serve_bench's ``client_stalls`` of the run replayed)."""

    def __init__(self, stalls: Sequence[tuple[float, float]] = ()) -> None:
        self.stalls = sorted((a, a + d) for a, d in stalls)

    def read_at(self, t: float) -> float:
        for begin, end in self.stalls:
            if begin > t:
                break
            if t < end:
                return end
        return t

    def timing(self, rec: RequestRecord) -> tuple[float | None, float | None]:
        """``rec``'s TTFT and mean TPOT as this client measures them."""
        if not self.stalls or rec.first_token_s is None or rec.last_token_s is None:
            return rec.ttft_s, rec.tpot_s
        first, last = self.read_at(rec.first_token_s), self.read_at(rec.last_token_s)
        tpot = 0.0 if rec.output_tokens < 2 else (last - first) / (rec.output_tokens - 1)
        return first - rec.arrival_s, tpot


_NO_STALLS = ClientView()


def classify_sim(
    rec: RequestRecord, client: ClientView = _NO_STALLS, asked: int | None = None
) -> str:
    """serve_bench's outcome of one simulated request (module docstring), as ``client``
    times it (``asked``: the tokens its client asked for, where the model's context cut the
    request's hard maximum below them; else what it was expected to generate)."""
    if rec.end == "rejected":
        return "rejected"
    if rec.end == "abandoned":
        return "abandoned"
    wanted = rec.expected_tokens if asked is None else asked
    if rec.end != "completed" or rec.output_tokens != wanted:
        return "failed"
    ttft, tpot = client.timing(rec)
    if ttft is None or tpot is None:
        return "failed"
    if rec.service_class == "batch":
        done = rec.finished_s if rec.finished_s is not None else rec.last_token_s
        if done is None:
            return "failed"
        return "good" if done - rec.arrival_s <= sb.BATCH_DEADLINE_S else "late"
    if not sb.in_time(ttft, tpot):
        return "late"
    return "good"


def summarize_sim(
    records: Sequence[RequestRecord], client: ClientView = _NO_STALLS,
    limits: ContextLimits | None = None,
) -> dict[str, Any]:
    """Counts and figures of one simulated run, in serve_bench's terms (``client``: how the
    client reads the streams; ``limits``: the requests of the plan the model's context
    refused or cut, :func:`context_limits`)."""
    limits = limits or ContextLimits()
    classified = [(r, classify_sim(r, client, limits.cut.get(r.request_id))) for r in records]
    outcomes = collections.Counter(outcome for _, outcome in classified)
    outcomes["failed"] += limits.refused
    out: dict[str, Any] = {"sent": len(records) + limits.refused}
    for name in COUNTS:
        out[name] = outcomes.get(name, 0)
    starts = [r.arrival_s for r in records]
    ends = [r.finished_s for r in records if r.finished_s is not None]
    duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out["duration_s"] = round(duration, 2)
    out["goodput"] = round(out["good"] / duration, 3) if duration > 0 else None
    complete = [r for r, outcome in classified if outcome in ("good", "late")]
    done = [client.timing(r) for r in complete]
    ttfts = sorted(t for t, _ in done if t is not None)
    tpots = sorted(t for _, t in done if t is not None)
    out["ttft_p50_s"] = sb._pct(ttfts, 50)
    out["ttft_p99_s"] = sb._pct(ttfts, 99)
    out["tpot_p50_ms"] = None if not tpots else round(1000 * (sb._pct(tpots, 50) or 0.0), 1)
    out["tpot_p99_ms"] = None if not tpots else round(1000 * (sb._pct(tpots, 99) or 0.0), 1)
    # (as the engine made the tokens: the client's own stalls are not in these gaps)
    out.update(sb.freeze_figures(
        [r.longest_gap_s for r in complete if r.longest_gap_s is not None]
    ))
    # (serve_bench's good_unfrozen: good, and an interactive stream that never froze)
    out["good_unfrozen"] = sum(
        1 for r, outcome in classified
        if outcome == "good"
        and (r.service_class == "batch" or (r.longest_gap_s or 0.0) <= sb.FREEZE_GAP_S)
    )
    return out


#: the kvbudget example's policy in the simulator: a shipped name, or a factory of a fresh
#: policy for each simulated run (:func:`example_policy`)
ExamplePolicy = str | Callable[[], "Policy | str"]


def example_policy(
    name: str, example_args: Sequence[str], flag: str = "--first-token-pause-share"
) -> ExamplePolicy:
    """The policy the kvbudget example ran with ``--policy name`` and serve_bench's
    ``--example-arg``s: the name, with the policy settings among those arguments
    (``--first-token-pause-share``) applied as the example applies them. The example's other
    arguments (its queue bound, tenants, limits) are not its policy and are not simulated.
    ``kvbudget serve``'s with its ``--serve-arg``s: ``flag`` :data:`SERVE_PAUSE_FLAG`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_first_token_pause_option(parser, flag)
    known, _ = parser.parse_known_args(list(example_args))
    (share,) = vars(known).values()  # (the parser's one option, whatever its flag)
    if share == POLICY_DEFAULT:
        return name
    return lambda: server_policy(name, share)


def is_simulated(server: str) -> bool:
    """Is ``server`` (a serve_bench server name) one this script simulates?"""
    return server in SERVERS or server == SERVE or sb.queue_cap(server) is not None


def servers_in_order(names: Collection[str]) -> tuple[str, ...]:
    """:data:`SERVERS` and the capped vLLM servers and ``kvbudget serve`` among ``names``, in
    serve_bench's order (vLLM's server, the capped ones by cap, the example, ``kvbudget
    serve``)."""
    caps = {n: cap for n in names if (cap := sb.queue_cap(n)) is not None}
    capped = sorted(caps, key=caps.__getitem__)
    return (SERVERS[0], *capped, *SERVERS[1:], *((SERVE,) if SERVE in names else ()))


def simulated_policy(
    server: str, example: ExamplePolicy, serve: ExamplePolicy | None = None
) -> ExamplePolicy:
    """The simulated policy of ``server``: the example's, ``kvbudget serve``'s (``serve``;
    None: the example's), or vLLM's baseline (with the cap of a ``vllm-cap<N>``:
    ``max_num_queued_reqs`` N, refused callers answered 503 as vLLM does)."""
    if server == "kvbudget":
        return example
    if server == SERVE:
        return example if serve is None else serve
    cap = sb.queue_cap(server)
    if cap is None:
        return VLLM_POLICY
    return functools.partial(make_policy, VLLM_POLICY, max_num_queued_reqs=cap)


def simulated_config(server: str) -> SchedulerConfig | None:
    """The scheduler's knobs of ``server`` in the simulator: the budgeted servers' are those
    the vLLM adapter sets (``BudgetedEngine``, under the example and ``kvbudget serve`` alike:
    every grant charged :data:`DEFAULT_SLACK_TOKENS` past its boundary, which takes one more
    block where a boundary falls that near a block's end); vLLM's baseline charges nothing past
    what it holds (None: the default)."""
    return (
        SchedulerConfig(slack_tokens=DEFAULT_SLACK_TOKENS) if server in BUDGETED_SERVERS
        else None
    )


def policy_name(server: str, example: str) -> str:
    """How :func:`simulated_policy` of ``server`` is named in the output's meta."""
    if server in BUDGETED_SERVERS:
        return example
    cap = sb.queue_cap(server)
    return VLLM_POLICY if cap is None else f"{VLLM_POLICY} (max_num_queued_reqs {cap})"


def simulate_workloads(
    names: Sequence[str],
    *,
    profile: EngineProfile,
    policy: ExamplePolicy = "calibrated",
    seed: int = 0,
    scale: float = 1.0,
    tok: TokenizerInfo = TINY_TOKENIZER,
    bench_args: Sequence[str] = (),
    replay: Replay | None = None,
    stall_speed: float = STALL_SPEED,
    front_ends: Mapping[str, FrontEndModel] | None = None,
    paced: Collection[str] = (),
    pace: str = "phases",
    servers: Sequence[str] = SERVERS,
    wait_outcomes: str = "sim",
    serve_policy: ExamplePolicy | None = None,
    pace_of: str | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{workload: {server: summary}}`` of the simulated runs, workloads in serve_bench's order,
    each server's budget models carried from one workload to the next (module docstring).

    ``replay`` (one real run's client, :func:`load_replays`): each server's requests arrive
    when the real client sent them to that server, not on the planned schedule (a client
    stalled sends late and in bursts), and are read as that client read them (a token that
    came while it was stalled is read when the stall ends); in the client's stalls the engine
    runs at ``stall_speed`` of its speed (a fitted figure, module docstring). ``front_ends``:
    each server's front-end process (:func:`front_ends_of`); a server without one gets its
    tokens as the engine makes them. ``paced``: servers whose engine runs at the pace the
    replayed run's own streams show, not the profile's: per window (``pace`` "phases",
    :func:`phased_simulation`; its summary also says ``window_step_scales``) or one for the run
    (:func:`paced_simulation`; "run"); each such summary says its ``step_scale``. ``servers``:
    the servers simulated (:func:`servers_in_order`; each with :func:`simulated_policy`;
    ``serve_policy``: ``kvbudget serve``'s, where it differs from the example's ``policy``).
    ``wait_outcomes``: what a budgeted server's turn-away at arrival knows at each workload's
    start: what its simulated runs of the workloads before taught it ("sim") or, with "real"
    where the replayed run recorded it, what the real server had learned then
    (:func:`with_wait_outcomes`); its summary says both and which was used
    (``wait_outcomes_at_start``). ``pace_of`` (a what-if, ``--pace-of``): every other server
    on that server's engine as it was paced in the replay (its profile, its step-time scale or
    window scales), each still sent and read by its own client: the servers' decisions
    compared on one engine, without what their front ends and the machine's drift between
    their turns did to it (the summaries say ``paced_as``)."""
    send_times = replay.send_times if replay is not None else {}
    # (at the simulator's default tick, the real shells' interval: a queued caller past its
    # bound is turned away at most that late, and may be admitted in between)
    engine = profile.engine_model()
    engines = {
        s: attrs.evolve(engine, front_end=(front_ends or {}).get(s, engine.front_end))
        for s in servers
    }
    policies = {s: simulated_policy(s, policy, serve_policy) for s in servers}
    carried = {
        s: (LengthModel(), probed_cost(engine) if s in PROBING_SERVERS else CostModel())
        for s in servers
    }
    # what each server's forecast learned by the end of its last workload (its release rate,
    # the calibration of its wait forecasts): the real server keeps its scheduler from one
    # workload to the next
    memories: dict[str, ForecastMemory | None] = {s: None for s in servers}
    if pace_of is not None and pace_of not in servers:
        raise ValueError(f"--pace-of {pace_of}: not among the servers {', '.join(servers)}")
    # the server whose engine the others run on (pace_of) goes first
    order = servers if pace_of is None else (pace_of, *(s for s in servers if s != pace_of))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in [w for w in sb.WORKLOADS if w in names]:
        plan, limits = context_limits(plan_workload(name, seed, tok, scale, bench_args))
        planned = sim_requests(plan)
        per: dict[str, dict[str, Any]] = {}
        own = replay.profiles.get(name, {}) if replay is not None else {}
        # pace_of's engine as this workload ran on it: (engine, scale, slower windows)
        lead: tuple[EngineModel, float, list[tuple[float, float, float]] | None] | None = None
        for server in order:
            engine_of = engines[server]
            if lead is not None:
                engine_of = attrs.evolve(lead[0], front_end=engines[server].front_end)
            elif server in own:  # this run's own engine pace, from its own steps
                engine_of = attrs.evolve(
                    own[server].engine_model(),
                    front_end=engines[server].front_end,
                    intake_s=engines[server].intake_s,
                )
            sent = send_times.get(name, {}).get(server)
            scenario, reqs = (
                planned if not sent else sim_requests(with_send_times(plan, sent))
            )
            stalls = replay.stalls.get(name, {}).get(server, ()) if replay is not None else ()
            client = ClientView(stalls)
            real_bands = (
                replay.wait_outcomes.get(name, {}).get(server) if replay is not None else None
            )
            sim_bands = memory_bands(memories[server])
            start_memory = memories[server]
            # (a fresh real server, before its first workload, is a fresh simulated one)
            seeded = wait_outcomes == "real" and real_bands is not None and (
                memories[server] is not None or any(seen for seen, _ in real_bands)
            )
            if seeded:
                assert real_bands is not None
                memories[server] = with_wait_outcomes(memories[server], real_bands)

            # (what every trial, and the pace band's runs after the one kept, start from)
            start_models, run_memory = carried[server], memories[server]

            def run_at(
                step_scale: float, slow: Sequence[tuple[float, float, float]] | None = None,
                server: str = server, scenario: Scenario = scenario,
                reqs: Sequence[SimRequest] = reqs, stalls: Any = stalls,
                engine_of: EngineModel = engine_of,
                start: tuple[LengthModel, CostModel] = start_models,
                memory: ForecastMemory | None = run_memory,
            ) -> tuple[Any, tuple[LengthModel, CostModel]]:
                # every trial starts from the models carried so far, and only the run kept
                # carries its own on to the next workload
                lengths, cost = copy.deepcopy(start)
                engine = engine_of if step_scale == 1.0 else scaled_engine(
                    engine_of, step_scale
                )
                # the slower windows of the run (--pace phases), and in the client's stalls
                # the engine at stall_speed of the window's speed
                spans = stalls if slow is None else merged_spans(slow, stalls, stall_speed)
                chosen = policies[server]
                result = simulate(
                    reqs, scenario, engine, chosen if isinstance(chosen, str) else chosen(),
                    seed=seed, config=simulated_config(server),
                    keep_requests=True, lengths=lengths, cost=cost, stalls=spans,
                    stall_speed=stall_speed, forecast=memory,
                )
                return result, (lengths, cost)

            target = replay.gaps.get(name, {}).get(server) if replay is not None else None
            phases = (
                replay.phase_gaps.get(name, {}).get(server) if replay is not None else None
            )
            window_scales: list[float] | None = None
            phased = (
                phased_simulation(run_at, phases, client, server in PAUSING_SERVERS)
                if lead is None and server in paced and pace == "phases" and phases is not None
                else None
            )
            # (the engine as run_at ran it: the base scale and the slower windows)
            base: float | None = None
            windows: list[tuple[float, float, float]] | None = None
            if lead is not None:
                _engine, base, windows = lead
                result, carried[server] = run_at(base, windows)
                step_scale = base
            elif phased is not None:
                (result, carried[server]), window_scales = phased
                step_scale = window_scales[-1]
                assert phases is not None
                base, windows = phase_spans(window_scales, phases.edges)
            elif server in paced and target is not None:
                (result, carried[server]), step_scale = paced_simulation(
                    run_at, target, client, server in PAUSING_SERVERS
                )
            else:
                (result, carried[server]), step_scale = run_at(1.0), 1.0
            ran_at = step_scale if base is None else base  # (run_at's scale for this run)
            if server == pace_of:
                lead = (engine_of, ran_at, windows)
            memories[server] = result.forecast_memory
            summary = summarize_sim(result.request_records, client, limits)
            summary["good_at_pace_band"] = pace_band(
                run_at, ran_at, windows, client, limits, summary["good"]
            )
            summary["step_scale"] = round(step_scale, 3)
            if window_scales is not None:
                summary["window_step_scales"] = [round(x, 3) for x in window_scales]
            if pace_of is not None and server != pace_of:
                summary["engine_profile"] = f"{pace_of}'s"
                summary["paced_as"] = pace_of
            else:
                summary["engine_profile"] = "this run's" if server in own else "the run's"
            summary["policy"] = result.policy
            if server in PAUSING_SERVERS:
                # (the ledger grants every block before the engine takes it: a simulated
                # budgeted engine never preempts on its own; the preemptions are the budget's,
                # as serve_bench reports a real one's apart from its engine's)
                summary["engine_preemptions"] = 0
                summary["budget_preemptions"] = result.preemptions
                summary["wait_outcomes_at_start"] = {
                    "sim": sim_bands, "real": real_bands, "used": "real" if seeded else "sim",
                }
                # (the gate of a fresh caller at a wave's start reads it:
                # docs/benchmarks-history.md)
                summary["release_rate_at_start"] = {
                    "sim": round(release_rate_of(start_memory, server), 1),
                    "real": (
                        replay.release_rates.get(name, {}).get(server)
                        if replay is not None else None
                    ),
                }
            else:
                summary["engine_preemptions"] = result.preemptions
            summary["rejections_by_reason"] = dict(result.rejections_by_reason)
            summary["prefix_hit_rate"] = round(result.prefix_hit_rate, 3)
            per[server] = summary
        out[name] = {s: per[s] for s in servers}
    return out


def pace_band(
    run_at: Callable[..., tuple[Any, Any]],
    scale: float,
    windows: Sequence[tuple[float, float, float]] | None,
    client: ClientView,
    limits: ContextLimits,
    good: float,
) -> list[float]:
    """``[fewest, most]`` good of one cell simulated at its pace (``good``) and with every step
    time :data:`PACE_BAND` faster and slower (``run_at(scale, windows)`` as the cell was run,
    from the same start): how far the prediction moves within what the pace is known to."""
    goods = [good]
    for factor in (1.0 - PACE_BAND, 1.0 + PACE_BAND):
        result, _models = run_at(scale * factor, windows)
        goods.append(summarize_sim(result.request_records, client, limits)["good"])
    return [min(goods), max(goods)]


#: servers whose budget measures the engine's prefill before its first caller (the
#: BudgetedEngine of the example and of ``kvbudget serve``, :func:`probed_cost`)
PROBING_SERVERS = BUDGETED_SERVERS


def probed_cost(engine: EngineModel) -> CostModel:
    """A fresh cost model that has seen what the example's :class:`BudgetedEngine` feeds its
    own before the first caller: one prefill of each of its probes (``PREFILL_PROBES`` prompts
    of :func:`prefill_probe_lengths`, serve_bench's context and ``engine``'s cache), each
    observed as the simulated engine reports a prefill (its per-token cost). Without them the
    simulated example could not pause a stream until its callers' own prefills had been seen
    that often: a burst of prompts whose prefix is cached fills the cache in two or three
    prefill steps, and its callers were turned away where the real example paused streams."""
    cost = CostModel()
    per_token = engine.step.prefill_per_token_s
    for n in prefill_probe_lengths(PREFILL_PROBES, sb.MAX_MODEL_LEN, engine.capacity.tokens):
        cost.observe_prefill(n, per_token * n)
    return cost


#: ``--pace``'s default, and the servers it paces: both. vLLM's own server, whose engine's
#: steps nothing in the run times; the example, whose profile is its own engine's steps timed
#: whole, but whose streams went 7-15 % slower than that profile in the runs of the eighteenth
#: session (the front end's share between them): its first-token pauses, which the scheduler
#: decides from that pace, then came out too few in the simulator
PACE_DEFAULT = "phases"
PACED_SERVERS = ("vllm", *BUDGETED_SERVERS)
#: servers whose streams' pace is read without each stream's longest gap where that is a
#: pause (over PAUSE_GAP_S: serve_bench's stall): the budgeted servers', whose pauses are their
#: policy's doing, and what is predicted, not the engine's pace (each stream pauses at most once)
PAUSING_SERVERS = BUDGETED_SERVERS
PAUSE_GAP_S = sb.STALL_GAP_S
#: ``--pace run``: the engine's step times are scaled until the simulated streams' mean gap
#: between tokens is within this share of the real run's, in at most PACE_TRIALS simulations,
#: the scale kept within PACE_BOUNDS (wide: the profile is fitted over the example's whole run,
#: and the machine's pace can change by 2x between two servers' turns; a held-out run had vLLM's
#: server at 0.38-0.5 of the step time the example's engine showed in a slow spell after it)
PACE_TOLERANCE = 0.02
PACE_TRIALS = 5
PACE_BOUNDS = (0.25, 4.0)
#: each cell is also simulated with every step time this share faster and slower than the pace
#: it was run at (``good_at_pace_band``): the pace is known only to PACE_TOLERANCE, and where
#: waves of streams cross an objective (TTFT <= 2 s) a pace that much off moves a whole wave
#: from good to late or back (held-out run sb42a's burst: vLLM's server's fifth wave of 5 came
#: at 1.97 s, the simulated one's 6 at 2.02 s, from wave periods 2.4 % apart)
PACE_BAND = PACE_TOLERANCE


def mean_gap(streams: Sequence[tuple[int, float]]) -> float | None:
    """The mean gap between consecutive tokens over ``streams`` (``(tokens, seconds from the
    first token to the last)`` each), every gap weighted alike: what vLLM's inter-token latency
    histogram would average. None without a stream of two tokens or more."""
    gaps = sum(n - 1 for n, _ in streams if n >= 2)
    if gaps <= 0:
        return None
    return sum(span for n, span in streams if n >= 2) / gaps


def real_streams(
    recs: Sequence[Mapping[str, Any]], without_pause: bool = False
) -> list[tuple[float, int, float]]:
    """One real run's completed streams (good or late) as the client timed them: ``(middle,
    tokens, seconds from the first token to the last)`` each, ``middle`` on a clock that
    starts at the run's first send (a record without its send time is taken as sent then:
    its span, which the mean gap reads, does not depend on it)."""
    if not recs:
        return []
    t0 = min(float(r.get("start", 0.0)) for r in recs)
    streams = []
    for r in recs:
        if (r.get("outcome") not in ("good", "late") or not r.get("output_tokens")
                or r.get("latency") is None or r.get("ttft") is None):
            continue
        sent = float(r.get("start", t0)) - t0
        first = sent + float(r["ttft"])
        last = sent + float(r["latency"])
        longest = max(r.get("itl") or (), default=None)
        tokens, span = _paced(int(r["output_tokens"]), last - first, longest, without_pause)
        streams.append(((first + last) / 2, tokens, span))
    return streams


def sim_streams(
    records: Sequence[RequestRecord], client: ClientView, without_pause: bool = False
) -> list[tuple[float, int, float]]:
    """A simulated run's completed streams (good or late) as ``client`` times them, as
    :func:`real_streams` gives a real run's (the simulation's clock starts at the first send,
    as the replayed run's)."""
    streams = []
    for rec in records:
        if classify_sim(rec, client) not in ("good", "late"):
            continue
        ttft, tpot = client.timing(rec)
        if ttft is None or tpot is None:
            continue
        span = tpot * max(rec.output_tokens - 1, 0)
        middle = rec.arrival_s + ttft + span / 2
        tokens, span = _paced(rec.output_tokens, span, rec.longest_gap_s, without_pause)
        streams.append((middle, tokens, span))
    return streams


def _paced(
    tokens: int, span: float, longest_gap: float | None, without_pause: bool
) -> tuple[int, float]:
    """A stream's ``(tokens, span)`` as its pace is read: ``without_pause``, less its longest
    gap where that is a pause (over :data:`PAUSE_GAP_S`; a stream gives way at most once)."""
    if without_pause and longest_gap is not None and longest_gap > PAUSE_GAP_S and tokens > 2:
        return tokens - 1, span - longest_gap
    return tokens, span


def real_stream_gap(
    recs: Sequence[Mapping[str, Any]], without_pause: bool = False
) -> float | None:
    """:func:`mean_gap` of one real run's completed streams (:func:`real_streams`)."""
    return mean_gap([(n, span) for _, n, span in real_streams(recs, without_pause)])


def sim_stream_gap(
    records: Sequence[RequestRecord], client: ClientView, without_pause: bool = False
) -> float | None:
    """:func:`mean_gap` of a simulated run's completed streams (:func:`sim_streams`)."""
    return mean_gap([(n, span) for _, n, span in sim_streams(records, client, without_pause)])


def scaled_engine(engine: EngineModel, factor: float) -> EngineModel:
    """``engine`` with every step-time figure (and the abort latency and the intake) times
    ``factor``."""
    return attrs.evolve(engine, **scaled_timing(engine, factor))


def paced_simulation(
    run_at: Callable[[float], tuple[Any, _T]], target_gap: float, client: ClientView,
    without_pause: bool = False,
) -> tuple[tuple[Any, _T], float]:
    """``run_at(scale)``'s result at the step-time scale whose simulated streams have the real
    run's mean gap between tokens (``target_gap``, :func:`real_stream_gap`), and that scale.

    The engine's pace in a server's own stretch of the run, read from its streams: on this
    machine the same server on the same workload ran 20-25 % slower in one repeat than in the
    next, which no profile fitted elsewhere predicts. The gap is an average over the whole run
    (decode steps, prefills mixed in, a preempted request's wait), so the scale is found by
    simulating (the gap grows about in proportion to the scale): ``scale *= real / simulated``
    until they agree within :data:`PACE_TOLERANCE`, at most :data:`PACE_TRIALS` runs, within
    :data:`PACE_BOUNDS`. What is predicted is still good / late / rejected: which requests wait
    and for how long, from the engine's pace."""
    scale = 1.0
    for trial in range(PACE_TRIALS):
        out = run_at(scale)
        gap = sim_stream_gap(out[0].request_records, client, without_pause)
        if gap is None or gap <= 0 or trial == PACE_TRIALS - 1:
            return out, scale
        ratio = target_gap / gap
        nxt = min(max(scale * ratio, PACE_BOUNDS[0]), PACE_BOUNDS[1])
        if abs(ratio - 1.0) <= PACE_TOLERANCE or nxt == scale:
            return out, scale
        scale = nxt
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class PhaseGaps:
    """A run's pace in windows of its time (``--pace phases``): ``gaps[i]`` is the mean gap
    between tokens (:func:`mean_gap`) of the completed streams whose middle came in window
    ``i``, the windows bounded by ``edges`` (seconds after the first send, ascending; the
    first window starts before the run, the last never ends). ``split_s``, when the last
    request was sent, is always one of the edges: the run while requests arrive and the run
    after are two phases, each cut into windows of about equal numbers of streams."""

    edges: tuple[float, ...]
    gaps: tuple[float, ...]
    split_s: float


#: ``--pace phases``: a phase is paced on its own only with at least this many streams in it,
#: and cut into windows of at least MIN_WINDOW_STREAMS streams each, at most
#: MAX_PHASE_WINDOWS of them
MIN_PHASE_STREAMS = 8
MIN_WINDOW_STREAMS = 12
MAX_PHASE_WINDOWS = 3


def _windows_of(streams: list[tuple[float, int, float]]) -> list[list[tuple[float, int, float]]]:
    """``streams`` (sorted by middle) cut into windows of about equal numbers of streams."""
    k = max(1, min(MAX_PHASE_WINDOWS, len(streams) // MIN_WINDOW_STREAMS))
    return [streams[i * len(streams) // k:(i + 1) * len(streams) // k] for i in range(k)]


def phase_gaps(streams: Sequence[tuple[float, int, float]], split_s: float) -> PhaseGaps | None:
    """:class:`PhaseGaps` of ``streams`` (``(middle, tokens, seconds from the first token to
    the last)`` each, ``middle`` on the run's clock); None where either phase has fewer than
    :data:`MIN_PHASE_STREAMS` streams of two tokens or more."""
    done = sorted(s for s in streams if s[1] >= 2)
    early = [s for s in done if s[0] < split_s]
    late = [s for s in done if s[0] >= split_s]
    if len(early) < MIN_PHASE_STREAMS or len(late) < MIN_PHASE_STREAMS:
        return None
    edges: list[float] = []
    for phase in (early, late):
        for before, after in itertools.pairwise(_windows_of(phase)):
            edges.append((before[-1][0] + after[0][0]) / 2)
        if phase is early:
            edges.append(split_s)
    # (read back by the edges, as a simulated run's streams are: ties fall alike)
    gaps = window_gaps(done, edges)
    if any(g is None or g <= 0 for g in gaps):
        return None
    return PhaseGaps(tuple(edges), tuple(g for g in gaps if g is not None), split_s)


def real_phase_gaps(
    recs: Sequence[Mapping[str, Any]], without_pause: bool = False
) -> PhaseGaps | None:
    """:func:`phase_gaps` of one real run's completed streams (:func:`real_streams`), split
    when its client sent its last request."""
    if not recs:
        return None
    split = max(float(r["start"]) for r in recs) - min(float(r["start"]) for r in recs)
    return phase_gaps(real_streams(recs, without_pause), split)


def window_gaps(
    streams: Sequence[tuple[float, int, float]], edges: Sequence[float]
) -> list[float | None]:
    """The mean gap between tokens of ``streams`` in each window that ``edges`` bound (None:
    no stream of two tokens or more in it)."""
    bounds = [-math.inf, *edges, math.inf]
    out: list[float | None] = []
    for lo, hi in itertools.pairwise(bounds):
        out.append(mean_gap([(n, span) for mid, n, span in streams if lo <= mid < hi]))
    return out


def sim_phase_gaps(
    records: Sequence[RequestRecord], client: ClientView, edges: Sequence[float],
    without_pause: bool = False,
) -> list[float | None]:
    """:func:`window_gaps` of a simulated run's completed streams (:func:`sim_streams`)."""
    return window_gaps(sim_streams(records, client, without_pause), edges)


#: ``--pace phases``: at most this many simulations to find the windows' scales (the one
#: whose windows came closest is kept), each step taking this power of the ratio: a window's
#: pace moves its neighbours' streams too, and whole steps oscillate
PHASE_TRIALS = 8
PHASE_DAMPING = 0.6
#: the driver's timeline: a span that starts before the run, one that never ends
_BEFORE, _NEVER = -1.0, 1e9


def phase_spans(
    scales: Sequence[float], edges: Sequence[float]
) -> tuple[float, list[tuple[float, float, float]]]:
    """How the driver runs an engine whose step times are ``scales[i]`` times the profile's
    in the window ``i`` that ``edges`` bound: ``(the scale of the fastest window, the slower
    windows as (begin, seconds, speed in it) spans)``."""
    base = min(scales)
    bounds = [_BEFORE, *edges, _NEVER]
    spans = [
        (lo, hi - lo, base / scale)
        for (lo, hi), scale in zip(itertools.pairwise(bounds), scales, strict=True)
        if scale > base
    ]
    return base, spans


def merged_spans(
    windows: Sequence[tuple[float, float, float]],
    stalls: Sequence[tuple[float, float]],
    stall_speed: float,
) -> list[tuple[float, float, float]]:
    """The driver's speed spans of a run paced by windows (``(begin, seconds, speed)``, not
    overlapping: :func:`phase_spans`) whose client also stalled (``(begin, seconds)``): in a
    stall the engine runs at ``stall_speed`` of the speed of the window it falls in. Not
    overlapping, sorted, as the driver takes them."""
    cuts = sorted({
        t for b, d, *_ in (*windows, *stalls) for t in (b, b + d)
    })
    out: list[tuple[float, float, float]] = []
    for lo, hi in itertools.pairwise(cuts):
        speed = 1.0
        for b, d, sp in windows:
            if b <= lo and hi <= b + d:
                speed *= sp
        for b, d in stalls:
            if b <= lo and hi <= b + d:
                speed *= stall_speed
        if speed < 1.0:
            out.append((lo, hi - lo, speed))
    return out


def phased_simulation(
    run_at: Callable[[float, Sequence[tuple[float, float, float]] | None], tuple[Any, _T]],
    target: PhaseGaps,
    client: ClientView,
    without_pause: bool = False,
) -> tuple[tuple[Any, _T], list[float]] | None:
    """``run_at(scale, spans)``'s result at the step-time scales (one per window of the run)
    whose simulated streams have the real run's mean gaps in each window (``target``,
    :func:`real_phase_gaps`), and those scales.

    :func:`paced_simulation` finds one scale for a whole run; on this machine a run at times
    went 1.5x slower while its 160 requests were sent than after (vLLM's server, overload: its
    first streams 11.6 ms between tokens, those after 6-7 ms), or twice as slow in its first
    6 seconds only (vLLM's moderate: 12 ms, then 6 ms from the seventh second, while requests
    were sent for 14 s), and one scale then has the first streams too fast and the next ones
    admitted too early. The same rule per window, damped (:data:`PHASE_DAMPING`): ``scale *=
    (real / simulated) ** 0.6`` until every window agrees within :data:`PACE_TOLERANCE`, at most
    :data:`PHASE_TRIALS` runs (the closest kept), within :data:`PACE_BOUNDS` (a window without
    a simulated stream keeps its scale). Which requests
    wait, and how long, is still predicted. None where no simulated window has a stream to
    measure (the caller paces the run as one)."""
    scales = [1.0] * len(target.gaps)
    best: tuple[float, tuple[Any, _T], list[float]] | None = None
    for _ in range(PHASE_TRIALS):
        base, spans = phase_spans(scales, target.edges)
        out = run_at(base, spans)
        got = sim_phase_gaps(out[0].request_records, client, target.edges, without_pause)
        if all(g is None for g in got):
            return None
        ratios = [1.0 if g is None or g <= 0 else t / g for t, g in zip(target.gaps, got,
                                                                         strict=True)]
        off = max(abs(r - 1.0) for r in ratios)
        if best is None or off < best[0]:
            best = (off, out, scales)
        if off <= PACE_TOLERANCE:
            break
        scales = [min(max(sc * r**PHASE_DAMPING, PACE_BOUNDS[0]), PACE_BOUNDS[1])
                  for sc, r in zip(scales, ratios, strict=True)]
    assert best is not None
    return best[1], best[2]


def with_send_times(plan: Sequence[Planned], sent: Mapping[int, float]) -> list[Planned]:
    """``plan`` with each request sent at ``sent[index]`` where the real client's time is known
    (kept in arrival order, as the simulator expects)."""
    moved = [replace(p, arrival_s=sent.get(p.index, p.arrival_s)) for p in plan]
    return sorted(moved, key=lambda p: p.arrival_s)


# -- the real side -------------------------------------------------------------------------------


def _real_summary(s: Mapping[str, Any]) -> dict[str, Any]:
    """The figures compared, from one serve_bench summary (``rejected`` = 429 + 503)."""
    out = {
        "sent": s.get("sent"),
        "good": s.get("good", 0),
        "late": s.get("late", 0),
        "rejected": (s.get("rejected") or 0) + (s.get("rejected_503") or 0),
        "failed": s.get("failed", 0),
        "abandoned": s.get("left", 0),
    }
    for key in ("goodput", "duration_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms",
                "tpot_p99_ms", "engine_preemptions", "budget_preemptions", *FREEZE_KEYS):
        out[key] = s.get(key)
    return out


#: serve_bench's figures of the longest gap of each complete stream (:func:`sb.freeze_figures`)
FREEZE_KEYS = tuple(sb.freeze_figures([]))


def _freezes_of(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """serve_bench's freeze figures from one run's raw records (interactive streams only, as
    :func:`sb.summarize` counts them now, whenever the run was made)."""
    return sb.freeze_figures([
        max(r["itl"]) for r in records
        if r.get("outcome") in ("good", "late") and r.get("itl")
        and r.get("service_class") != "batch"
    ])


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _runs(path: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """A serve_bench ``--out`` directory's record files: ``{(workload, server): [run 0, run 1,
    ...]}``, each run's JSON as serve_bench wrote it (its ``summary`` and ``records``)."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for workload in sb.WORKLOADS:
        # (whole names: "kvbudget" must not pick up "kvbudget-serve"'s files)
        pattern = re.compile(rf"^records-{re.escape(workload)}-(.+)-r(\d+)\.json$")
        found = []
        for f in path.glob(f"records-{workload}-*-r*.json"):
            m = pattern.match(f.name)
            if m and is_simulated(m.group(1)):
                found.append((m.group(1), int(m.group(2)), f))
        rank = {n: i for i, n in enumerate(servers_in_order({n for n, _, _ in found}))}
        for server, _k, f in sorted(found, key=lambda x: (rank[x[0]], x[1])):
            grouped[(workload, server)].append(json.loads(f.read_text(encoding="utf-8")))
    return grouped


def machine_drifts(path: Path) -> list[str]:
    """The runs of a serve_bench ``--out`` directory made on a machine more than
    ``serve_bench.MACHINE_DRIFT`` times slower or faster than its vLLM reference run, as
    ``workload/server rK xR`` (serve_bench's ``machine_vs_reference``, from its machine probe;
    runs made before the probe have none): their real cells compare two machines."""
    out = []
    for (workload, server), runs in _runs(path).items():
        for k, run in enumerate(runs):
            ratio = run.get("summary", {}).get("machine_vs_reference")
            if sb.machine_drifted(ratio):
                out.append(f"{workload}/{server} r{k} x{ratio:g}")
    return out


def front_end_stretches(path: Path) -> dict[str, list[FrontEndRecord]]:
    """Per server, each workload run of a serve_bench ``--out`` directory as one stretch of its
    front end's work: (requests sent, outputs streamed = the chunks that carried tokens,
    seconds from the counters before the run to those after it, the front-end process's CPU
    seconds over them). Runs made before serve_bench counted CPU give none."""
    out: dict[str, list[FrontEndRecord]] = {}
    for (_workload, server), runs in _runs(path).items():
        for run in runs:
            cpu = (run.get("counters") or {}).get("frontend_cpu_s")
            recs = run.get("records") or []
            if cpu is None or not recs:
                continue
            summary = run.get("summary") or {}
            after = (summary.get("idle_wait") or {}).get("after_s") or 0.0
            outputs = sum(r.get("token_chunks") or 0 for r in recs)
            out.setdefault(server, []).append(
                (len(recs), outputs, float(summary.get("wall_s") or 0.0) + after, float(cpu))
            )
    return out


def front_ends_of(path: Path) -> dict[str, tuple[FrontEndModel, float]]:
    """Each server's front end fitted from the real run (``--front-end run``):
    :func:`kvbudget.sim.profile.fit_front_end` over its stretches (:func:`front_end_stretches`),
    with the idle CPU per second the fit set aside; servers with fewer than two stretches are
    left out."""
    fitted: dict[str, tuple[FrontEndModel, float]] = {}
    for server, stretches in front_end_stretches(path).items():
        if is_simulated(server) and len(stretches) >= 2:
            fitted[server] = fit_front_end(stretches)
    return fitted


@dataclass(frozen=True)
class Replay:
    """What one real run's client did, per workload and server, on a clock that starts at its
    first send: when it sent each request (``{request index: seconds}``) and when it was itself
    stalled (``[(begin, seconds)]``, serve_bench's ``client_stalls``)."""

    send_times: dict[str, dict[str, dict[int, float]]]
    stalls: dict[str, dict[str, list[tuple[float, float]]]]
    #: the mean gap between tokens of the run's completed streams (:func:`real_stream_gap`)
    gaps: dict[str, dict[str, float]] = field(default_factory=dict)
    #: a budgeted server's engine profile fitted from its steps in this run alone
    #: (:func:`stretch_profiles`; ``--pace run`` and ``phases``)
    profiles: dict[str, dict[str, EngineProfile]] = field(default_factory=dict)
    #: the mean gap between tokens of the streams whose middle came in each window of the
    #: run (the windows cut from the phases while requests were sent and after)
    #: (:func:`real_phase_gaps`; ``--pace phases``)
    phase_gaps: dict[str, dict[str, PhaseGaps]] = field(default_factory=dict)
    #: a budgeted server's wait outcomes by band of pressure just before each workload, as
    #: serve_bench recorded them (``(seen, in time)`` per band; :func:`real_wait_outcomes`)
    wait_outcomes: dict[str, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)
    #: a budgeted server's release rate (blocks per second) just before each workload, as
    #: serve_bench recorded it (:func:`real_release_rate`)
    release_rates: dict[str, dict[str, float]] = field(default_factory=dict)


def stretch_profiles(path: Path, workload: str, server: str) -> list[EngineProfile | None]:
    """The engine profiles serve_bench fetched after each run of ``workload`` on the budgeted
    ``server`` (``engine-profile-<server>-<workload>-r<k>.json``: fitted from the engine's
    steps in that run alone), by run; None where a run has none (an older run directory, or
    too few steps)."""
    out: list[EngineProfile | None] = []
    k = 0
    while (path / f"records-{workload}-{server}-r{k}.json").exists():
        f = path / f"engine-profile-{server}-{workload}-r{k}.json"
        out.append(EngineProfile.load(f) if f.exists() else None)
        k += 1
    return out


def load_replays(path: Path, stretches: bool = False) -> list[Replay]:
    """One :class:`Replay` per repeat of a serve_bench ``--out`` directory (a server with fewer
    repeats repeats its last; none for a JSON file). ``stretches``: with each budgeted
    server's engine profile of each run (:func:`stretch_profiles`)."""
    runs = _runs(path) if path.is_dir() else {}
    count = max((len(v) for v in runs.values()), default=0)
    own = {
        key: stretch_profiles(path, *key) for key in runs
        if stretches and key[1] in PAUSING_SERVERS
    }
    replays = []
    for k in range(count):
        sent: dict[str, dict[str, dict[int, float]]] = {}
        stalls: dict[str, dict[str, list[tuple[float, float]]]] = {}
        gaps: dict[str, dict[str, float]] = {}
        profiles: dict[str, dict[str, EngineProfile]] = {}
        phases: dict[str, dict[str, PhaseGaps]] = {}
        outcomes: dict[str, dict[str, list[tuple[int, int]]]] = {}
        rates: dict[str, dict[str, float]] = {}
        for (workload, server), reps in runs.items():
            run = reps[min(k, len(reps) - 1)]
            mine = own.get((workload, server)) or []
            profile = mine[min(k, len(mine) - 1)] if mine else None
            if profile is not None:
                profiles.setdefault(workload, {})[server] = profile
            bands = real_wait_outcomes(run)
            if bands is not None:
                outcomes.setdefault(workload, {})[server] = bands
            rate = real_release_rate(run)
            if rate is not None:
                rates.setdefault(workload, {})[server] = rate
            recs = run.get("records") or []
            if not recs:
                continue
            t0 = min(r["start"] for r in recs)
            sent.setdefault(workload, {})[server] = send_times_of(recs)
            stalls.setdefault(workload, {})[server] = [
                (a - t0, d) for a, d in run.get("client_stalls") or ()
            ]
            budgeted = server in PAUSING_SERVERS
            gap = real_stream_gap(recs, budgeted)
            if gap is not None:
                gaps.setdefault(workload, {})[server] = gap
            phase = real_phase_gaps(recs, budgeted)
            if phase is not None:
                phases.setdefault(workload, {})[server] = phase
        replays.append(Replay(sent, stalls, gaps, profiles, phases, outcomes, rates))
    return replays


def real_release_rate(run: Mapping[str, Any]) -> float | None:
    """A budgeted server's release rate just before one run (blocks per second, from
    serve_bench's ``release_rate`` of its records file; None where it has none)."""
    return sb._num((run.get("release_rate") or {}).get("before"))


def real_wait_outcomes(run: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    """A budgeted server's wait outcomes by band just before one run (``(seen, in time)`` per
    band of pressure, from serve_bench's ``wait_outcomes`` of its records file; None where it
    has none: not budgeted, or a run from before serve_bench recorded them)."""
    bands = (run.get("wait_outcomes") or {}).get("before")
    if not isinstance(bands, list):
        return None
    return [(int(b["seen"]), int(b["in_time"])) for b in bands]


def release_rate_of(memory: ForecastMemory | None, server: str) -> float:
    """The release rate (blocks per second) that ``server``'s simulated budget starts a workload
    from, carried in ``memory`` (0: a fresh one), as its forecast reads it."""
    if memory is None:
        return 0.0
    config = simulated_config(server) or SchedulerConfig()
    return memory.release_rate(config.release_rate_window_s)


def memory_bands(memory: ForecastMemory | None) -> list[tuple[int, int]]:
    """``(seen, in time)`` per band of pressure of a forecast's memory (none: a fresh one), as
    the forecast that takes it over reads them (:meth:`ForecastMemory.wait_outcomes_by_band`:
    the outcomes of its last minute only), as a real server's snapshot shows them."""
    return [] if memory is None else list(memory.wait_outcomes_by_band())


def with_wait_outcomes(
    memory: ForecastMemory | None, bands: Sequence[tuple[int, int]]
) -> ForecastMemory:
    """``memory`` (None: a fresh forecast's) with the wait outcomes ``bands`` instead of its
    own, every one of them as of the memory's time (so each counts for a minute from the
    workload's start, :data:`kvbudget.core.forecast.WAIT_OUTCOME_HORIZON_S`): what a real
    server had learned, for a simulated one to start from (``--wait-outcomes real``)."""
    base = memory if memory is not None else Scheduler(Capacity(1, 1)).forecast.memory()
    at = base.at
    return attrs.evolve(base, outcomes=tuple(
        tuple([(at, True)] * in_time + [(at, False)] * (seen - in_time))
        for seen, in_time in bands
    ))


def format_bands(bands: Sequence[tuple[int, int]]) -> str:
    """The bands seen, ``pressure from: in time/seen`` ("none" without any)."""
    shown = [
        f"{wait_pressure_band_from(band):.2g}:{in_time}/{seen}"
        for band, (seen, in_time) in enumerate(bands) if seen
    ]
    return " ".join(shown) or "none"


def load_real(path: Path) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any]]:
    """A serve_bench run: ``({workload: {server: summary}}, {workload: {server: records}})``
    from an ``--out`` directory (several runs of a workload: the median of each count; the
    records of the first) or from a file whose last JSON line is serve_bench's result (no
    records then)."""
    real: dict[str, dict[str, dict[str, Any]]] = {}
    records: dict[str, Any] = {}
    if path.is_dir():
        for (workload, server), runs in _runs(path).items():
            summaries = []
            for r in runs:
                summary = _real_summary(r["summary"])
                if r.get("records"):
                    # (from the records where they are kept: a run made before its summary
                    # had the freezes, or before they left batch streams out, reads as now)
                    summary.update(_freezes_of(r["records"]))
                summaries.append(summary)
            merged = dict(summaries[0])
            if len(summaries) > 1:
                for key in ("good", "late", "rejected", "failed", "abandoned"):
                    merged[key] = _median([s[key] for s in summaries])
                frozen = [s["frozen_streams"] for s in summaries]
                if None not in frozen:
                    merged["frozen_streams"] = _median(frozen)
                merged["runs"] = len(summaries)
            real.setdefault(workload, {})[server] = merged
            records.setdefault(workload, {})[server] = runs[0].get("records", [])
        if not real:
            raise SystemExit(
                f"{path}: no records-<workload>-<server>-r<k>.json files of vllm, "
                "vllm-cap<N>, kvbudget or kvbudget-serve"
            )
        return real, records
    doc = result_line(path)
    if doc is None:
        raise SystemExit(f"{path}: no serve_bench JSON line ({{\"workloads\": ...}})")
    for workload, per in doc["workloads"].items():
        for server, summary in per.items():
            if is_simulated(server):
                real.setdefault(workload, {})[server] = _real_summary(summary)
    return real, records


#: the settings of a serve_bench run that decide its requests, as this script's options, with
#: their defaults (serve_bench's own)
RUN_SETTINGS: dict[str, Any] = {
    "bench_arg": [], "seed": 0, "num_prompts_scale": 1.0, "policy": "calibrated",
    "example_arg": [], "serve_arg": [], "kv_blocks": sb.KV_BLOCKS,
    "max_num_seqs": sb.MAX_NUM_SEQS,
}
#: each as serve_bench records it (its result's ``meta``, its ``--out`` directory's settings)
_RECORDED_AS = {
    "bench_arg": "bench_args", "example_arg": "example_args", "serve_arg": "serve_args",
}


def run_settings_of(path: Path) -> dict[str, Any] | None:
    """The settings a serve_bench run recorded (``--out`` directory: its ``settings.json``;
    a file: its result line's ``meta``), or None for a run made before it recorded them."""
    if path.is_dir():
        file = path / sb.SETTINGS_FILE
        if not file.exists():
            return None
        doc: Any = json.loads(file.read_text(encoding="utf-8"))
        return doc if isinstance(doc, dict) else None
    meta = (result_line(path) or {}).get("meta")
    return meta if isinstance(meta, dict) else None


def result_line(path: Path) -> dict[str, Any] | None:
    """The last serve_bench result line (``{"workloads": ...}``) of a file, or None."""
    doc: dict[str, Any] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                candidate = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(candidate, dict) and "workloads" in candidate:
                doc = candidate
    return doc


#: the settings that are lists of arguments
_LISTS = ("bench_arg", "example_arg", "serve_arg")


def adopt_run_settings(opts: argparse.Namespace, settings: Mapping[str, Any] | None) -> None:
    """``--real``: plan the requests the run sent. Each setting the run recorded is taken
    from it; one given on the command line that differs from the run's is an error (the
    simulated requests would not be the run's). Without ``--workload``, the run's workloads.
    A run that recorded nothing keeps the command line's (see :func:`translation_warnings`)."""
    if not settings:
        return
    for key in RUN_SETTINGS:
        recorded = settings.get(_RECORDED_AS.get(key, key))
        if recorded is None:
            continue
        mine = getattr(opts, key)
        if key in opts.given and mine != recorded:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(
                f"{flag} {mine!r} differs from the real run's {recorded!r}: leave it out to "
                f"simulate the requests that run sent"
            )
        setattr(opts, key, list(recorded) if key in _LISTS else recorded)
    ran = settings.get("workloads")
    if opts.workload is None and isinstance(ran, list):
        opts.workloads = [w for w in sb.WORKLOADS if w in ran]


#: a simulated request further than this from the real client's (tokens) means the plan is not
#: the run's: vLLM's decode and re-encode moves a prompt by a token or two
_PROMPT_LEN_SLACK = 8


def translation_warnings(checks: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """The workloads whose simulated requests are not the ones the real client sent (a run
    compared with other ``--bench-arg``, seed or scale than it was made with)."""
    out = []
    for workload, per in checks.items():
        for server, c in per.items():
            if (
                c.get("output_len_differs", 0)
                or c.get("max_prompt_len_diff", 0) > _PROMPT_LEN_SLACK
                or c.get("matched", 0) < c.get("of", 0)
            ):
                out.append(f"{workload}/{server}")
    return out


def run_real(opts: argparse.Namespace, out_dir: Path) -> Path:
    """Run serve_bench once for ``vllm`` and ``kvbudget`` on the selected workloads; its
    progress goes to stderr; returns the ``--out`` directory."""
    argv = [
        sys.executable, str(HERE / "serve_bench.py"), "--servers", ",".join(SERVERS),
        "--out", str(out_dir), "--seed", str(opts.seed), "--policy", opts.policy,
        "--num-prompts-scale", str(opts.num_prompts_scale),
    ]
    if opts.model is not None:
        argv += ["--model", str(opts.model)]
    for name in opts.workloads:
        argv += ["--workload", name]
    argv += [f"--bench-arg={arg}" for arg in opts.bench_arg]
    argv += [f"--example-arg={arg}" for arg in opts.example_arg]
    argv += ["--kv-blocks", str(opts.kv_blocks), "--max-num-seqs", str(opts.max_num_seqs)]
    print(f"# real run: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    # the machine's load around the run: the engine's speed depends on it (2 shared cores)
    before = os.getloadavg()
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
    after = os.getloadavg()
    (out_dir / "serve_bench.out").write_text(proc.stdout, encoding="utf-8")
    (out_dir / "load.json").write_text(json.dumps({"before": before, "after": after}))
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"serve_bench exited with {proc.returncode}")
    return out_dir


def translation_check(
    plans: Mapping[str, Sequence[Planned]], records: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """Per workload: how the simulated requests' lengths and arrivals differ from what the
    real client sent (matched by request index)."""
    out: dict[str, dict[str, Any]] = {}
    for workload, per in records.items():
        plan = {p.index: p for p in plans.get(workload, ())}
        for server, recs in per.items():
            if not recs or not plan:
                continue
            t0 = min(r["start"] for r in recs)
            prompt_diff = output_diff = matched = 0
            worst_prompt = worst_arrival = 0.0
            for r in recs:
                m = re.search(r"(\d+)$", r["request_id"])
                p = plan.get(int(m.group(1))) if m else None
                if p is None:
                    continue
                matched += 1
                d = abs(r["prompt_len"] - p.prompt_tokens)
                prompt_diff += d > 0
                worst_prompt = max(worst_prompt, d)
                output_diff += r["output_len"] != p.output_tokens
                worst_arrival = max(worst_arrival, abs((r["start"] - t0) - p.arrival_s))
            out.setdefault(workload, {})[server] = {
                "matched": matched, "of": len(recs), "prompt_len_differs": prompt_diff,
                "max_prompt_len_diff": worst_prompt, "output_len_differs": output_diff,
                "max_send_time_diff_s": round(worst_arrival, 3),
            }
    return out


def send_times_of(recs: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """``{request index: seconds after the first send}`` of one run's records (serve_bench's
    request ids end in the request's index)."""
    if not recs:
        return {}
    t0 = min(r["start"] for r in recs)
    times: dict[int, float] = {}
    for r in recs:
        m = re.search(r"(\d+)$", r["request_id"])
        if m:
            times[int(m.group(1))] = r["start"] - t0
    return times


def real_send_times(records: Mapping[str, Any]) -> dict[str, dict[str, dict[int, float]]]:
    """:func:`send_times_of` every workload's and server's records,
    ``{workload: {server: {request index: seconds}}}``."""
    return {
        workload: {server: send_times_of(recs) for server, recs in per.items() if recs}
        for workload, per in records.items()
    }


def median_of_runs(
    sims: Sequence[Mapping[str, Mapping[str, Mapping[str, Any]]]],
) -> dict[str, dict[str, dict[str, Any]]]:
    """The simulated runs of several real runs' send times as one: per workload and server the
    median of each count (the first run's other figures), ``runs`` their number; as
    :func:`load_real` merges the real runs."""
    first = sims[0]
    if len(sims) == 1:
        return {w: {srv: dict(v) for srv, v in per.items()} for w, per in first.items()}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, per in first.items():
        for server, summary in per.items():
            merged = dict(summary)
            for key in COUNTS:
                merged[key] = _median([sim[workload][server][key] for sim in sims])
            frozen = [sim[workload][server].get("frozen_streams") for sim in sims]
            if None not in frozen:
                merged["frozen_streams"] = _median([float(x) for x in frozen if x is not None])
            for key in ("step_scale",):
                scales = [sim[workload][server].get(key) for sim in sims]
                if None not in scales:
                    merged[key] = _median([float(x) for x in scales if x is not None])
            bands = [sim[workload][server].get("good_at_pace_band") for sim in sims]
            if all(b is not None for b in bands):
                merged["good_at_pace_band"] = [
                    _median([float(b[0]) for b in bands if b is not None]),
                    _median([float(b[1]) for b in bands if b is not None]),
                ]
            merged["runs"] = len(sims)
            out.setdefault(workload, {})[server] = merged
    return out


# -- the comparison ------------------------------------------------------------------------------


def error(real: Mapping[str, Any], sim: Mapping[str, Any]) -> dict[str, Any]:
    """Relative error of good (and the other counts' differences), and the target verdict."""
    r, s = float(real["good"]), float(sim["good"])
    allowed = max(TARGET_SHARE * r, TARGET_REQUESTS)
    band = sim.get("good_at_pace_band")
    return {
        "good_rel": None if r == 0 else round((s - r) / r, 3),
        "good_diff": s - r,
        "late_diff": float(sim["late"]) - float(real["late"]),
        "rejected_diff": float(sim["rejected"]) - float(real["rejected"]),
        "within_target": abs(s - r) <= allowed,
        # (the target met by the cell simulated PACE_BAND faster or slower: None without one)
        "within_target_in_pace_band": None if band is None else any(
            abs(float(x) - r) <= allowed for x in (*band, s)
        ),
    }


def same_order(real: Mapping[str, Any], sim: Mapping[str, Any]) -> bool:
    """Do both sides rank the servers' good the same way, every pair of the servers both sides
    have? A difference of at most :data:`TARGET_REQUESTS` counts as a tie, which matches a tie
    or either order."""

    def sign(d: float) -> int:
        return 0 if abs(d) <= TARGET_REQUESTS else (1 if d > 0 else -1)

    both = [x for x in real if x in sim]
    for x, y in itertools.combinations(both, 2):
        a = sign(float(real[x]["good"]) - float(real[y]["good"]))
        b = sign(float(sim[x]["good"]) - float(sim[y]["good"]))
        if not (a == b or a == 0 or b == 0):
            return False
    return True


def same_order_in_pace_band(real: Mapping[str, Any], sim: Mapping[str, Any]) -> bool | None:
    """Could the simulated servers come in the real order, each anywhere in its pace band
    (``good_at_pace_band``: each server's pace is fitted on its own, so each may be off on its
    own)? For every pair the real run ranks apart (by more than :data:`TARGET_REQUESTS`), the
    band of the one ahead must reach within that of the other's. None where a server has no
    band."""
    both = [x for x in real if x in sim]
    bands = {x: sim[x].get("good_at_pace_band") for x in both}
    if any(b is None for b in bands.values()):
        return None
    for x, y in itertools.permutations(both, 2):
        ahead = float(real[x]["good"]) - float(real[y]["good"]) > TARGET_REQUESTS
        # x ahead of y: a tie at least must be within reach
        if ahead and float(bands[x][1]) - float(bands[y][0]) < -TARGET_REQUESTS:
            return False
    return True


def compare(
    real: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``{workload: {server: {"real", "sim", "error"}, "same_order": bool,
    "same_order_in_pace_band": bool | None}}``."""
    out: dict[str, dict[str, Any]] = {}
    for workload, per_sim in sim.items():
        per_real = real.get(workload, {})
        entry: dict[str, Any] = {}
        for server in per_sim:
            r, s = per_real.get(server), per_sim.get(server)
            entry[server] = {
                "real": r, "sim": s, "error": error(r, s) if r is not None and s else None
            }
        if sum(per_real.get(x) is not None for x in per_sim) >= 2:
            # (every pair of servers both sides have: vLLM's and the example's, or any two)
            entry["same_order"] = same_order(per_real, per_sim)
            entry["same_order_in_pace_band"] = same_order_in_pace_band(per_real, per_sim)
        else:
            entry["same_order"] = entry["same_order_in_pace_band"] = None
        out[workload] = entry
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def entry_servers(entry: Mapping[str, Any]) -> list[str]:
    """The servers of one workload's comparison (:func:`compare`), in its order."""
    return [k for k in entry if k not in ("same_order", "same_order_in_pace_band")]


def format_table(result: Mapping[str, Mapping[str, Any]]) -> str:
    head = (
        f"{'workload':<13} {'server':<14} {'good r/s':>10} {'late r/s':>10} {'rej r/s':>9} "
        f"{'aband r/s':>10} {'good err':>9} {'target':>6} {'pace band':>9} {'ttft50 r/s':>13} "
        f"{'tpot50ms r/s':>12} {'frozen r/s':>10}  order"
    )
    lines = [head]
    for workload, entry in result.items():
        servers = entry_servers(entry)
        for server in servers:
            e = entry[server]
            r, s = e["real"] or {}, e["sim"] or {}

            def pair(key: str, r: Mapping[str, Any] = r, s: Mapping[str, Any] = s) -> str:
                return f"{_cell(r.get(key))}/{_cell(s.get(key))}"

            err = e["error"]
            rel = "-" if not err or err["good_rel"] is None else f"{100 * err['good_rel']:+.0f}%"
            ok = "-" if not err else ("ok" if err["within_target"] else "MISS")
            band = s.get("good_at_pace_band")
            spread = "-" if band is None else f"{_cell(band[0])}-{_cell(band[1])}"
            order = "" if server != servers[-1] else {
                True: "same", False: "DIFFERENT", None: "-"
            }[entry["same_order"]]
            lines.append(
                f"{workload:<13} {server:<14} {pair('good'):>10} {pair('late'):>10} "
                f"{pair('rejected'):>9} {pair('abandoned'):>10} {rel:>9} {ok:>6} {spread:>9} "
                f"{pair('ttft_p50_s'):>13} {pair('tpot_p50_ms'):>12} "
                f"{pair('frozen_streams'):>10}  {order}"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--real", type=Path, default=None, metavar="FILE_OR_DIR",
                     help="a serve_bench --out directory or its JSON output, instead of a run")
    src.add_argument("--sim-only", action="store_true", help="no real side at all")
    p.add_argument("--workload", action="append", choices=list(sb.WORKLOADS), default=None,
                   help="repeatable; default all, in serve_bench's order")
    p.add_argument("--bench-arg", action="append", default=None, metavar="ARG",
                   help="serve_bench's --bench-arg (a held-out variant; with --real, taken from "
                        "the run where it recorded them, which serve_bench does since its "
                        "settings.json)")
    p.add_argument("--engine-profile", default=RUN_PROFILE,
                   help=f"profile file or shipped name, or {RUN_PROFILE!r}: the one the kvbudget "
                        f"server fitted from its steps in the real run (default; "
                        f"{DEFAULT_PROFILE} where the run has none)")
    p.add_argument("--step-scale", type=float, default=1.0, metavar="F",
                   help="what-if, not a fit: multiply every step-time figure of the profile by "
                        "F (the same engine on a faster or busier machine; default 1)")
    p.add_argument("--intake-ms", type=float, default=None, metavar="MS",
                   help="engine time each arriving request costs (the simulator's intake_s; "
                        "default: the profile's, else the shipped "
                        f"{DEFAULT_PROFILE}'s, measured on this machine's bursts)")
    p.add_argument("--send-times", choices=("auto", "planned", "real"), default="auto",
                   help="when the simulated requests arrive: when the real client sent each one "
                        "to each server (real: needs the real run's records; it replays the "
                        "bursts of a client stalled on a busy machine), on the planned schedule "
                        "(planned), or real where the run kept its records and else planned "
                        "(auto, the default)")
    p.add_argument("--stall-speed", type=float, default=STALL_SPEED, metavar="S",
                   help="with the real client replayed: the simulated engine's speed (0-1) while "
                        f"the client was stalled (default {STALL_SPEED}, fitted on one run; 1: "
                        "the stalls only delay the client's reading)")
    p.add_argument("--front-end", choices=("run", "none"), default="none",
                   help="each server's front-end process: not modelled (none, the default: "
                        "clients get tokens as the engine makes them) or fitted from the real "
                        "run's CPU counts (run, where serve_bench counted them; "
                        "docs/benchmarks-history.md says why it is not the default)")
    p.add_argument("--pace", choices=("run", "phases", "none"), default=PACE_DEFAULT,
                   help="vLLM's server's engine: at the pace its own streams show in each "
                        "replayed run (run: the profile's step times scaled until the simulated "
                        "streams' mean gap between tokens is the real run's; needs the run's "
                        "records; phases: one scale while requests are sent and one after, "
                        "each from the streams of its phase), and the example's on its engine "
                        "profile of each run where serve_bench kept one; or both at the "
                        f"profile's (none) (default {PACE_DEFAULT})")
    p.add_argument("--pace-of", default=None, metavar="SERVER",
                   help="a what-if, not a prediction: every other server simulated on SERVER's "
                        "engine as it was paced in the replayed run (its profile and step-time "
                        "scales; --pace), each still sent and read by its own client: the "
                        "servers' decisions compared on one engine, without what their front "
                        "ends and the machine's drift between their turns did to it (e.g. "
                        "--pace-of vllm)")
    p.add_argument("--wait-outcomes", choices=("sim", "real"), default="sim",
                   help="what the example's turn-away at arrival knows at each workload's "
                        "start: what the simulated runs of the workloads before taught it "
                        "(sim, the default: the state predicted too) or what the real server "
                        "had learned then, where serve_bench recorded it (real: each workload "
                        "predicted from the server's state at its start)")
    p.add_argument("--policy", default=None,
                   help="the kvbudget example's policy (default: the run's, else calibrated)")
    p.add_argument("--example-arg", action="append", default=None, metavar="ARG",
                   help="one more argument of the kvbudget example, as serve_bench's "
                        "--example-arg (repeatable; the policy's settings among them, "
                        "--first-token-pause-share, are simulated; default: the run's, else none)")
    p.add_argument("--serve-arg", action="append", default=None, metavar="ARG",
                   help="one more argument of kvbudget serve, as serve_bench's --serve-arg "
                        f"(repeatable; its policy's settings among them, {SERVE_PAUSE_FLAG}, "
                        "are simulated for kvbudget-serve; default: the run's, else none)")
    p.add_argument("--seed", type=int, default=None,
                   help="serve_bench's dataset seed (default: the run's, else 0)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="serve_bench's --kv-blocks: the engine's cache, N - 1 usable blocks "
                        f"(default: the run's, else {sb.KV_BLOCKS}); the simulated engine "
                        "has it whatever the profile says")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="serve_bench's --max-num-seqs (default: the run's, else "
                        f"{sb.MAX_NUM_SEQS}); the simulated engine's batch limit")
    p.add_argument("--num-prompts-scale", type=float, default=None,
                   help="serve_bench's request-count scale (default: the run's, else 1)")
    p.add_argument("--model", type=Path, default=None,
                   help="the tiny model directory (its tokenizer; built if missing; default: "
                        "serve_bench's, or without one kvbudget's tiny tokenizer's figures)")
    p.add_argument("--out", type=Path, default=None,
                   help="where the real run keeps serve_bench's records (default: a temp dir)")
    args = p.parse_args(argv)
    args.workloads = [w for w in sb.WORKLOADS if w in (args.workload or list(sb.WORKLOADS))]
    args.given = {k for k in RUN_SETTINGS if getattr(args, k) is not None}
    for key, default in RUN_SETTINGS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if not args.step_scale > 0:
        p.error("--step-scale must be > 0")
    if not 0.0 <= args.stall_speed <= 1.0:
        p.error("--stall-speed must be in [0, 1]")
    if args.intake_ms is not None and not 0.0 <= args.intake_ms < math.inf:
        p.error("--intake-ms must be a finite number >= 0")
    sb.check_engine_args(p, args)
    return args


def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """``profile`` with every step-time figure (and the abort latency, one step) times
    ``factor``."""
    if factor == 1.0:
        return profile
    return attrs.evolve(
        profile, name=f"{profile.name} x{factor:g}", **scaled_timing(profile, factor)
    )


def scaled_timing(engine: EngineProfile | EngineModel, factor: float) -> dict[str, Any]:
    """The timing fields of an engine profile or model, each times ``factor``: the step-time
    figures, the abort latency (one step) and the intake (the one rule :func:`scaled` and
    :func:`scaled_engine` apply)."""
    return {
        "step": scaled_step(engine.step, factor),
        "abort_latency_s": engine.abort_latency_s * factor,
        "intake_s": engine.intake_s * factor,
    }


def scaled_step(step: StepTimeModel, factor: float) -> StepTimeModel:
    """``step`` with every figure times ``factor`` (the same engine, slower or faster)."""
    return attrs.evolve(
        step, fixed_s=step.fixed_s * factor, per_seq_s=step.per_seq_s * factor,
        per_context_token_s=step.per_context_token_s * factor,
        prefill_per_token_s=step.prefill_per_token_s * factor,
    )


def speed_check(result: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The engine's speed, real against simulated, where the load is light enough that no
    queue forms (the abandonment workload: 6 req/s of 256 + 100..400 tokens): the ratio of
    vLLM's median TPOT, real over simulated. Not used by the simulation; a diagnostic."""
    entry = result.get("abandon", {}).get("vllm")
    if not entry or not entry.get("real") or not entry.get("sim"):
        return None
    real, sim = entry["real"].get("tpot_p50_ms"), entry["sim"].get("tpot_p50_ms")
    if not real or not sim:
        return None
    return {"workload": "abandon", "server": "vllm", "tpot_p50_ms_real": real,
            "tpot_p50_ms_sim": sim, "real_over_sim": round(real / sim, 2)}


def run_engine(profile: EngineProfile, kv_blocks: int, max_num_seqs: int) -> EngineProfile:
    """``profile`` with the cache and batch limit of the engine the run's servers ran
    (serve_bench's ``--kv-blocks``, of which vLLM keeps one block back, and
    ``--max-num-seqs``): a profile fitted from that run has them already; a shipped one, or
    one fitted from another run, has its own engine's."""
    return attrs.evolve(profile, capacity_blocks=kv_blocks - 1, max_batch=max_num_seqs)


def load_profile(
    choice: str, run_dir: Path | None, intake_ms: float | None = None
) -> EngineProfile:
    """``--engine-profile``: a file or shipped name, or :data:`RUN_PROFILE` (the run's own where
    ``run_dir`` holds one: the example's, else ``kvbudget serve``'s; else
    :data:`DEFAULT_PROFILE`), with ``--intake-ms``'s intake where given. A run's own profile
    is fitted from its engine's steps, which do not tell the intake apart (the engine model's
    module docstring): it takes :data:`DEFAULT_PROFILE`'s, measured on the machine serve_bench
    runs on; a profile named or given as a file keeps its own."""
    if choice != RUN_PROFILE:
        profile = EngineProfile.load(choice)
    elif run_dir is not None and (
        (own := run_dir / RUN_PROFILE_FILE).exists()
        or (own := run_dir / SERVE_PROFILE_FILE).exists()
    ):
        profile = EngineProfile.load(own)
        if not profile.intake_s:
            profile = attrs.evolve(
                profile, intake_s=EngineProfile.load(DEFAULT_PROFILE).intake_s
            )
    else:
        profile = EngineProfile.load(DEFAULT_PROFILE)
    if intake_ms is not None:
        return attrs.evolve(profile, intake_s=intake_ms / 1e3)
    return profile


def _tokenizer(opts: argparse.Namespace) -> TokenizerInfo:
    """The tokenizer of ``--model`` (built if missing); without ``--model``, serve_bench's
    default model's if it is there, else :data:`TINY_TOKENIZER` (what build_tiny_llama builds
    by default: the figures are the same, and the simulation needs no model files)."""
    if opts.model is None:
        default = Path(sb.DEFAULT_MODEL_DIR)
        return tokenizer_info(default) if (default / "tokenizer.json").exists() else TINY_TOKENIZER
    if not (opts.model / "tokenizer.json").exists():
        from kvbudget.engines.tiny_model import build_tiny_llama

        opts.model = build_tiny_llama(opts.model)
    return tokenizer_info(opts.model)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    tok = _tokenizer(opts)
    real: dict[str, dict[str, dict[str, Any]]] = {}
    records: dict[str, Any] = {}
    real_source: str | None = None
    load_file: Path | None = None
    run_dir: Path | None = None
    if opts.real is not None:
        real, records = load_real(opts.real)
        real_source = str(opts.real)
        run_dir = opts.real if opts.real.is_dir() else None
        adopt_run_settings(opts, run_settings_of(opts.real))
    elif not opts.sim_only:
        out_dir = opts.out or Path(tempfile.mkdtemp(prefix="sim_vs_real-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        real, records = load_real(run_real(opts, out_dir))
        real_source = str(out_dir)
        run_dir = out_dir
    load_file = run_dir / "load.json" if run_dir is not None else None
    loaded = load_profile(opts.engine_profile, run_dir, opts.intake_ms)
    profile = scaled(run_engine(loaded, opts.kv_blocks, opts.max_num_seqs), opts.step_scale)
    print(f"# engine profile: {profile.name} ({profile.source}); intake "
          f"{1e3 * profile.intake_s:g} ms per request", file=sys.stderr)
    if (loaded.capacity_blocks, loaded.max_batch) != (profile.capacity_blocks, profile.max_batch):
        print(f"# the run's engine: {profile.capacity_blocks} blocks, max_num_seqs "
              f"{profile.max_batch} (the profile's {loaded.capacity_blocks} and "
              f"{loaded.max_batch} replaced)", file=sys.stderr)
    if opts.send_times == "real" and not records:
        raise SystemExit("--send-times real needs the real run's records (a serve_bench --out DIR)")
    send_times = "planned" if opts.send_times == "planned" or not records else "real"
    try:
        plans = {
            w: plan_workload(w, opts.seed, tok, opts.num_prompts_scale, opts.bench_arg)
            for w in opts.workloads
        }
    except ValueError as exc:
        raise SystemExit(f"sim_vs_real: {exc}") from None
    unmodelled = unmodelled_notes(opts.workloads, opts.bench_arg, send_times)
    # each real run replayed with its own client (records come from a run directory)
    replays: list[Replay | None] = (
        list(load_replays(run_dir, stretches=opts.pace != "none"))
        if send_times == "real" and run_dir is not None
        else [None]
    )
    print(f"# send times: {send_times} ({len(replays)} run(s))", file=sys.stderr)
    fitted = (
        front_ends_of(run_dir) if opts.front_end == "run" and run_dir is not None else {}
    )
    for server, (fe, idle) in fitted.items():
        print(f"# front end of {server}: {1e6 * fe.per_request_s:.0f} us per request, "
              f"{1e6 * fe.per_output_s:.1f} us per output (idle {100 * idle:.1f} % of a core)",
              file=sys.stderr)
    front_ends = {server: fe for server, (fe, _) in fitted.items()}
    servers = servers_in_order({s for per in real.values() for s in per})
    if opts.pace_of is not None:
        if opts.pace_of not in servers:
            raise SystemExit(f"sim_vs_real: --pace-of {opts.pace_of}: not one of this run's "
                             f"servers ({', '.join(servers)})")
        print(f"# WHAT-IF (--pace-of {opts.pace_of}): every other server on {opts.pace_of}'s "
              "engine as it was paced; its sim figures are not predictions of its real run",
              file=sys.stderr)
    paced = (
        tuple(s for s in servers if s in PACED_SERVERS or sb.queue_cap(s) is not None)
        if opts.pace != "none" and send_times == "real"
        else ()
    )
    sim = median_of_runs([
        simulate_workloads(
            opts.workloads, profile=profile,
            policy=example_policy(opts.policy, opts.example_arg), seed=opts.seed,
            scale=opts.num_prompts_scale, tok=tok, bench_args=opts.bench_arg, replay=replay,
            stall_speed=opts.stall_speed, front_ends=front_ends, paced=paced, pace=opts.pace,
            servers=servers, wait_outcomes=opts.wait_outcomes,
            serve_policy=example_policy(opts.policy, opts.serve_arg, SERVE_PAUSE_FLAG),
            pace_of=opts.pace_of,
        )
        for replay in replays
    ])
    result = compare(real, sim)
    checks = translation_check(plans, records)
    print("real / sim per workload and server (rej = HTTP 429 + 503; good err = (sim - real) "
          f"/ real; target: within {100 * TARGET_SHARE:.0f} % or {TARGET_REQUESTS} requests)")
    print(format_table(result))
    for workload, per in checks.items():
        for server, c in per.items():
            print(f"# translation {workload}/{server}: {json.dumps(c)}")
    foreign = translation_warnings(checks)
    if foreign:
        print(f"# WARNING: the simulated requests are not the ones the real client sent in "
              f"{', '.join(foreign)} (prompt or output lengths differ): give the --bench-arg, "
              f"--seed and --num-prompts-scale that run was made with")
    for note in unmodelled:
        print(f"# WARNING: {note}")
    print("# the simulator does not model:")
    for note in NOTES:
        print(f"#  - {note}")
    for server in paced:
        scales = ", ".join(
            f"{w} {sim[w][server]['step_scale']:g}" for w in sim if server in sim[w]
        )
        print(f"# {server}'s engine pace from its streams (step-time scale, median of runs): "
              f"{scales}")
        windows = ", ".join(
            f"{w} " + "/".join(f"{x:g}" for x in sim[w][server]["window_step_scales"])
            for w in sim if "window_step_scales" in sim[w].get(server, {})
        )
        if windows:
            print(f"# {server}'s pace per window of its run, first to last (--pace phases, the "
                  f"first run): {windows}")
    started = "the real one" if opts.wait_outcomes == "real" else "its own (--wait-outcomes sim)"
    for server in servers:
        starts = [
            (w, sim[w][server]["wait_outcomes_at_start"]) for w in sim
            if (sim[w].get(server) or {}).get("wait_outcomes_at_start")
            and sim[w][server]["wait_outcomes_at_start"]["real"] is not None
        ]
        if starts:
            print(f"# {server}'s turn-away evidence at each workload's start (wait outcomes by "
                  f"pressure from: in time/seen; the real server's | what the simulated "
                  f"workload before left, the first run; each simulated workload started "
                  f"from {started}):")
            for w, bands in starts:
                print(f"#   {w}: {format_bands(bands['real'])} | {format_bands(bands['sim'])}")
        rates = [
            (w, sim[w][server]["release_rate_at_start"]) for w in sim
            if ((sim[w].get(server) or {}).get("release_rate_at_start") or {}).get("real")
            is not None
        ]
        if rates:
            print(f"# {server}'s release rate at each workload's start (blocks/s on the clock "
                  f"that runs while the engine holds blocks; the real server's | the simulated "
                  f"one's, the first run): " + ", ".join(
                      f"{w} {r['real']:.0f} | {r['sim']:.0f}" for w, r in rates))
    drifts = machine_drifts(run_dir) if run_dir is not None else []
    if drifts:
        print(f"# WARNING: the machine's probe before these real runs differs from their vLLM "
              f"reference's by more than {sb.MACHINE_DRIFT}x (they compare two machines): "
              f"{', '.join(drifts)}")
    speed = speed_check(result)
    if speed is not None:
        print(f"# engine speed at light load (abandon, vllm): TPOT p50 real "
              f"{speed['tpot_p50_ms_real']} ms, sim {speed['tpot_p50_ms_sim']} ms "
              f"(real / sim {speed['real_over_sim']})")
    misses = [
        f"{w}/{s}" for w, e in result.items() for s in entry_servers(e)
        if e[s]["error"] and not e[s]["error"]["within_target"]
    ]
    order = [w for w, e in result.items() if e["same_order"] is False]
    in_band = [
        f"{w}/{s}" for w, e in result.items() for s in entry_servers(e)
        if e[s]["error"] and not e[s]["error"]["within_target"]
        and e[s]["error"]["within_target_in_pace_band"]
    ]
    band_note = (
        f" (met with the engine {PACE_BAND:.0%} faster or slower, within what its pace is "
        f"known to: {', '.join(in_band)})" if in_band else ""
    )
    order_in_band = [w for w in order if result[w].get("same_order_in_pace_band")]
    order_note = (
        f" (the real order within the servers' pace bands: {', '.join(order_in_band)})"
        if order_in_band else ""
    )
    print(f"# target missed: {', '.join(misses) or 'none'}{band_note}; order differs: "
          f"{', '.join(order) or 'none'}{order_note}")
    doc = {
        "workloads": result,
        "notes": list(NOTES),
        "translation": checks,
        "translation_mismatch": foreign,
        "speed_check": speed,
        "meta": {
            "real": real_source,
            # 1/5/15-minute load averages before and after the real run, when it was made here
            "real_load_avg": (
                json.loads(load_file.read_text()) if load_file and load_file.exists() else None
            ),
            "engine_profile": profile.name,
            "engine": {"capacity_blocks": profile.capacity_blocks, "max_batch": profile.max_batch},
            "intake_s": profile.intake_s,
            "step_scale": opts.step_scale,
            "paced": list(paced),
            # a what-if: every other server on this one's engine as it was paced (not predictions)
            "pace_of": opts.pace_of,
            "policies": {s: policy_name(s, opts.policy) for s in servers},
            "seed": opts.seed,
            "num_prompts_scale": opts.num_prompts_scale,
            "bench_args": list(opts.bench_arg),
            "example_args": list(opts.example_arg),
            "serve_args": list(opts.serve_arg),
            "unmodelled": unmodelled,
            "send_times": send_times,
            "stall_speed": opts.stall_speed,
            "wait_outcomes": opts.wait_outcomes,
            "front_ends": {
                server: {**fe.to_dict(), "idle_share": idle}
                for server, (fe, idle) in fitted.items()
            },
            "slo": {"ttft_s": sb.SLO_TTFT_S, "tpot_ms": sb.SLO_TPOT_S * 1000},
            "target": {"share": TARGET_SHARE, "requests": TARGET_REQUESTS},
        },
    }
    print(json.dumps(doc, default=str))
    return 0


if __name__ == "__main__":  # serve_bench's servers start processes
    raise SystemExit(main())
