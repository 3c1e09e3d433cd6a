"""A cluster source that reads Kubernetes objects from YAML/JSON files.

Layer: sources (edge: reads files; imports sources.events and core.convert.names). One job:
feed a `ClusterEvents` handler from manifests on disk, the same way the kube
source feeds it from the API server; `WatchedFiles` runs one as the agent's
source (load on start, then watch in a thread). Callers: cli (`sync
--source`, `run --source`, `demo`).

Accepted input: multi-document YAML, `kind: List` (what `kubectl get
svc,endpointslices -A -o yaml` prints, nested Lists too), typed lists as the
API returns them (`ServiceList` whose items carry no kind), JSON. Objects
used: v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node (only this
node's), networking.k8s.io ServiceCIDR. Anything else is skipped with one
warning per object. Objects are keyed by kind + namespace + name; a
namespaced object without a namespace is put in "default", as `kubectl
apply` would; when a key appears twice, the later file wins.

Known limits: polling, not inotify (an edit is seen within `poll_interval`);
an edit that keeps a file's size, mtime and inode is missed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, ClusterEvents, Obj
from nftproxy.core.convert.names import printable

__all__ = ["AmbiguousNode", "FileSource", "SourceError", "WatchedFiles"]

_SERVICE = "Service"
_ENDPOINT_SLICE = "EndpointSlice"
_NODE = "Node"
_SERVICE_CIDR = "ServiceCIDR"
_NAMESPACED = frozenset({_SERVICE, _ENDPOINT_SLICE})
_KNOWN = frozenset({_SERVICE, _ENDPOINT_SLICE, _NODE, _SERVICE_CIDR})

_Key = tuple[str, str, str]  # kind, namespace, name
_FileSignature = tuple[tuple[str, int, int, int] | None, ...]
_Deliver = Callable[[Obj | None, Obj | None], None]


class SourceError(Exception):
    """A source file is missing or malformed; the message is one line naming it."""


class AmbiguousNode(SourceError):
    """No node name was given and the files hold several Nodes: which one is
    this node's cannot be told (a configuration error, not a broken file)."""


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """Everything the files held that the handler was given."""

    services: Mapping[_Key, Obj]
    slices: Mapping[_Key, Obj]
    node: Obj | None
    node_name: str
    service_cidrs: tuple[Obj, ...]


_EMPTY = _Snapshot({}, {}, None, "", ())


