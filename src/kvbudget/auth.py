"""Tenants from credentials: the ``--api-keys FILE`` every shipped server takes.

Without a keys file a server trusts the ``X-KVBudget-Tenant`` header (or the gRPC field): any
client can name any tenant, which is fine on a laptop or behind a gateway that sets the header
itself, and nowhere else. With one, a request must carry ``Authorization: Bearer KEY`` (gRPC:
the ``authorization`` metadata key, same value), as vLLM's own ``--api-key`` asks; the key
decides the tenant (the tenant header is ignored), its weight in the budget's weighted fairness
(``SchedulerConfig.tenant_weights``) and the service classes it may use.

The file is JSON, an object from key to its entry::

    {
      "sk-acme-7f3a": {"tenant": "acme", "weight": 2.0, "classes": ["interactive", "batch"]},
      "sk-batch-01":  {"tenant": "etl", "classes": ["batch"]},
      "sk-guest":     {"tenant": "guest"}
    }

``tenant`` (required, a non-empty string), ``weight`` (> 0, default 1; keys of one tenant must
agree), ``classes`` (the service classes the key may ask for, in order of preference; the first
is its default when a request names none and ``interactive`` is not allowed; omitted or null:
every class). Keys are compared by their SHA-256 digest in constant time.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvbudget.errors import Forbidden, InvalidInput, Unauthorized

FLAG = "--api-keys"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@attrs.frozen(slots=True)
class ApiKey:
    """What one API key stands for: its tenant, weight and allowed service classes (None:
    every class)."""

    tenant: str
    weight: float = 1.0
    classes: tuple[str, ...] | None = None

    def service_class(self, asked: str | None, default: str = "interactive") -> str:
        """The class a request with this key runs in: ``asked`` (or the default) if allowed;
        raises :class:`~kvbudget.errors.Forbidden` otherwise."""
        if self.classes is None:
            return asked or default
        if asked is None:
            return default if default in self.classes else self.classes[0]
        if asked not in self.classes:
            raise Forbidden(self.tenant, f"service class {asked!r}", self.classes)
        return asked


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` value (None if absent or another
    scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeys:
    """The keys of a keys file, looked up by digest."""

    __slots__ = ("_by_digest", "path")

    def __init__(self, keys: Mapping[str, ApiKey], path: str | None = None) -> None:
        self._by_digest = {_digest(k): v for k, v in keys.items()}
        self.path = path

    def __len__(self) -> int:
        return len(self._by_digest)

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key an ``Authorization`` header value carries; raises
        :class:`~kvbudget.errors.Unauthorized` when it is missing, not a bearer token or not a
        key of the file."""
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized(
                "missing" if not authorization else "expected 'Authorization: Bearer KEY'"
            )
        digest = _digest(token)
        found: ApiKey | None = None
        for known, key in self._by_digest.items():  # every digest compared: constant time
            if secrets.compare_digest(known, digest):
                found = key
        if found is None:
            raise Unauthorized("unknown key")
        return found

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(k.tenant for k in self._by_digest.values())

    def tenant_weights(self) -> dict[str, float]:
        """For ``SchedulerConfig.tenant_weights``."""
        return {k.tenant: k.weight for k in self._by_digest.values()}

    def check_classes(self, known: Iterable[str]) -> None:
        """Raise InvalidInput if a key allows a class the server does not have."""
        names = set(known)
        for key in self._by_digest.values():
            for cls in key.classes or ():
                if cls not in names:
                    raise InvalidInput(
                        FLAG, self.path or "(keys)",
                        f"classes the server has ({', '.join(sorted(names))}); tenant "
                        f"{key.tenant!r} lists {cls!r}",
                    )


def _entry(path: str, key: Any, raw: Any) -> ApiKey:
    def bad(expected: str) -> InvalidInput:
        return InvalidInput(FLAG, path, expected)

    if not isinstance(key, str) or not key.strip() or key != key.strip():
        raise bad("non-empty keys without surrounding spaces")
    if not isinstance(raw, dict):
        raise bad(f"an object for each key ({{'tenant': ...}}), got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"tenant", "weight", "classes"})
    if unknown:
        raise bad(f"only the fields tenant, weight, classes (got {unknown})")
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not tenant.strip():
        raise bad("a non-empty string 'tenant' for each key")
    weight = raw.get("weight", 1.0)
    if (
        isinstance(weight, bool) or not isinstance(weight, int | float)
        or not math.isfinite(weight) or weight <= 0
    ):
        raise bad(f"'weight' > 0 (tenant {tenant!r} has {weight!r})")
    classes = raw.get("classes")
    if classes is not None:
        if (
            not isinstance(classes, list) or not classes
            or not all(isinstance(c, str) and c for c in classes)
        ):
            raise bad(f"'classes' a non-empty list of class names or null (tenant {tenant!r})")
        classes = tuple(dict.fromkeys(classes))
    return ApiKey(tenant=tenant.strip(), weight=float(weight), classes=classes)


def parse_api_keys(data: Any, path: str = "(keys)") -> ApiKeys:
    """:class:`ApiKeys` from the decoded JSON document (see the module docs)."""
    if not isinstance(data, dict) or not data:
        raise InvalidInput(FLAG, path, "a JSON object from API key to {tenant, weight, classes}")
    keys = {key: _entry(path, key, raw) for key, raw in data.items()}
    weights: dict[str, float] = {}
    for k in keys.values():
        if weights.setdefault(k.tenant, k.weight) != k.weight:
            raise InvalidInput(
                FLAG, path, f"one weight per tenant ({k.tenant!r} has {weights[k.tenant]} and "
                f"{k.weight})",
            )
    return ApiKeys(keys, path)


def load_api_keys(path: str | pathlib.Path) -> ApiKeys:
    """Read a keys file; raises InvalidInput (field ``--api-keys``) saying what is wrong."""
    try:
        data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidInput(FLAG, str(path), f"a readable JSON file ({exc})") from None
    return parse_api_keys(data, str(path))


__all__ = [
    "FLAG",
    "ApiKey",
    "ApiKeys",
    "bearer_token",
    "load_api_keys",
    "parse_api_keys",
]
