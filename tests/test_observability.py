"""Observability: Prometheus exporter, event catalogue, snapshot JSON, `kvbudget inspect`."""

from __future__ import annotations

import http.server
import json
import re
import sys
import threading
from typing import Any

import anyio
import pytest
import structlog

import kvbudget
from _kvb_helpers import quiet_structlog  # noqa: F401 (autouse fixture)
from kvbudget import Capacity, RequestSpec, Scheduler
from kvbudget.core.events import Admit
from kvbudget.engines.sim import SimEngine
from kvbudget.observability import (
    COUNTERS,
    EVENTS,
    GAUGES,
    PrometheusExporter,
    configure_events,
    emit,
    format_snapshot,
    log_drift,
    metric_names,
    snapshot_to_dict,
)

prometheus_client = pytest.importorskip("prometheus_client")


def _samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in registry.collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _text(registry: Any) -> str:
    return str(prometheus_client.generate_latest(registry).decode())


def _spec(tenant: str = "default", cls: str = "interactive", **kw: Any) -> RequestSpec:
    return RequestSpec(
        prompt_tokens=20, max_tokens=100, model_max_len=4096, service_class=cls, tenant=tenant,
        **kw,
    )


def test_scheduler_scrape_has_every_name_and_the_right_values() -> None:
    sched = Scheduler(Capacity(blocks=64, block_size=16))
    registry = prometheus_client.CollectorRegistry()
    PrometheusExporter(sched.snapshot, registry=registry)  # a snapshot function works too
    t = 0.0
    for i in range(3):
        rid = f"r{i}"
        sched.arrive(rid, _spec("acme" if i < 2 else "zeta"), t)
        sched.charge(rid, 10 + i, t + 0.1)
        sched.finish(rid, "stop", t + 0.2)
    # r0, r1 confirmed; r2 still awaiting its confirmation (its blocks stay reserved)
    sched.confirm_release("r0", 1.0)
    sched.confirm_release("r1", 1.0)
    snap = sched.snapshot()
    text = _text(registry)
    for name in metric_names():
        if not name.startswith("kvbudget_shell_"):  # only for a Budget source
            assert f"# TYPE {name} " in text, name
    got = _samples(registry)
    for name, (attr, _help) in GAUGES.items():
        assert got[("kvbudget_" + name, ())] == getattr(snap, attr), name
    assert got[("kvbudget_releasing_requests", ())] == 1
    assert got[("kvbudget_reserved_blocks", ())] == snap.reserved_blocks > 0
    acme = (("class", "interactive"), ("tenant", "acme"))
    zeta = (("class", "interactive"), ("tenant", "zeta"))
    assert got[("kvbudget_completed_total", acme)] == 2
    assert got[("kvbudget_completed_total", zeta)] == 0  # counted once confirmed
    assert got[("kvbudget_tokens_total", acme)] == 10 + 11
    assert got[("kvbudget_tokens_total", zeta)] == 12
    assert got[("kvbudget_rejected_total", acme)] == 0
    assert got[("kvbudget_info", (("policy", "calibrated"),))] == 1
    # the underestimation gauges carry the overall figures and the per-dimension ones
    assert ("kvbudget_underestimation_rate", (("dimension", "all"), ("value", "all"))) in got
    assert got[("kvbudget_underestimation_samples", (("dimension", "all"), ("value", "all")))] == 3
    sched.confirm_release("r2", 2.0)  # read at scrape time: the next scrape sees it
    got = _samples(registry)
    assert got[("kvbudget_completed_total", zeta)] == 1
    assert got[("kvbudget_reserved_blocks", ())] == 0
    assert got[("kvbudget_releasing_requests", ())] == 0


def test_turned_away_callers_are_scraped_by_what_held_them() -> None:
    sched = Scheduler(Capacity(blocks=8, block_size=16))
    registry = prometheus_client.CollectorRegistry()
    PrometheusExporter(sched.snapshot, registry=registry)
    hog = RequestSpec(prompt_tokens=100, max_tokens=20, model_max_len=4096)
    assert isinstance(sched.arrive("hog", hog, 0.0)[0], Admit)  # 8 blocks: the whole cache
    assert sched.arrive("late", _spec(), 0.0) == []
    assert sched.arrive("later", _spec(), 0.0) == []  # behind "late", never its queue's head
    got = _samples(registry)
    assert got[("kvbudget_turned_away_behind_total", ())] == 0
    sched.tick(5.0)  # past the interactive class's 2 s queue bound
    got = _samples(registry)
    assert got[("kvbudget_turned_away_held_by_total", (("cause", "no-room"),))] == 2
    assert got[("kvbudget_turned_away_behind_total", ())] == 1
    assert got[("kvbudget_rejections_by_reason_total", (("reason", "queue-timeout"),))] == 2


