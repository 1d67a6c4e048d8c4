"""Workloads for the simulator: what arrives when, with which prompt and true output length.

This module owns the *workload* half of the simulator (DESIGN §10): the value types
:class:`TraceRequest` and :class:`Workload`, the trace readers (:func:`read_azure_csv`,
:func:`read_mooncake_jsonl`, :func:`read_trace`), their error type :class:`TraceFormatError`,
and the built-in seeded generator :func:`synthetic_workload`. A workload knows nothing about
service classes, tenants or ``max_tokens``: the scenario overlay (:mod:`kvbudget.sim.scenario`)
adds those.

Zero-length outputs. A trace row that generated 0 tokens is legal (the request stopped at
once), but every admitted request holds at least one decode step in the engine, so a
``GeneratedTokens``/``output_length`` of 0 is read as 1 and counted in
:attr:`Workload.zero_outputs_clamped` (reported by :meth:`Workload.summary`). A prompt of 0
tokens is not a request an engine can run, so it is an error.
"""

from __future__ import annotations

import bisect
import csv
import datetime as _dt
import json
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from kvbudget.errors import InvalidInput
from kvbudget.errors import TraceFormatError as TraceFormatError
from kvbudget.validate import check_float, check_int

__all__ = [
    "AZURE_CONV_ARRIVAL_CV",
    "AZURE_CONV_MAX_OUTPUT_TOKENS",
    "AZURE_CONV_MAX_PROMPT_TOKENS",
    "AZURE_CONV_OUTPUT_STATS",
    "AZURE_CONV_PROMPT_STATS",
    "AZURE_CONV_RATE_RPS",
    "DEFAULT_N_REQUESTS",
    "DEFAULT_RATE_RPS",
    "OUTPUT_LOGNORMAL_MIXTURE",
    "PROMPT_LOGNORMAL_MIXTURE",
    "TraceFormatError",
    "TraceRequest",
    "Workload",
    "percentile",
    "read_azure_csv",
    "read_burstgpt_csv",
    "read_mooncake_jsonl",
    "read_trace",
    "synthetic_workload",
]


# --------------------------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------------------------


def _check_arrival(_inst: object, _attr: object, value: Any) -> None:
    check_float("arrival_s", value, minimum=0.0)


def _check_prompt(_inst: object, _attr: object, value: Any) -> None:
    check_int("prompt_tokens", value, minimum=1)


def _check_output(_inst: object, _attr: object, value: Any) -> None:
    check_int("output_tokens", value, minimum=1)


def _to_hash_ids(value: Iterable[int]) -> tuple[int, ...]:
    return value if isinstance(value, tuple) else tuple(value)


def _check_hash_ids(_inst: object, _attr: object, value: tuple[int, ...]) -> None:
    for h in value:
        if isinstance(h, bool) or not isinstance(h, int):
            raise InvalidInput("hash_ids", value, "a sequence of integers")


@attrs.frozen(slots=True)
class TraceRequest:
    """One request of a workload.

    ``arrival_s``: seconds after the workload's first request. ``prompt_tokens``: prompt length.
    ``output_tokens``: the TRUE number of tokens the request generates when nothing stops it
    early (the trace's real stop point); the scenario's ``max_tokens`` may cut it. ``hash_ids``:
    prefix-block identifiers (Mooncake traces), empty when unknown.
    """

    arrival_s: float = attrs.field(validator=_check_arrival)
    prompt_tokens: int = attrs.field(validator=_check_prompt)
    output_tokens: int = attrs.field(validator=_check_output)
    hash_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_to_hash_ids, validator=_check_hash_ids
    )


