"""Every kvbudget error pickles whole: an error raised in a worker process (the simulator's
process pools, ``benchmarks/held_out_cells.py``) reaches its parent with its type, message and
fields, instead of breaking the pool."""

from __future__ import annotations

import inspect
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from kvbudget import errors
from kvbudget.core.resume import Checkpoint, Continuation

CASES: dict[type[errors.KvBudgetError], errors.KvBudgetError] = {
    errors.KvBudgetError: errors.KvBudgetError("plain"),
    errors.InvalidInput: errors.InvalidInput("max_tokens", -3, "an integer >= 1"),
    errors.UnknownName: errors.UnknownName("task", "chat", ["code"]),
    errors.UnknownClass: errors.UnknownClass("gold", ("interactive", "batch")),
    errors.UnknownPolicy: errors.UnknownPolicy("vllm-v1", ["calibrated"]),
    errors.UnknownRequest: errors.UnknownRequest("r1"),
    errors.DuplicateRequest: errors.DuplicateRequest("r1"),
    errors.InvalidTransition: errors.InvalidTransition("r1", "queued", "tokens"),
    errors.AlreadyReleased: errors.AlreadyReleased("r1", "tokens"),
    errors.HardLimitExceeded: errors.HardLimitExceeded("r1", 64, 65),
    errors.GrantExceeded: errors.GrantExceeded("r1", 32, 8, 41),
    errors.PolicyViolation: errors.PolicyViolation("calibrated", "granted past the hard max"),
    errors.Overloaded: errors.Overloaded(1.5, "queue-timeout", "r1"),
    errors.Preempted: errors.Preempted(Checkpoint("r1", 512, 40), 552, "headroom"),
    errors.ContinuationRequired: errors.ContinuationRequired(
        Continuation("r1", "r1.c1", 512, 40, 88)
    ),
    errors.EngineError: errors.EngineError("r1", "boom"),
    errors.EngineDead: errors.EngineDead("r1", "the engine is dead"),
    errors.EngineStalled: errors.EngineStalled("r1", "no step within 2s"),
    errors.Unauthorized: errors.Unauthorized("missing"),
    errors.Forbidden: errors.Forbidden("acme", "class 'batch'", ("interactive",)),
    errors.BudgetClosed: errors.BudgetClosed(),
    errors.RequestAborted: errors.RequestAborted("r1"),
    errors.SimulationError: errors.SimulationError("a request never ended"),
    errors.TraceFormatError: errors.TraceFormatError("t.csv", 3, "input_tokens", "an int", "x"),
}


def test_every_error_class_has_a_case() -> None:
    defined = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, errors.KvBudgetError) and obj.__module__ == errors.__name__
    }
    assert defined == set(CASES)


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_an_error_pickles_with_its_fields(cls: type[errors.KvBudgetError]) -> None:
    error = CASES[cls]
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert back.args == error.args
    assert vars(back) == vars(error)


def _raise_unknown_policy(name: str) -> None:
    raise errors.UnknownPolicy(name, ["calibrated", "oracle"])


def test_an_error_raised_in_a_worker_process_reaches_the_parent() -> None:
    with ProcessPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_raise_unknown_policy, "vllm-v1")
        with pytest.raises(errors.UnknownPolicy) as caught:
            future.result()
    assert caught.value.name == "vllm-v1"
    assert caught.value.known == ("calibrated", "oracle")
    assert "unknown policy 'vllm-v1'" in str(caught.value)
