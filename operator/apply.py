"""Idempotent apply of one owned object: read, compare, and write only on a difference.

A live object matches when the desired object is a subset of it (the server adds defaults and
status). Keys the operator set before but no longer renders are removed through a three-way
merge patch against the last-applied annotation, as `kubectl apply` does.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Any

from pagedinfer.operator.builders.desired import Desired
from pagedinfer.operator.errors import SpecError
from pagedinfer.operator.k8s import KubeClient
from pagedinfer.operator.spec import GROUP

LAST_APPLIED = f"{GROUP}/last-applied"
# Never removed when absent from the desired object: owned by someone else once autoscaling is on.
_NEVER_REMOVED = {("spec", "replicas")}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
}


class Action(str, Enum):
    NONE = "none"
    CREATED = "created"
    PATCHED = "patched"
    DELETED = "deleted"


def parse_quantity(text: str) -> Decimal | None:
    match = _QUANTITY.match(text.strip())
    if not match or match.group(2) not in _SUFFIX:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2)]
    except InvalidOperation:
        return None


def _leaf_equal(desired: Any, actual: Any) -> bool:
    if desired == actual:
        return True
    # "1000m" and "1" are the same quantity: the server returns the canonical form.
    if isinstance(desired, (str, int)) and isinstance(actual, (str, int)):
        a, b = parse_quantity(str(desired)), parse_quantity(str(actual))
        return a is not None and a == b
    return False


def is_subset(desired: Any, actual: Any) -> bool:
    """True when every value in `desired` is present and equal in `actual` (lists: same length)."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return not desired and actual is None
        return all(
            (v in ({}, [], None) and actual.get(k) in ({}, [], None)) or is_subset(v, actual.get(k))
            for k, v in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(desired) != len(actual):
            return not desired and not actual
        return all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
    return _leaf_equal(desired, actual)


def three_way_patch(
    last: dict[str, Any], desired: dict[str, Any], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`desired`, plus None for every key `last` had that `desired` dropped (merge-patch removal)."""
    patch: dict[str, Any] = dict(desired)
    for key, old in last.items():
        sub = (*path, key)
        if key not in desired:
            if sub not in _NEVER_REMOVED:
                patch[key] = None
        elif isinstance(old, dict) and isinstance(desired[key], dict):
            patch[key] = three_way_patch(old, desired[key], sub)
    return patch


def with_last_applied(body: dict[str, Any]) -> dict[str, Any]:
    """The body carrying its own compact JSON in the last-applied annotation."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    meta = dict(body["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), LAST_APPLIED: text}
    return {**body, "metadata": meta}


def _last_applied(actual: dict[str, Any]) -> dict[str, Any]:
    text = (actual.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def is_owned_by(actual: dict[str, Any], uid: str) -> bool:
    refs = actual.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


async def apply(
    client: KubeClient,
    item: Desired,
    namespace: str,
    owner_uid: str,
    create_extra: dict[str, Any] | None = None,
) -> tuple[Action, dict[str, Any] | None]:
    """Make one owned object match `item`; returns what was done and the live object (None if absent)."""
    actual = await client.get(item.resource, namespace, item.name)
    if item.body is None:
        if actual is not None and is_owned_by(actual, owner_uid):
            await client.delete(item.resource, namespace, item.name)
            return Action.DELETED, None
        return Action.NONE, None
    desired = with_last_applied(item.body)
    if actual is None:
        body = _merge(desired, create_extra or {})
        return Action.CREATED, await client.create(item.resource, body)
    if not is_owned_by(actual, owner_uid):
        raise SpecError(
            "ObjectConflict",
            f"{item.resource.kind} {namespace}/{item.name} exists and is not owned by this engine",
        )
    if is_subset(desired, actual):
        return Action.NONE, actual
    patch = three_way_patch(_last_applied(actual), desired)
    return Action.PATCHED, await client.patch(item.resource, namespace, item.name, patch)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