def _check_name(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput("name", value, "a non-empty string")


def _to_requests(value: Iterable[TraceRequest]) -> tuple[TraceRequest, ...]:
    return value if isinstance(value, tuple) else tuple(value)


def _check_requests(_inst: object, _attr: object, value: tuple[TraceRequest, ...]) -> None:
    previous = 0.0
    for i, req in enumerate(value):
        if not isinstance(req, TraceRequest):
            raise InvalidInput(f"requests[{i}]", req, "a TraceRequest")
        if req.arrival_s < previous:
            raise InvalidInput(
                f"requests[{i}].arrival_s",
                req.arrival_s,
                f"requests sorted by arrival (>= the previous arrival {previous})",
            )
        previous = req.arrival_s


def percentile(sorted_values: list[int] | list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (``q`` in [0, 1]); 0.0 for an empty list."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    rank = max(1, math.ceil(q * n))
    return float(sorted_values[min(rank, n) - 1])


def _describe(values: list[int]) -> dict[str, float]:
    s = sorted(values)
    n = len(s)
    return {
        "mean": (sum(s) / n) if n else 0.0,
        "p50": percentile(s, 0.50),
        "p90": percentile(s, 0.90),
        "p99": percentile(s, 0.99),
        "max": float(s[-1]) if n else 0.0,
    }


@attrs.frozen(slots=True)
class Workload:
    """A named, arrival-sorted sequence of requests and where it came from.

    ``zero_outputs_clamped`` counts requests whose source said 0 generated tokens and that were
    read as 1 (see the module docstring). ``rows_skipped`` counts rows of the source that were
    not requests an engine ran (BurstGPT's failures, :func:`read_burstgpt_csv`).
    """

    name: str = attrs.field(validator=_check_name)
    requests: tuple[TraceRequest, ...] = attrs.field(
        converter=_to_requests, validator=_check_requests
    )
    source: str = ""
    zero_outputs_clamped: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    rows_skipped: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """Count, duration, rate and mean/p50/p90/p99/max of prompt and output lengths."""
        n = len(self.requests)
        duration = self.duration_s
        return {
            "name": self.name,
            "source": self.source,
            "count": n,
            "duration_s": duration,
            "rate_rps": (n / duration) if duration > 0 else 0.0,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "zero_outputs_clamped": self.zero_outputs_clamped,
            "rows_skipped": self.rows_skipped,
            "prompt_tokens": _describe([r.prompt_tokens for r in self.requests]),
            "output_tokens": _describe([r.output_tokens for r in self.requests]),
        }


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIMESTAMP_EXPECTED = "a timestamp 'YYYY-MM-DD HH:MM:SS[.fffffff][Z|+HH:MM|-HH:MM]'"


def _check_limit(limit: int | None) -> None:
    if limit is not None:
        check_int("limit", limit, minimum=1)


def _parse_count(text: str) -> int | None:
    """A non-negative ASCII decimal integer, or None."""
    t = text.strip()
    if not t or not t.isascii() or not t.isdigit():
        return None
    return int(t)


class _TimestampParser:
    """Parses ``YYYY-MM-DD HH:MM:SS.fffffff`` to seconds, caching the day offsets; a UTC offset
    after the seconds (``Z``, ``+HH:MM``, ``-HHMM``: the Azure 2024 release writes ``+00:00``)
    is taken away, so rows of different offsets keep their order in time."""

    __slots__ = ("_days", "_origin")

    def __init__(self) -> None:
        self._days: dict[str, float] = {}
        # Seconds are counted from midnight of the first day seen, so that sub-microsecond
        # fractions survive in a double (an absolute epoch would keep only ~10 us).
        self._origin: int | None = None

    def __call__(self, text: str) -> float | None:
        t = text.strip()
        # 'YYYY-MM-DD HH:MM:SS' is 19 characters; fractions are optional, any number of digits.
        if (
            len(t) < 19
            or t[4] != "-"
            or t[7] != "-"
            or t[10] not in " T"
            or t[13] != ":"
            or t[16] != ":"
        ):
            return None
        day = t[:10]
        base = self._days.get(day)
        if base is None:
            try:
                ordinal = _dt.date.fromisoformat(day).toordinal()
            except ValueError:
                return None
            if self._origin is None:
                self._origin = ordinal
            base = (ordinal - self._origin) * 86400.0
            self._days[day] = base
        hh, mm, ss = t[11:13], t[14:16], t[17:]
        if not (hh.isdigit() and mm.isdigit() and hh.isascii() and mm.isascii()):
            return None
        offset = 0
        if ss.endswith("Z"):  # UTC
            ss = ss[:-1]
        else:  # a UTC offset, as the 2024 release writes them ('...00.009930+00:00')
            sign = max(ss.find("+"), ss.find("-"))
            if sign >= 0:
                zone, ss = ss[sign + 1:].replace(":", ""), ss[:sign]
                if len(zone) not in (2, 4) or not zone.isascii() or not zone.isdigit():
                    return None
                zh, zm = int(zone[:2]), int(zone[2:] or 0)
                if zh > 23 or zm > 59:
                    return None
                offset = (zh * 3600 + zm * 60) * (1 if t[17 + sign] == "+" else -1)
        whole, dot, frac = ss.partition(".")
        if (
            len(whole) != 2
            or not whole.isascii()
            or not whole.isdigit()
            or (dot and (not frac or not frac.isascii() or not frac.isdigit()))
        ):
            return None
        h, m, s = int(hh), int(mm), int(whole)
        if h > 23 or m > 59 or s > 60:
            return None
        seconds = base + h * 3600 + m * 60 + s - offset
        if frac:
            seconds += int(frac) / 10 ** len(frac)
        return seconds


def _finish(
    name: str,
    path: Path,
    rows: list[tuple[float, int, int, tuple[int, ...]]],
    zero_outputs: int,
    last_line: int,
    skipped: int = 0,
) -> Workload:
    if not rows:
        raise TraceFormatError(path, last_line, "(file)", "at least one request row", "no rows")
    # Real traces are sorted; sort stably anyway so that a slightly shuffled file still replays
    # in arrival order. Arrivals are seconds after the earliest request.
    if any(rows[i][0] > rows[i + 1][0] for i in range(len(rows) - 1)):
        rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    requests = tuple(
        TraceRequest(arrival_s=t - t0, prompt_tokens=p, output_tokens=o, hash_ids=h)
        for t, p, o, h in rows
    )
    return Workload(
        name=name, requests=requests, source=str(path), zero_outputs_clamped=zero_outputs,
        rows_skipped=skipped,
    )


def _csv_columns(p: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """The rows of the CSV file ``p`` as (line number, the fields of ``columns`` in that
    order), found by the header's names (surrounding spaces and a BOM ignored); blank lines are
    skipped. A header without them, or a row too short to hold them, raises
    :class:`TraceFormatError` (the header is line 1)."""
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceFormatError(p, 1, "(header)", ",".join(columns), "an empty file") from None
        names = [h.strip().lstrip("\ufeff") for h in header]
        try:
            index = [names.index(c) for c in columns]
        except ValueError:
            raise TraceFormatError(
                p, 1, "(header)", "a header naming " + ",".join(columns), ",".join(header)
            ) from None
        width = max(index) + 1
        for row in reader:
            no = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) < width:
                missing = next(c for c, i in zip(columns, index, strict=True) if i >= len(row))
                raise TraceFormatError(
                    p, no, missing, f"{len(names)} comma-separated fields", ",".join(row)
                )
            yield no, [row[i] for i in index]


def read_azure_csv(path: str | Path, *, limit: int | None = None) -> Workload:
    """Read an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Arrivals are seconds after the first (earliest) row; timestamps are parsed by hand
    (``2023-11-16 18:15:46.6805900``, any number of fractional digits; the 2024 release's
    ``2024-05-10 00:00:00.009930+00:00``, with a UTC offset, as well). Extra columns are
    ignored and the three named ones may come in any order. ``limit`` keeps only the first
    ``limit`` rows. A malformed row raises :class:`TraceFormatError` naming the line (the
    header is line 1), the column and what was expected. ``ContextTokens`` must be >= 1;
    ``GeneratedTokens`` of 0 is read as 1 and counted (module docstring).
    """
    _check_limit(limit)
    p = Path(path)
    parse_ts = _TimestampParser()
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    zero_outputs = 0
    no = 1
    for no, (ts_text, ctx_text, gen_text) in _csv_columns(p, _AZURE_COLUMNS):
        ts = parse_ts(ts_text)
        if ts is None:
            raise TraceFormatError(p, no, "TIMESTAMP", _TIMESTAMP_EXPECTED, ts_text)
        ctx = _parse_count(ctx_text)
        if ctx is None or ctx < 1:
            raise TraceFormatError(
                p, no, "ContextTokens", "a positive integer (prompt tokens >= 1)", ctx_text
            )
        gen = _parse_count(gen_text)
        if gen is None:
            raise TraceFormatError(p, no, "GeneratedTokens", "a non-negative integer", gen_text)
        if gen == 0:
            gen = 1
            zero_outputs += 1
        rows.append((ts, ctx, gen, ()))
        if limit is not None and len(rows) >= limit:
            break
    return _finish(p.stem, p, rows, zero_outputs, no)


_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def read_burstgpt_csv(path: str | Path, *, limit: int | None = None) -> Workload:
    """Read a BurstGPT trace CSV (https://github.com/HPMLL/BurstGPT: ``Timestamp``, ``Model``,
    ``Request tokens``, ``Response tokens``, ``Total tokens``, ``Log Type``, and in later
    releases ``Session ID`` and ``Elapsed time``).

    ``Timestamp`` is seconds (a number) from the start of the trace's first day; arrivals are
    seconds after the earliest row. Columns are found by name (surrounding spaces ignored), in
    any order; the ones not named above are ignored. BurstGPT's files keep failed calls, whose
    ``Response tokens`` are 0: they are skipped (nothing was generated, and the request's true
    length is unknown), as is a row with 0 ``Request tokens``, and counted in
    :attr:`Workload.rows_skipped`. ``limit`` keeps only the first ``limit`` requests read. A
    malformed row raises :class:`TraceFormatError` naming the line, column and what was
    expected. There is no prefix data: combine with the scenario's system prompts for that.
    """
    _check_limit(limit)
    p = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    skipped = 0
    no = 1
    for no, (ts_text, req_text, resp_text) in _csv_columns(p, _BURSTGPT_COLUMNS):
        try:
            ts = float(ts_text.strip())
        except ValueError:
            ts = math.nan
        if not (math.isfinite(ts) and ts >= 0.0):
            raise TraceFormatError(p, no, "Timestamp", "a finite number of seconds >= 0", ts_text)
        req = _parse_count(req_text)
        if req is None:
            raise TraceFormatError(p, no, "Request tokens", "a non-negative integer", req_text)
        resp = _parse_count(resp_text)
        if resp is None:
            raise TraceFormatError(p, no, "Response tokens", "a non-negative integer", resp_text)
        if req == 0 or resp == 0:
            skipped += 1
            continue
        rows.append((ts, req, resp, ()))
        if limit is not None and len(rows) >= limit:
            break
    return _finish(p.stem, p, rows, 0, no, skipped)


def _json_count(
    p: Path, no: int, obj: dict[str, Any], key: str, minimum: int, *, required: bool = True
) -> int | None:
    if key not in obj:
        if not required:
            return None
        raise TraceFormatError(p, no, key, f"a field {key!r} (integer >= {minimum})", "missing")
    v = obj[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceFormatError(p, no, key, f"an integer >= {minimum}", v)
    return v


def read_mooncake_jsonl(path: str | Path, *, limit: int | None = None) -> Workload:
    """Read a Mooncake-style JSON-lines trace.

    Each non-blank line is an object with ``timestamp`` (milliseconds, number),
    ``input_length`` (>= 1), ``output_length`` (>= 0; 0 is read as 1 and counted) and optional
    ``hash_ids`` (a list of integers naming shared prefix blocks). Other fields are ignored.
    Arrivals are seconds after the earliest request. ``limit`` keeps the first ``limit`` rows.
    Errors name the line, the field and what was expected.
    """
    _check_limit(limit)
    p = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    zero_outputs = 0
    no = 0
    loads = json.loads
    with p.open(encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except ValueError as e:
                raise TraceFormatError(
                    p, no, "(json)", f"a JSON object ({e})", line.rstrip("\n")
                ) from None
            if not isinstance(obj, dict):
                raise TraceFormatError(p, no, "(json)", "a JSON object", line.rstrip("\n"))
            if "timestamp" not in obj:
                raise TraceFormatError(
                    p, no, "timestamp", "a field 'timestamp' (milliseconds)", "missing"
                )
            ts = obj["timestamp"]
            if (
                isinstance(ts, bool)
                or not isinstance(ts, int | float)
                or not math.isfinite(ts)
                or ts < 0
            ):
                raise TraceFormatError(p, no, "timestamp", "a finite number >= 0 (ms)", ts)
            inp = _json_count(p, no, obj, "input_length", 1)
            out = _json_count(p, no, obj, "output_length", 0)
            assert inp is not None and out is not None
            if out == 0:
                out = 1
                zero_outputs += 1
            hashes: tuple[int, ...] = ()
            raw = obj.get("hash_ids")
            if raw is not None:
                if not isinstance(raw, list) or any(
                    isinstance(h, bool) or not isinstance(h, int) for h in raw
                ):
                    raise TraceFormatError(p, no, "hash_ids", "a list of integers", raw)
                hashes = tuple(raw)
            rows.append((ts / 1000.0, inp, out, hashes))
            if limit is not None and len(rows) >= limit:
                break
    return _finish(p.stem, p, rows, zero_outputs, max(no, 1))


def read_trace(path: str | Path, *, limit: int | None = None) -> Workload:
    """Read a trace, choosing the reader by extension, else by the first non-blank line.

    ``.jsonl``/``.ndjson``/``.json`` → :func:`read_mooncake_jsonl`. Otherwise (``.csv``
    included) by the first non-blank line: a header naming ``Request tokens`` means BurstGPT
    (:func:`read_burstgpt_csv`), one naming ``TIMESTAMP`` means Azure (:func:`read_azure_csv`,
    also a ``.csv`` whose header names neither: it says what is missing), a line starting
    with ``{`` means JSON lines.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return read_mooncake_jsonl(p, limit=limit)
    with p.open(encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            head = line.strip().lstrip("\ufeff")
            if not head:
                continue
            if "Request tokens" in head:
                return read_burstgpt_csv(p, limit=limit)
            if "TIMESTAMP" in head or suffix == ".csv":
                return read_azure_csv(p, limit=limit)
            if head.startswith("{"):
                return read_mooncake_jsonl(p, limit=limit)
            raise TraceFormatError(
                p, no, "(format)",
                "an Azure or BurstGPT CSV header, or a JSON object per line", head,
            )
    if suffix == ".csv":
        return read_azure_csv(p, limit=limit)  # (which says what the empty file lacks)
    raise TraceFormatError(p, 1, "(file)", "at least one request row", "an empty file")


# --------------------------------------------------------------------------------------------
# The built-in synthetic workload
# --------------------------------------------------------------------------------------------

# Source: the Azure LLM inference trace 2023, conversation service (Patel et al., "Splitwise:
# Efficient generative LLM inference using phase splitting", ISCA 2024; data published in
# github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv, CC BY 4.0).
# Statistics computed from the full published file (19,366 requests, one hour,
# 2023-11-16 18:15–19:14; row count and first/last rows checked against the dataset's own
# analysis notebook, analysis/AzureLLMInferenceDataset2023.ipynb), nearest-rank percentiles.
# The copy read here is /work/shared/traces/azure-llm-2023-conv.csv (see its README).
AZURE_CONV_PROMPT_STATS: dict[str, float] = {
    "mean": 1154.7,
    "p10": 207,
    "p25": 396,
    "p50": 1020,
    "p75": 1189,
    "p90": 2735,
    "p99": 4142,
}
AZURE_CONV_OUTPUT_STATS: dict[str, float] = {
    "mean": 211.1,
    "p10": 54,
    "p25": 85,
    "p50": 129,
    "p75": 395,
    "p90": 424,
    "p99": 601,
}
AZURE_CONV_MAX_PROMPT_TOKENS = 14050  # the largest ContextTokens in the trace
AZURE_CONV_MAX_OUTPUT_TOKENS = 1000  # the largest GeneratedTokens (11 requests sit at this cap)
AZURE_CONV_RATE_RPS = 5.53  # 19,366 requests over 3,501.7 s
AZURE_CONV_ARRIVAL_CV = 1.09  # coefficient of variation of inter-arrival gaps: near-Poisson

# Fitted distributions: (weight, mu, sigma) of a mixture of lognormals, mu/sigma of ln(tokens).
# Both length distributions are multi-modal (outputs: a broad mode around 100 tokens plus a
# sharp one near 400; prompts: modes near 200, 400, 1100 and 4100), so a single lognormal
# misses the median and the tail. The parameters are maximum-likelihood fits by EM of a
# Gaussian mixture to ln(tokens) over all 19,366 rows (sigma floored at 0.02), components
# initialised at the visible modes, rounded to 3 decimals (weights re-normalised to sum to 1).
# Sampled (400k draws, rounded, clamped to the trace maxima) they give:
#   prompt  mean 1159, p10 236, p25 399, p50 991, p75 1228, p90 3011, p99 4301
#   output  mean 211,  p10 55,  p25 81,  p50 131, p75 385,  p90 435,  p99 576
# Prompt and output lengths are drawn independently: their log-lengths correlate at only
# r = 0.087 in the trace.
PROMPT_LOGNORMAL_MIXTURE: tuple[tuple[float, float, float], ...] = (
    (0.176, 5.308, 0.954),
    (0.238, 5.990, 0.065),
    (0.406, 6.996, 0.128),
    (0.104, 7.705, 0.412),
    (0.076, 8.315, 0.032),
)
OUTPUT_LOGNORMAL_MIXTURE: tuple[tuple[float, float, float], ...] = (
    (0.152, 4.593, 1.167),
    (0.543, 4.577, 0.443),
    (0.305, 6.020, 0.094),
)

# Default size and rate. 3,000 requests at 12 req/s span about 250 s (~4 min) of virtual time.
# 12 req/s is 2.2x the trace's own rate: with the trace's mean lengths (1,155 prompt + 211
# output tokens) and a decode step of ~30-50 ms, that keeps on the order of 100k tokens of
# KV live, i.e. it loads a single-GPU KV cache (e.g. a 7-8B model on an 80 GB card) close
# to its capacity, where reservation policies differ. Use `rate_rps` to move the load point.
DEFAULT_N_REQUESTS = 3000
DEFAULT_RATE_RPS = 12.0


class _Mixture:
    __slots__ = ("_cum", "_params")

    def __init__(self, components: tuple[tuple[float, float, float], ...]) -> None:
        total = sum(w for w, _, _ in components)
        acc = 0.0
        cum: list[float] = []
        for w, _, _ in components:
            acc += w / total
            cum.append(acc)
        cum[-1] = 1.0
        self._cum = cum
        self._params = [(mu, sigma) for _, mu, sigma in components]

    def sample(self, rng: random.Random, lo: int, hi: int) -> int:
        mu, sigma = self._params[bisect.bisect_right(self._cum, rng.random())]
        v = round(math.exp(rng.gauss(mu, sigma)))
        return lo if v < lo else hi if v > hi else v


def _check_mixture(field: str, components: tuple[tuple[float, float, float], ...]) -> None:
    if not components:
        raise InvalidInput(field, components, "at least one (weight, mu, sigma) component")
    for c in components:
        if len(c) != 3:
            raise InvalidInput(field, c, "(weight, mu, sigma) triples")
        check_float(f"{field}.weight", c[0], minimum=0.0, open_min=True)
        check_float(f"{field}.mu", c[1], minimum=-math.inf)
        check_float(f"{field}.sigma", c[2], minimum=0.0)


def synthetic_workload(
    *,
    seed: int = 0,
    n_requests: int = DEFAULT_N_REQUESTS,
    rate_rps: float = DEFAULT_RATE_RPS,
    arrival_cv: float = 1.0,
    prompt_mixture: tuple[tuple[float, float, float], ...] = PROMPT_LOGNORMAL_MIXTURE,
    output_mixture: tuple[tuple[float, float, float], ...] = OUTPUT_LOGNORMAL_MIXTURE,
    max_prompt_tokens: int = AZURE_CONV_MAX_PROMPT_TOKENS,
    max_output_tokens: int = AZURE_CONV_MAX_OUTPUT_TOKENS,
    name: str = "synthetic-azure-conv",
) -> Workload:
    """The built-in default workload: seeded, needing no files.

    Prompt and output lengths are drawn from lognormal mixtures fitted to the Azure LLM
    inference trace 2023, conversation service (Splitwise, ISCA 2024; AzurePublicDataset
    ``AzureLLMInferenceTrace_conv.csv``, CC BY 4.0). Targets (trace, nearest-rank):
    prompt mean 1155 / p50 1020 / p90 2735 / p99 4142 tokens; output mean 211 / p50 129 /
    p90 424 / p99 601 tokens. See :data:`PROMPT_LOGNORMAL_MIXTURE` and
    :data:`OUTPUT_LOGNORMAL_MIXTURE` for the fitted parameters and how they were derived.
    Samples are rounded and clamped to ``[1, max_prompt_tokens]`` / ``[1, max_output_tokens]``
    (the trace's own maxima by default).

    Arrivals: the first at 0 s, then gamma-distributed gaps with mean ``1 / rate_rps`` and
    coefficient of variation ``arrival_cv`` (1.0: Poisson; the trace measures 1.09; > 1 is
    burstier). Defaults: 3,000 requests at 12 req/s, about 250 s of virtual time.
    Deterministic for a given set of arguments.
    """
    check_int("seed", seed, minimum=-(2**63))
    check_int("n_requests", n_requests, minimum=1)
    check_float("rate_rps", rate_rps, minimum=0.0, open_min=True)
    check_float("arrival_cv", arrival_cv, minimum=0.0, open_min=True)
    check_int("max_prompt_tokens", max_prompt_tokens, minimum=1)
    check_int("max_output_tokens", max_output_tokens, minimum=1)
    _check_mixture("prompt_mixture", prompt_mixture)
    _check_mixture("output_mixture", output_mixture)

    # Separate streams so that changing the rate does not change the lengths and vice versa.
    rng_arrival = random.Random(f"kvbudget.synthetic.arrival:{seed}")
    rng_prompt = random.Random(f"kvbudget.synthetic.prompt:{seed}")
    rng_output = random.Random(f"kvbudget.synthetic.output:{seed}")
    prompts = _Mixture(prompt_mixture)
    outputs = _Mixture(output_mixture)

    shape = 1.0 / (arrival_cv * arrival_cv)
    scale = 1.0 / (rate_rps * shape)
    poisson = arrival_cv == 1.0
    t = 0.0
    requests: list[TraceRequest] = []
    for i in range(n_requests):
        if i:
            gap = (
                rng_arrival.expovariate(rate_rps)
                if poisson
                else rng_arrival.gammavariate(shape, scale)
            )
            t += gap
        requests.append(
            TraceRequest(
                arrival_s=t,
                prompt_tokens=prompts.sample(rng_prompt, 1, max_prompt_tokens),
                output_tokens=outputs.sample(rng_output, 1, max_output_tokens),
            )
        )
    source = (
        f"synthetic(seed={seed}, n_requests={n_requests}, rate_rps={rate_rps}, "
        f"arrival_cv={arrival_cv}); lengths fitted to the Azure LLM inference trace 2023 "
        "(conversation)"
    )
    return Workload(name=name, requests=tuple(requests), source=source)