async def _drive_budget(registry: Any) -> kvbudget.Budget:
    engine = SimEngine(capacity=Capacity(blocks=24, block_size=16), lengths=lambda rid: 30)
    budget = kvbudget.Budget(engine.capacity)
    PrometheusExporter(budget, registry=registry)
    async with budget:
        outcomes: list[str] = []

        async def one(i: int) -> None:
            spec = _spec(tenant=f"t{i % 2}", deadline=0.05)
            try:
                async for _step in budget.generate(engine, spec):
                    pass
                outcomes.append("ok")
            except kvbudget.Overloaded:
                outcomes.append("rejected")

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
        # a caller that goes away mid-stream: cancelled, blocks back after confirmation
        with anyio.move_on_after(0.005):
            async for _step in budget.generate(engine, _spec(tenant="gone")):
                pass
        with anyio.fail_after(5):
            while budget.snapshot().releasing:
                await anyio.sleep(0.01)
        assert "ok" in outcomes
    return budget


def test_budget_scrape_after_sim_engine_load() -> None:
    registry = prometheus_client.CollectorRegistry()
    budget = anyio.run(_drive_budget, registry, backend="asyncio")
    snap = budget.snapshot()
    got = _samples(registry)
    totals: dict[str, float] = {}
    for (name, _labels), value in got.items():
        totals[name] = totals.get(name, 0.0) + value
    assert totals["kvbudget_completed_total"] == snap.completed > 0
    assert totals["kvbudget_rejected_total"] == snap.rejected > 0  # the flood was refused
    assert totals["kvbudget_cancelled_total"] == snap.cancelled == 1
    assert totals["kvbudget_tokens_total"] == snap.totals.tokens
    assert totals["kvbudget_wasted_decoded_tokens_total"] == snap.wasted_tokens
    assert got[("kvbudget_reserved_blocks", ())] == 0  # everything confirmed
    assert got[("kvbudget_capacity_blocks", ())] == 24
    gone = (("class", "interactive"), ("tenant", "gone"))
    assert got[("kvbudget_cancelled_total", gone)] == 1
    # the Budget's own counters are exported too
    assert ("kvbudget_shell_confirm_timeouts_total", ()) in got
    for name in COUNTERS:
        assert f"# TYPE kvbudget_{name}_total counter" in _text(registry)


def test_exporter_reads_at_scrape_time_and_unregisters() -> None:
    sched = Scheduler(Capacity(blocks=64, block_size=16))
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusExporter(sched, registry=registry, namespace_labels={"engine": "a"})
    assert _samples(registry)[("kvbudget_active_requests", (("engine", "a"),))] == 0
    sched.arrive("x", _spec(), 0.0)
    assert _samples(registry)[("kvbudget_active_requests", (("engine", "a"),))] == 1
    body, ctype = exporter.render()
    assert b"kvbudget_active_requests" in body and ctype.startswith("text/plain")
    exporter.unregister()
    assert "kvbudget_" not in _text(registry)
    with pytest.raises(TypeError):
        PrometheusExporter(42, registry=registry)


def test_missing_prometheus_client_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"kvbudget\[prometheus\]"):
        PrometheusExporter(lambda: None)


def test_budget_logs_the_catalogued_events() -> None:
    """Every event the budget logs for these requests is in the catalogue, with its fields."""
    engine = SimEngine(capacity=Capacity(blocks=64, block_size=16), lengths=lambda rid: 40)

    async def main() -> None:
        async with kvbudget.Budget(engine.capacity) as budget:
            async for _step in budget.generate(engine, _spec(tenant="acme")):
                pass

    structlog.reset_defaults()  # every level (the autouse fixture filters below WARNING)
    with structlog.testing.capture_logs() as logs:
        anyio.run(main, backend="asyncio")
    names = {e["event"] for e in logs}
    assert {"admission", "finished", "confirmation"} <= names
    for e in logs:
        if e["event"] in EVENTS and EVENTS[e["event"]].per_request:
            spec = EVENTS[e["event"]]
            assert e["request_id"] and e["service_class"] == "interactive"
            assert e["tenant"] == "acme"
            assert set(spec.fields) <= set(e), (e, spec.fields)


def test_emit_and_drift_helpers() -> None:
    structlog.reset_defaults()  # every level (the autouse fixture filters below WARNING)
    with structlog.testing.capture_logs() as logs:
        emit("abort", request_id="r", service_class="batch", tenant="t", reason="cancelled")
        log_drift(3, engine_used_blocks=10, ledger_used_blocks=7)
        log_drift(0, engine_used_blocks=7, ledger_used_blocks=7)  # no drift: nothing logged
    assert logs[0] == {
        "event": "abort", "log_level": "info", "request_id": "r", "service_class": "batch",
        "tenant": "t", "reason": "cancelled",
    }
    assert logs[1]["event"] == "drift" and logs[1]["drift_blocks"] == 3
    assert len(logs) == 2
    with pytest.raises(kvbudget.errors.UnknownName):
        emit("nonsense", request_id="r", service_class="c", tenant="t")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EVENT_NAME = re.compile(r"\[\w+\s*\] (\S+)")
_MICROSECOND_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} ", re.MULTILINE)


