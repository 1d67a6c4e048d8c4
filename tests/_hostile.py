"""What the hostile-client tests send: hypothesis strategies for request bodies and headers, and
the checks every answer must pass (no 5xx, an OpenAI-style error body), shared by
``test_hostile.py`` (the example servers) and ``test_serve_hostile.py`` (``kvbudget serve``)."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

from hypothesis import strategies as st

#: what a server may answer a sloppy or hostile client (never a 5xx)
ALLOWED = {200, 400, 401, 403, 404, 413, 422, 429}
MAX_MODEL_LEN = 736

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12),
)
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                          inner, max_size=4),
    max_leaves=12,
)
_small_max = st.sampled_from([1, 2, 3, 4])


def _prompt() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.text(max_size=40),  # any unicode
        st.text(st.characters(categories=["Cs", "Ll", "Zs", "Cc"]), min_size=1, max_size=6),
        # lone surrogates: JSON escapes them (\ud800) and the tokenizer refuses them
        st.lists(st.integers(-3, 1100), min_size=0, max_size=12),  # vocabulary: 1024
        st.lists(st.integers(0, 1000), min_size=MAX_MODEL_LEN - 2, max_size=MAX_MODEL_LEN + 2),
        st.just([[1, 2, 3]]), st.just(["hi"]), st.just(["a", "b"]),
        _json,
    )


def _numbers() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
        st.sampled_from(["1", "NaN", None, True, [], {}]),
    )


_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": _numbers(),
    "top_p": _numbers(),
    "top_k": _numbers(),
    "min_p": _numbers(),
    "presence_penalty": _numbers(),
    "frequency_penalty": _numbers(),
    "repetition_penalty": _numbers(),
    "seed": st.one_of(st.integers(-(2**70), 2**70), _scalars),
    "n": st.sampled_from([1, 2, 0, -1, "1", None, 1.5]),
    "min_tokens": st.sampled_from([0, 1, 5, -1, "2", None]),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=20), _scalars),
    "stream": st.sampled_from([True, False, None, "yes", 1]),
    "stream_options": st.sampled_from([None, {}, {"include_usage": True}, {"include_usage": 3},
                                       "x", []]),
    "ignore_eos": st.sampled_from([True, False, None, "no", 0]),
    "model": st.sampled_from(["tiny", "nope", "", None, 5, "TINY"]),
    "user": st.text(max_size=8),
    "logit_bias": _json,
}


def body(chat: bool) -> st.SearchStrategy[Any]:
    """A request body: mostly an object whose fields are sloppy, sometimes not an object."""
    main: dict[str, st.SearchStrategy[Any]] = {
        "max_tokens": st.one_of(
            _small_max, _small_max, st.sampled_from([0, -1, 10**30, 1.5, "3", None, True,
                                                    MAX_MODEL_LEN + 1]),
        ),
    }
    if chat:
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot", 5])},
            optional={"content": st.one_of(st.text(max_size=30), _json,
                                           st.just([{"type": "text", "text": "hi"}]))},
        )
        main["messages"] = st.one_of(st.lists(message, min_size=1, max_size=3), _json)
    else:
        main["prompt"] = _prompt()
    obj = st.fixed_dictionaries(main, optional=_FIELDS)
    return st.one_of(obj, obj, _json, valid_body(chat), valid_body(chat))


def valid_body(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    """A request body a careful client would send (any unicode text, valid ranges)."""
    main: dict[str, st.SearchStrategy[Any]] = {"max_tokens": _small_max}
    if chat:
        main["messages"] = st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}),
            min_size=1, max_size=2,
        )
    else:
        main["prompt"] = st.text(min_size=1, max_size=40) | st.lists(
            st.integers(0, 1023), min_size=1, max_size=20
        )
    return st.fixed_dictionaries(main, optional={
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 99),
        "stream": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "ignore_eos": st.booleans(), "model": st.just("tiny"),
        "stream_options": st.just({"include_usage": True}),
    })


def headers() -> st.SearchStrategy[dict[str, bytes]]:
    """The budget's headers with arbitrary latin-1 values that HTTP allows (no control
    characters: uvicorn's h11 answers those itself, below the app, as vLLM's own server)."""
    text = st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"),
                   max_size=40)
    value = st.one_of(text, st.sampled_from(["interactive", "batch", "1", "0", "continue",
                                             "extend", "0.5", "-1", "nan", "inf", "1e309"]))
    names = ["X-KVBudget-Class", "X-KVBudget-Tenant", "X-KVBudget-Task", "X-KVBudget-Durable",
             "X-KVBudget-Deadline", "X-KVBudget-On-Exhausted"]
    values = value.map(lambda v: v.strip().encode("latin-1"))
    return st.dictionaries(st.sampled_from(names), values, max_size=4)


def encode(data: Any) -> bytes:
    """JSON as a sloppy client writes it (NaN and Infinity literals included)."""
    return json.dumps(data, allow_nan=True).encode("utf-8", "surrogatepass")


#: the statuses the fuzz tests saw (the test after them checks both kinds were common)
SEEN: collections.Counter[int] = collections.Counter()


def check_answer(status: int, content_type: str, text: str) -> None:
    """Every answer: an allowed status; an error is an OpenAI-style JSON body."""
    SEEN[status] += 1
    assert status in ALLOWED, (status, text[:500])
    if status != 200:
        assert content_type.startswith("application/json"), (status, content_type, text[:300])
        err = json.loads(text)["error"]
        assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), text
    elif content_type.startswith("text/event-stream"):
        assert "data: [DONE]" in text or '"error"' in text, text[-300:]


def idle(snap: dict[str, Any]) -> bool:
    return bool(snap["reserved_blocks"] == 0 and snap["active"] == 0
                and snap["releasing"] == 0 and snap["queued"] == 0)


def wait_idle(get_snapshot: Any, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        snap: dict[str, Any] = get_snapshot()
        if idle(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


async def flood_names(
    url: str, path: str, n: int, base: dict[str, Any], headers: dict[str, str] | None = None,
    concurrency: int = 16, tenants: bool = True,
) -> list[int]:
    """``n`` small requests, each with a tenant (if ``tenants``) and a task of its own."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:

        async def one(i: int) -> None:
            h = dict(headers or {})
            h["X-KVBudget-Task"] = f"task-{i}-{'x' * (i % 7)}"
            if tenants:
                h["X-KVBudget-Tenant"] = f"tenant-{i}"
            async with sem:
                r = await client.post(path, json=base, headers=h)
            statuses.append(r.status_code)

        await asyncio.gather(*(one(i) for i in range(n)))
    return statuses


def metrics_lines(text: str, prefix: str = "kvbudget_") -> int:
    return sum(1 for line in text.splitlines() if line.startswith(prefix))



def series(text: str, prefix: str = "kvbudget_") -> set[str]:
    """The series (name and labels) of a Prometheus exposition, but the reconciliation row
    (``class="*",tenant="*"``: one fixed label set, present once a reconciliation found
    drift)."""
    return {
        line.rsplit(" ", 1)[0] for line in text.splitlines()
        if line.startswith(prefix) and 'tenant="*"' not in line
    }
