"""Cost of the core's hot paths with 1,000 active grants.

* ``charge``: ``Scheduler.charge`` of one generated token on a running request far from its
  boundary (the per-token path);
* ``admit``: an ``arrive`` that is admitted at once: batch work with no prefix blocks, and
  (figures of their own) an interactive caller (a first-token objective, a latency floor, a
  protected class) and batch work sharing four prefix blocks with the callers beside it;
* ``extend``: a ``charge`` that crosses the ask-ahead point and triggers an ``Extend``.

Each figure is the median over many batches of the per-operation time (``perf_counter_ns``).
Targets: charge <= 1 us, admit and extend <= 20 us each at 1,000 active grants.
The last line printed is one JSON object with the medians.

Run: ``python benchmarks/core_hot_path.py`` (``--quick`` for fewer repetitions).

Side by side with another tree: ``python benchmarks/core_hot_path.py --against DIR [--rounds N]``
runs this benchmark ``N`` times (default 8) on this checkout's ``src`` and on ``DIR`` (another
checkout's ``src``, e.g. a ``git worktree`` of the commit before), alternated, each in its own
process, and prints for each figure both medians with their ranges, the median and range of the
per-round ratios (this / baseline) and the ratio of the two best runs. On this 2-core machine one
run of the same tree varies by up to 1.5x from the next, so only such paired figures compare two
trees. Its last line is one JSON object with every run's figures.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvbudget.core import events as ev
from kvbudget.core.lengths import LengthModel
from kvbudget.core.model import CalibrationKey, Capacity, RequestSpec
from kvbudget.core.policy import CalibratedPolicy
from kvbudget.core.scheduler import Scheduler

ACTIVE = 1000
BLOCK = 16


def warm_lengths() -> LengthModel:
    """A length model that has seen traffic (calibrated answers, not the prior)."""
    rng = random.Random(0)
    lengths = LengthModel()
    for cls in ("interactive", "batch"):
        key = CalibrationKey(service_class=cls, task="chat")
        for _ in range(2000):
            lengths.observe(key, max(1, int(rng.lognormvariate(5.0, 0.8))))
    return lengths


def build(extra_blocks: int = 0) -> Scheduler:
    """A scheduler with ACTIVE running batch grants and room for more admissions."""
    s = Scheduler(
        Capacity(ACTIVE * 40 + extra_blocks, BLOCK),
        policy=CalibratedPolicy(),
        lengths=warm_lengths(),
    )
    spec = RequestSpec(64, 4096, 8192, service_class="batch", task="chat")
    for i in range(ACTIVE):
        actions = s.arrive(f"a{i}", spec, 0.0)
        assert any(isinstance(a, ev.Admit) for a in actions), "setup could not admit"
        s.charge(f"a{i}", 1, 0.0)
    assert s.active == ACTIVE
    return s


def bench_charge(repeats: int) -> float:
    """ns per charge of one token on a running request far from its boundary."""
    s = build()
    ids = [f"a{i}" for i in range(ACTIVE)]
    per_op: list[float] = []
    now = 0.0
    batch = 200
    for _ in range(repeats):
        # keep every request far from its boundary: reset the generated count (bench only)
        for rid in ids[:batch]:
            r = s.requests[rid]
            if r.ask_at - r.generated < 8:
                r.generated = 1
        rids = ids[:batch]
        charge = s.charge
        t0 = time.perf_counter_ns()
        for rid in rids:
            charge(rid, 1, now)
        t1 = time.perf_counter_ns()
        per_op.append((t1 - t0) / batch)
        ids = ids[batch:] + ids[:batch]
    return statistics.median(per_op)


BATCH_SPEC = RequestSpec(64, 4096, 8192, service_class="batch", task="chat")
#: an interactive caller: the front's first-token forecasts, the latency floor, protected headroom
INTERACTIVE_SPEC = RequestSpec(64, 512, 8192, service_class="interactive", task="chat")
#: batch work whose prompt's four full blocks every caller of its batch shares (charged once)
PREFIX_SPEC = RequestSpec(
    64, 4096, 8192, service_class="batch", task="chat", prefix_blocks=(1, 2, 3, 4)
)


def bench_admit(repeats: int, batch: int = 50, spec: RequestSpec = BATCH_SPEC) -> float:
    """us per admitted arrival of ``spec``, with ACTIVE (to ACTIVE + batch) grants live.

    Admissions come in batches of ``batch``; between batches the admitted requests finish and
    are confirmed (untimed), so the length model changes and its cached quantiles are
    recomputed by the next admission. ``batch=1``: a finish between every two admissions.
    """
    s = build(extra_blocks=(batch + 1) * 64)
    per_op: list[float] = []
    k = 0
    while len(per_op) < repeats:
        rids = [f"n{k + j}" for j in range(batch)]
        k += batch
        for rid in rids:
            t0 = time.perf_counter_ns()
            actions = s.arrive(rid, spec, 0.0)
            t1 = time.perf_counter_ns()
            assert actions and isinstance(actions[0], ev.Admit), actions
            per_op.append((t1 - t0) / 1000)
        for rid in rids:
            s.finish(rid, "stop", 0.0)
            s.confirm_release(rid, 0.0)
    return statistics.median(per_op)


def bench_extend(repeats: int) -> float:
    """us per charge that crosses the ask-ahead point and gets an Extend."""
    s = build(extra_blocks=repeats * 64)
    ids = [f"a{i}" for i in range(ACTIVE)]
    per_op: list[float] = []
    k = 0
    while len(per_op) < repeats:
        rid = ids[k % ACTIVE]
        k += 1
        r = s.requests[rid]
        if r.boundary >= r.hard_max - 1 or r.ask_at > r.hard_max:
            continue
        step = r.ask_at - r.generated
        if step < 1:
            continue
        if step > 1:
            s.charge(rid, step - 1, 0.0)  # just before the ask-ahead point
        t0 = time.perf_counter_ns()
        actions = s.charge(rid, 1, 0.0)
        t1 = time.perf_counter_ns()
        if not any(isinstance(a, ev.Extend) for a in actions):
            continue
        per_op.append((t1 - t0) / 1000)
    return statistics.median(per_op)


FIGURES = (
    "charge_ns_median",
    "admit_us_median_at_1000",
    "extend_us_median_at_1000",
    "admit_us_median_at_1000_finish_between",
    "admit_interactive_us_median_at_1000",
    "admit_prefix_us_median_at_1000",
)


def one_run(src: Path, quick: bool) -> dict[str, float]:
    """This benchmark's figures on the ``kvbudget`` under ``src``, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def side_by_side(against: Path, rounds: int, quick: bool) -> None:
    """``rounds`` runs of this checkout's src and of ``against``, alternated (module docstring)."""
    here = Path(__file__).resolve().parent.parent / "src"
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for _ in range(rounds):
        runs["baseline"].append(one_run(against, quick))
        runs["this"].append(one_run(here, quick))
    print(f"{rounds} rounds, this checkout ({here}) against {against}, alternated")
    for key in FIGURES:
        if any(key not in r for r in runs["baseline"]):
            print(f"{key}: not measured by the baseline's tree")
            continue
        base = [r[key] for r in runs["baseline"]]
        this = [r[key] for r in runs["this"]]
        ratios = sorted(t / b for t, b in zip(this, base, strict=True))
        print(
            f"{key}: baseline {statistics.median(base):.2f} [{min(base):.2f}-{max(base):.2f}], "
            f"this {statistics.median(this):.2f} [{min(this):.2f}-{max(this):.2f}], "
            f"this/baseline per round {statistics.median(ratios):.3f} "
            f"[{ratios[0]:.3f}-{ratios[-1]:.3f}], best against best {min(this) / min(base):.3f}"
        )
    print(json.dumps({"against": str(against), "rounds": runs}))


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    if "--against" in argv:
        at = argv.index("--against")
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 8
        side_by_side(Path(argv[at + 1]).resolve(), rounds, quick)
        return
    gc.collect()
    charge_ns = bench_charge(300 if quick else 3000)
    admit_us = bench_admit(300 if quick else 2000)
    admit_each_us = bench_admit(300 if quick else 2000, batch=1)
    admit_interactive_us = bench_admit(300 if quick else 2000, spec=INTERACTIVE_SPEC)
    admit_prefix_us = bench_admit(300 if quick else 2000, spec=PREFIX_SPEC)
    extend_us = bench_extend(300 if quick else 2000)
    print(f"charge: {charge_ns:.0f} ns/op (target <= 1000)")
    print(f"admit at {ACTIVE} active: {admit_us:.2f} us/op (target <= 20)")
    print(f"extend at {ACTIVE} active: {extend_us:.2f} us/op (target <= 20)")
    print(f"admit at {ACTIVE} active, a finish before every admission: {admit_each_us:.2f} us/op")
    print(f"admit at {ACTIVE} active, an interactive caller: {admit_interactive_us:.2f} us/op")
    print(f"admit at {ACTIVE} active, four shared prefix blocks: {admit_prefix_us:.2f} us/op")
    print(
        json.dumps(
            {
                "charge_ns_median": round(charge_ns, 1),
                "admit_us_median_at_1000": round(admit_us, 2),
                "extend_us_median_at_1000": round(extend_us, 2),
                "admit_us_median_at_1000_finish_between": round(admit_each_us, 2),
                "admit_interactive_us_median_at_1000": round(admit_interactive_us, 2),
                "admit_prefix_us_median_at_1000": round(admit_prefix_us, 2),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
