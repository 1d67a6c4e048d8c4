"""Write the eleven trace shapes the thirty-first session held the policies out on.

Each is 3,000 requests in the Azure CSV format (``TIMESTAMP,ContextTokens,GeneratedTokens``),
seeded, written for that check and tuned on by no session before it (docs/benchmarks-history.md,
"More trace shapes"): ``pareto`` (5 req/s, prompts lognormal around 600, answers 20 x (1 +
Pareto(1.3)) up to 2,000: a heavy tail), ``rag`` (2 req/s, prompts 2,500-6,000, answers lognormal
around 120), ``onoff`` (20 s at 12 req/s, then 40 s at 0.5 req/s), ``longall`` (2 req/s, short
prompts, every answer 700-1,000 tokens), ``mice`` (30 req/s, prompts 30-120, answers 5-40);
``bimodal0``-``bimodal3`` (30-70 % of answers around 700 tokens, the rest around 25, 3-6 req/s) and
``bimodal-l0``, ``bimodal-l1`` (the thirtieth session's bimodal shape on other seeds: 75 % of
answers 1-23 tokens, 25 % 1,200-3,000, 3 req/s).

    python benchmarks/shape_traces.py OUT_DIR
    python benchmarks/held_out_cells.py --shapes OUT_DIR --cell shape- --policy calibrated ...

``held_out_cells.py --shapes DIR`` writes them there when absent and adds their 66 cells,
``shape-NAME/PROFILE/LOAD`` (each trace on the tiny CPU engine's profile at 0.6x, 1x, 2x and
4x and on the A100 model at 1x and 4x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_traces import write_azure_csv

N = 3000
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # arrival s, prompt tokens, answer tokens


def _first_five(rng: np.random.Generator) -> dict[str, Arrays]:
    """pareto, rag, onoff, longall, mice: drawn in that order from one generator."""
    shapes: dict[str, Arrays] = {}
    ts = np.cumsum(rng.exponential(1 / 5, N))
    shapes["pareto"] = (ts, np.clip(rng.lognormal(np.log(600), 0.7, N), 10, 6000),
                        np.clip(20 * (1 + rng.pareto(1.3, N)), 1, 2000))
    ts = np.cumsum(rng.exponential(1 / 2, N))
    shapes["rag"] = (ts, rng.integers(2500, 6000, N),
                     np.clip(rng.lognormal(np.log(120), 0.6, N), 1, 800))
    t, arrivals = 0.0, []
    while len(arrivals) < N:
        on = (t % 60) < 20
        t += rng.exponential(1 / (12 if on else 0.5))
        arrivals.append(t)
    shapes["onoff"] = (np.array(arrivals), np.clip(rng.lognormal(np.log(800), 0.8, N), 10, 6000),
                       np.clip(rng.lognormal(np.log(200), 0.9, N), 1, 2000))
    ts = np.cumsum(rng.exponential(1 / 2, N))
    shapes["longall"] = (ts, np.clip(rng.normal(200, 50, N), 20, 600), rng.integers(700, 1000, N))
    ts = np.cumsum(rng.exponential(1 / 30, N))
    shapes["mice"] = (ts, rng.integers(30, 120, N), rng.integers(5, 40, N))
    return shapes


def _bimodal(k: int, long_share: float, rate: float) -> Arrays:
    rng = np.random.default_rng(300 + k)
    ts = np.cumsum(rng.exponential(1 / rate, N))
    longs = rng.random(N) < long_share
    out = np.where(longs, rng.normal(700, 120, N), rng.lognormal(np.log(25), 0.5, N))
    prompt = np.clip(rng.lognormal(np.log(900), 0.8, N), 20, 7000)
    return ts, prompt, np.clip(out, 1, 1500)


def _bimodal_long_tail(k: int) -> Arrays:
    rng = np.random.default_rng(310 + k)
    ts = np.cumsum(rng.exponential(1 / 3, N))
    longs = rng.random(N) < 0.25
    out = np.where(longs, rng.integers(1200, 3000, N), rng.integers(1, 24, N))
    prompt = np.clip(rng.lognormal(np.log(500), 0.7, N), 10, 5000)
    return ts, prompt, out


def draw_shapes() -> dict[str, Arrays]:
    """Every shape's arrays, by name, in :data:`SHAPES`' order (each seeded: the same every
    time)."""
    out = _first_five(np.random.default_rng(31))
    for k, (share, rate) in enumerate(((0.5, 4.0), (0.3, 5.0), (0.7, 3.0), (0.5, 6.0))):
        out[f"bimodal{k}"] = _bimodal(k, share, rate)
    for k in range(2):
        out[f"bimodal-l{k}"] = _bimodal_long_tail(k)
    return out


#: the shapes' names, in the order written
SHAPES = (
    "pareto", "rag", "onoff", "longall", "mice", "bimodal0", "bimodal1", "bimodal2", "bimodal3",
    "bimodal-l0", "bimodal-l1",
)


def write(out_dir: Path) -> list[Path]:
    """Write every shape to ``out_dir/NAME.csv``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, arrays in draw_shapes().items():
        path = out_dir / f"{name}.csv"
        write_azure_csv(path, *arrays)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    paths = write(ap.parse_args(argv).out_dir)
    print(f"wrote {', '.join(p.name for p in paths)}")


if __name__ == "__main__":
    main()