class FileSource:
    """Feeds a ClusterEvents handler from files; `load()` once, then `reload()`/`watch()`.

    `node_name` selects this node's Node object; when it is empty and the
    files hold exactly one Node, that one is used, and several are an
    `AmbiguousNode` error. `chosen_node_name` tells which Node was delivered
    ("" if none). A reload that would take every Service away (an emptied
    or truncated file) keeps the previous state unless `allow_empty`.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        handler: ClusterEvents,
        *,
        node_name: str = "",
        poll_interval: float = 1.0,
        logger: logging.Logger | None = None,
        allow_empty: bool = False,
    ) -> None:
        self.paths = tuple(Path(p) for p in paths)
        self.handler = handler
        self.node_name = node_name
        self.poll_interval = poll_interval
        self.allow_empty = allow_empty
        self.log = logger or logging.getLogger(__name__)
        self.chosen_node_name = ""
        self._delivered = _EMPTY
        self._signature: _FileSignature = ()
        self._warned: set[_Key] = set()
        self._read_ahead: _Snapshot | None = None

    # -- public -----------------------------------------------------------------

    def read(self) -> str:
        """Read every file now without delivering anything, and return the
        name of the Node the files hold for this node ("" if none). The next
        load() delivers this reading instead of reading again. Raises
        SourceError if a file is missing or malformed."""
        signature = self._stat()
        self._read_ahead = self._read()
        self._signature = signature
        return self._read_ahead.node_name

    @property
    def service_count(self) -> int:
        """How many Services the last reading held (read(), or the last delivery)."""
        snapshot = self._read_ahead if self._read_ahead is not None else self._delivered
        return len(snapshot.services)

    def load(self) -> None:
        """Read every file (unless read() just did) and deliver all objects,
        then mark both kinds synced.

        Raises SourceError if a file is missing or malformed (nothing is delivered).
        """
        snapshot, self._read_ahead = self._read_ahead, None
        if snapshot is None:
            signature = self._stat()
            snapshot = self._read()
            self._signature = signature
        handler = self.handler
        for obj in snapshot.services.values():
            handler.on_service(None, obj)
        for obj in snapshot.slices.values():
            handler.on_endpoint_slice(None, obj)
        handler.on_node(snapshot.node)
        handler.on_service_cidrs(snapshot.service_cidrs)
        self._commit(snapshot)
        handler.on_synced(KIND_SERVICES)
        handler.on_synced(KIND_ENDPOINT_SLICES)

    def reload(self) -> bool:
        """Re-read the files and deliver only what changed; True if anything did.

        A missing or malformed file keeps the previous state: the error is
        logged and nothing is delivered (someone may be mid-edit). So does a
        reading without Services where Services were delivered, unless
        `allow_empty` (one WARNING).
        """
        self._signature = self._stat()  # a broken edit is reported once, not every poll
        try:
            snapshot = self._read()
        except SourceError as exc:
            self.log.error("%s (keeping the previous state)", exc)
            return False
        old = self._delivered
        if old.services and not snapshot.services and not self.allow_empty:
            self.log.warning(
                "%s: no Service left (%d were delivered); keeping the previous state "
                "(--allow-empty lets an empty source remove every service)",
                ", ".join(map(str, self.paths)), len(old.services),
            )
            return False
        handler = self.handler
        changed = _deliver_diff(old.services, snapshot.services, handler.on_service)
        changed |= _deliver_diff(old.slices, snapshot.slices, handler.on_endpoint_slice)
        if snapshot.node != old.node:
            handler.on_node(snapshot.node)
            changed = True
        if snapshot.service_cidrs != old.service_cidrs:
            handler.on_service_cidrs(snapshot.service_cidrs)
            changed = True
        self._commit(snapshot)
        if removed := sum(1 for key in old.services if key not in snapshot.services):
            self.log.info("%d of %d Services left the source files", removed, len(old.services))
        return changed

    def watch(self, stop: threading.Event) -> None:
        """Poll the files' mtime/size every poll_interval and reload on change,
        until `stop` is set. Call load() first."""
        while not stop.wait(self.poll_interval):
            if self._stat() == self._signature:
                continue
            try:
                if self.reload():
                    self.log.info("reloaded changed source files")
            except Exception:  # a handler bug must not end the watch
                self.log.exception("delivering file changes failed")

    # -- reading ------------------------------------------------------------------

    def _stat(self) -> _FileSignature:
        result: list[tuple[str, int, int, int] | None] = []
        for path in self.paths:
            try:
                st = path.stat()
            except OSError:
                result.append(None)
                continue
            result.append((str(path), st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(result)

    def _read(self) -> _Snapshot:
        objects: dict[_Key, Obj] = {}
        origin: dict[_Key, Path] = {}
        for path in self.paths:
            for obj in _objects(path, _parse(path)):
                key = self._key(obj, path)
                if key is None:
                    continue
                if key in objects and origin[key] != path:
                    self.log.warning(
                        "%s %s is in both %s and %s; using %s",
                        key[0], _display(key), origin[key], path, path,
                    )
                objects[key] = _with_namespace(obj, key)
                origin[key] = path

        def of_kind(kind: str) -> dict[_Key, Obj]:
            return {k: v for k, v in sorted(objects.items()) if k[0] == kind}

        nodes = of_kind(_NODE)
        node = self._choose_node(nodes)
        return _Snapshot(
            services=of_kind(_SERVICE),
            slices=of_kind(_ENDPOINT_SLICE),
            node=node,
            node_name=_name(node) if node is not None else "",
            service_cidrs=tuple(of_kind(_SERVICE_CIDR).values()),
        )

    def _key(self, obj: Obj, path: Path) -> _Key | None:
        kind = obj.get("kind")
        metadata = obj.get("metadata")
        if not isinstance(metadata, Mapping):
            metadata = {}
        name = metadata.get("name")
        if not isinstance(kind, str) or not isinstance(name, str) or not name:
            self.log.warning("%s: skipping an object without kind or metadata.name", path)
            return None
        namespace = str(metadata.get("namespace") or "default") if kind in _NAMESPACED else ""
        key = (kind, namespace, name)
        if kind not in _KNOWN:
            if key not in self._warned:
                self._warned.add(key)
                self.log.warning("%s: ignoring %s %s (not used by nftproxy)",
                                 path, printable(kind), _display(key))
            return None
        return key

    def _choose_node(self, nodes: Mapping[_Key, Obj]) -> Obj | None:
        if self.node_name:
            return nodes.get((_NODE, "", self.node_name))
        if len(nodes) > 1:
            found = ", ".join(printable(key[2]) for key in nodes)
            raise AmbiguousNode(
                f"{', '.join(map(str, self.paths))}: {len(nodes)} Nodes ({found}) and no node "
                "name given; which one is this node? (--node-name)"
            )
        return next(iter(nodes.values()), None)

    def _commit(self, snapshot: _Snapshot) -> None:
        if snapshot.node_name != self.chosen_node_name:
            if snapshot.node is None:
                self.log.warning(
                    "no Node object for %r in the source files", self.node_name or "this node"
                )
            else:
                self.log.info("using Node %s from the source files", snapshot.node_name)
        self.chosen_node_name = snapshot.node_name
        self._delivered = snapshot


class WatchedFiles:
    """A FileSource as the agent's Source: load() on start (SourceError if a
    file is missing or malformed), then watch() in a thread until stop()."""

    def __init__(self, source: FileSource) -> None:
        self.source = source
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.source.load()
        self._thread = threading.Thread(
            target=self.source.watch, args=(self._stop,), name="file-source", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _parse(path: Path) -> list[Any]:
    """The documents of one file; SourceError naming the file (and line) otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: cannot read: {exc}") from None
    if text.lstrip()[:1] in ("{", "["):
        try:  # JSON: much faster than YAML for large `kubectl -o json` dumps
            return [json.loads(text)]
        except json.JSONDecodeError:
            pass  # maybe YAML flow style; let the YAML parser judge and report
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return list(yaml.load_all(text, Loader=loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = exc.problem or exc.context or "invalid YAML"
        raise SourceError(f"{where}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise SourceError(f"{path}: invalid YAML: {exc}") from None


def _objects(path: Path, docs: Sequence[Any], item_kind: str = "") -> Iterator[Obj]:
    """Flatten documents and (nested) Lists into objects; list items without a
    kind inherit it from a typed list (`ServiceList` -> `Service`)."""
    for doc in docs:
        if doc is None:
            continue
        if isinstance(doc, list):
            yield from _objects(path, doc, item_kind)
            continue
        if not isinstance(doc, Mapping):
            raise SourceError(f"{path}: expected Kubernetes objects, found {doc!r:.40}")
        kind = doc.get("kind")
        if kind is None and item_kind:
            doc = {**doc, "kind": item_kind}
            kind = item_kind
        if isinstance(kind, str) and kind.endswith("List") and "items" in doc:
            items = doc["items"] or []
            if not isinstance(items, list):
                raise SourceError(f"{path}: {kind}.items is not a list")
            yield from _objects(path, items, kind[: -len("List")])
            continue
        yield doc


def _with_namespace(obj: Obj, key: _Key) -> Obj:
    metadata = obj["metadata"]
    if key[1] and metadata.get("namespace") != key[1]:
        return {**obj, "metadata": {**metadata, "namespace": key[1]}}
    return obj


def _deliver_diff(old: Mapping[_Key, Obj], new: Mapping[_Key, Obj], deliver: _Deliver) -> bool:
    changed = False
    for key, obj in new.items():
        previous = old.get(key)
        if previous != obj:
            deliver(previous, obj)
            changed = True
    for key, obj in old.items():
        if key not in new:
            deliver(obj, None)
            changed = True
    return changed


def _name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def _display(key: _Key) -> str:
    return printable(f"{key[1]}/{key[2]}" if key[1] else key[2])

