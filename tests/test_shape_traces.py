"""benchmarks/shape_traces.py: the thirty-first session's held-out trace shapes are written the
same every time (the documented figures can be re-run), read as traces, and have the shapes
their names claim."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np

from _bench_loader import load_benchmark
from kvbudget.sim.workload import read_azure_csv

shp = load_benchmark("shape_traces")


def _digests(directory: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


#: every shape's bytes, in order, as the thirty-first session wrote and measured them
#: (docs/benchmarks-history.md, "More trace shapes"): a change here means those figures are of
#: other traces
DOCUMENTED = "f9c490d2dace702beb3498b46cdbc5d02d7df92da4c6799a687af963d335d545"


def test_the_shapes_are_written_the_same_every_time(tmp_path: pathlib.Path) -> None:
    first = shp.write(tmp_path / "a")
    shp.write(tmp_path / "b")
    assert [p.stem for p in first] == list(shp.SHAPES) and len(shp.SHAPES) == 11
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    whole = hashlib.sha256()
    for path in first:
        whole.update(path.read_bytes())
    assert whole.hexdigest() == DOCUMENTED


def test_each_shape_reads_as_a_trace_with_the_shape_it_is_named_for(
    tmp_path: pathlib.Path,
) -> None:
    shp.write(tmp_path)
    lengths = {}
    for name in shp.SHAPES:
        workload = read_azure_csv(tmp_path / f"{name}.csv")
        assert len(workload.requests) == shp.N
        prompt = np.array([r.prompt_tokens for r in workload.requests])
        out = np.array([r.output_tokens for r in workload.requests])
        arrival = np.array([r.arrival_s for r in workload.requests])
        assert prompt.min() >= 1 and out.min() >= 1 and np.all(np.diff(arrival) >= 0)
        lengths[name] = (prompt, out, arrival)
    _, out, _ = lengths["longall"]
    assert out.min() >= 700 and out.max() < 1000
    prompt, _, _ = lengths["rag"]
    assert prompt.min() >= 2500
    _, out, _ = lengths["pareto"]
    assert np.percentile(out, 99) > 10 * np.median(out)  # a heavy tail
    _, out, _ = lengths["bimodal-l0"]
    assert 0.2 < np.mean(out >= 1200) < 0.3 and np.all((out < 24) | (out >= 1200))
    _, _, arrival = lengths["onoff"]
    phase = arrival % 60
    assert np.mean(phase < 20) > 0.8  # most arrivals in the 20 s "on" part of each minute
    _, _, arrival = lengths["mice"]
    assert 25 < shp.N / arrival[-1] < 35
