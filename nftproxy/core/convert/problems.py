"""Problems: one invalid field of one Kubernetes object, and the object's name.

Layer: convert (imports model and convert.names only). One job: the reporting side of
conversion: the `Problem` value, the `Report` that collects an object's
problems while it converts, the labels naming the object in a problem
("ns/name", "name" for cluster-scoped objects, "<unknown>"), and reading an
object's metadata name, which every converter starts from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nftproxy.core.convert.names import printable
from nftproxy.core.model import NamespacedName

__all__ = ["Problem", "service_name"]

UNKNOWN = "<unknown>"


@dataclass(frozen=True, slots=True)
class Problem:
    """One invalid field that was skipped.

    >>> str(Problem("Service", "ns/web", "spec.ports[0].port", "70000 is out of range"))
    'Service ns/web: spec.ports[0].port: 70000 is out of range'
    """

    kind: str
    obj: str
    field: str
    message: str

    def __str__(self) -> str:
        # Escaped: an object's name from a file may hold newlines or terminal escapes.
        return printable(f"{self.kind} {self.obj}: {self.field}: {self.message}")


def service_name(obj: Mapping[str, Any]) -> NamespacedName | None:
    """namespace/name of any object dict, or None if metadata is unusable.

    The namespace is "" for cluster-scoped objects (Node, ServiceCIDR).

    >>> service_name({"metadata": {"namespace": "ns", "name": "web"}})
    NamespacedName(namespace='ns', name='web')
    >>> service_name({"metadata": {"namespace": "ns"}}) is None
    True
    """
    return _name_of(obj)


@dataclass(slots=True)
class Report:
    """The problems found in one object, collected while converting it."""

    kind: str
    obj: str
    problems: list[Problem] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(self.kind, self.obj, path, message))


def describe(value: object) -> str:
    """A short, never-raising rendering of an input value for messages."""
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10**18 else "a very large integer"
    if isinstance(value, str):
        return repr(value) if len(value) <= 64 else repr(value[:61]) + "..."
    return f"a {type(value).__name__}"


def _name_of(obj: object) -> NamespacedName | None:
    try:
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        if not isinstance(meta, Mapping):
            return None
        name = meta.get("name")
        namespace = meta.get("namespace")
        namespace = "" if namespace is None else namespace
        if not isinstance(name, str) or not name or not isinstance(namespace, str):
            return None
        return NamespacedName(namespace, name)
    except Exception:  # a hostile Mapping; nothing may raise out of convert
        return None


def object_label(obj: object) -> str:
    """'ns/name', or 'name' for cluster-scoped objects, or '<unknown>'."""
    name = _name_of(obj)
    if name is None:
        return UNKNOWN
    return str(name) if name.namespace else name.name


def internal_error(kind: str, obj: object, exc: Exception) -> Problem:
    return Problem(kind, object_label(obj), "", f"internal error: {type(exc).__name__}")


def required_namespaced_name(kind: str, obj: object) -> NamespacedName | Problem:
    """metadata namespace/name of a namespaced object, or the Problem saying why not."""
    name = _name_of(obj)
    if name is not None and name.namespace:
        return name
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        return Problem(kind, UNKNOWN, "metadata", "expected an object with name and namespace")
    if name is None:
        return Problem(kind, UNKNOWN, "metadata.name", "missing or not a string")
    return Problem(kind, UNKNOWN, "metadata.namespace", "missing or not a string")