@pytest.mark.parametrize("level", ["debug", "warning"])
def test_configure_events_filters_by_level_and_stamps_to_the_microsecond(
    level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The servers' ``--events`` / ``--kvbudget-events``: kvbudget's events from that level up,
    each line stamped to the microsecond (a round of preemptions falls within one second)."""
    engine = SimEngine(capacity=Capacity(blocks=64, block_size=16), lengths=lambda rid: 8)

    async def main() -> None:
        async with kvbudget.Budget(engine.capacity) as budget:
            async for _step in budget.generate(engine, _spec()):
                pass
        log_drift(3, engine_used_blocks=10, ledger_used_blocks=7)  # a warning

    capsys.readouterr()
    configure_events(level)
    anyio.run(main, backend="asyncio")
    out = capsys.readouterr().out
    assert not _ANSI.search(out)  # (not a terminal: no colours, as structlog's defaults)
    lines = [line for line in out.splitlines() if line]
    events = [m.group(1) for m in map(_EVENT_NAME.search, lines) if m is not None]
    assert "drift" in events
    assert ("admission" in events and "confirmation" in events) is (level == "debug")
    assert len(_MICROSECOND_STAMP.findall("\n".join(lines))) == len(lines) > 0


@pytest.mark.parametrize("level", ["verbose", "", 5, True, None, 2.5])
def test_configure_events_refuses_an_unknown_level(level: Any) -> None:
    before = structlog.get_config()
    with pytest.raises(kvbudget.errors.InvalidInput, match="events"):
        configure_events(level)
    after = structlog.get_config()  # a refused level leaves the configuration alone
    assert after["processors"] is before["processors"]
    assert after["wrapper_class"] is before["wrapper_class"]


# -- kvbudget inspect ------------------------------------------------------------------------


def test_inspect_prints_a_table_from_a_local_server(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbudget.cli import main

    sched = Scheduler(Capacity(blocks=32, block_size=16))
    sched.arrive("a", _spec(tenant="acme"), 0.0)
    payload = json.dumps(snapshot_to_dict(sched.snapshot())).encode()
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            if self.path != "/kvbudget/snapshot":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["inspect", url + "/"]) == 0
        out = capsys.readouterr().out
        assert seen == ["/kvbudget/snapshot"]
        assert "capacity_blocks" in out and "32" in out
        assert "reserved_blocks" in out
        assert "acme" in out and "interactive" in out
        assert main(["inspect", "--json", url]) == 0
        assert json.loads(capsys.readouterr().out)["capacity_blocks"] == 32
    finally:
        server.shutdown()
        server.server_close()
    # a server that is not there: a clear message and exit status 1
    assert main(["inspect", url, "--timeout", "1"]) == 1
    assert "cannot read a snapshot" in capsys.readouterr().err


def test_format_snapshot_handles_an_empty_budget() -> None:
    sched = Scheduler(Capacity(blocks=4, block_size=16))
    text = format_snapshot(snapshot_to_dict(sched.snapshot()))
    assert "capacity_blocks" in text and "policy" in text
    json.dumps(snapshot_to_dict(sched.snapshot()))  # JSON-able
    assert "admitted in time" not in text  # (no queued caller's outcome yet)


def test_format_snapshot_shows_the_wait_outcomes_the_turn_away_reads() -> None:
    """``kvbudget inspect`` shows, band by band of pressure, how many queued callers were
    admitted in time: what the turn-away at arrival judges a new caller's forecast by."""
    sched = Scheduler(Capacity(blocks=4, block_size=16))
    for ok in (True, True, False):
        sched.forecast.note_waited(1.2, 1.0, ok, sched.now)
    sched.forecast.note_waited(0.3, 1.0, True, sched.now)
    data = snapshot_to_dict(sched.snapshot())
    assert len(data["wait_outcomes_by_band"]) == 16
    text = format_snapshot(data)
    assert "admitted in time, by forecast wait / what they might wait: from 0: 1/1, " \
        "from 1: 2/3" in text


_EMBEDDED = """
import asyncio, logging, sys
import structlog
import kvbudget
from kvbudget.engines.sim import SimEngine
if sys.argv[1] == "debug":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
async def main():
    engine = SimEngine()
    async with kvbudget.Budget(engine.capacity, engine=engine) as budget:
        async for _ in budget.generate(engine, kvbudget.RequestSpec(8, 8, 64), request_id="r1"):
            pass
    kvbudget.observability.log_drift(3, 10, 7)  # a warning: printed either way
asyncio.run(main())
"""


@pytest.mark.parametrize("configured", [False, True])
def test_an_application_that_never_configured_structlog_sees_info_and_up(
    configured: bool,
) -> None:
    """Embedded in a server that never configured structlog, kvbudget prints its events from
    ``info`` up only (structlog alone would print every admission and confirmation); once the
    application configures structlog, its configuration decides (here: everything)."""
    import os
    import pathlib
    import subprocess

    src = str(pathlib.Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _EMBEDDED, "debug" if configured else "default"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout
    assert "drift" in out
    assert ("admission" in out and "confirmation" in out) is configured
