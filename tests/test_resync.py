"""A full sync over existing tables in steps (agent/chunked.py, core/nft/resync.py),
on FakeBackend (no root).

Aspects:
- a restart over an old table, in several chunks, ends in exactly the table
  (and the planner's record) of the one-transaction full sync, for both
  userspace dialects; a partial sync after it agrees too;
- it goes in skeleton + chunks + one final transaction, none of them near
  the size of the single transaction;
- after every intermediate commit the table is consistent: every goto/jump
  target exists, every service port of the old table keeps its dispatch
  element; new services appear with the final step only;
- the affinity set is kept with its clients, and stays dynamic;
- a re-declared set or a changed base-chain hook: one transaction, as before;
- a refused step raises, the next sync is full and converges; after EBUSY
  its final step leaves the chains flushed, and a later sync deletes them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
from k8s import endpoint_slice, service
from kernel import picked_chooser
from test_proxier import CONFIG, NODE, Recording, listed, listing, started

from nftproxy.agent.proxier import Proxier
from nftproxy.core.model import IPFamily
from nftproxy.core.nft.errors import NftBusy, NftRejected
from nftproxy.core.nft.jsontext import transaction_text
from nftproxy.core.nft.listing import list_family
from nftproxy.core.nft.seam import Backend
from nftproxy.kernel.fake import FakeBackend

Obj = dict[str, Any]
CHUNK = 6  # endpoints: two services of three per chunk


def _svc(i: int, n_eps: int, **kw: Any) -> list[Obj]:
    name = f"s{i:03}"
    eps = [(f"10.{240 + j}.{i // 200}.{i % 200 + 1}", NODE if j % 2 == 0 else "node-b")
           for j in range(n_eps)]
    return [service(name, f"10.96.{i // 200}.{i % 200 + 1}", **kw), endpoint_slice(name, eps)]


def old_cluster(n: int = 12) -> list[Obj]:
    """n ClusterIP services of 3 endpoints, one with affinity, one NodePort
    of eTP Cluster, one LoadBalancer with source ranges."""
    out: list[Obj] = []
    for i in range(n):
        out += _svc(i, 3)
    out += _svc(n, 3, affinity_timeout=60)
    out += _svc(n + 1, 3, type="NodePort", node_ports=[30081])
    out += _svc(n + 2, 2, type="LoadBalancer", node_ports=[30082], lb_ips=["192.0.2.10"],
                source_ranges=["203.0.113.0/24"])
    return out


def new_cluster(n: int = 12) -> list[Obj]:
    """old_cluster changed: two services gone, three added, endpoints of one
    changed, the affinity service keeps its sets, the NodePort moves to eTP
    Local, the LoadBalancer's source ranges change."""
    out: list[Obj] = []
    for i in range(2, n):
        out += _svc(i, 4 if i == 3 else 3)
    for i in range(n + 10, n + 13):
        out += _svc(i, 2)
    out += _svc(n, 3, affinity_timeout=60)
    out += _svc(n + 1, 3, type="NodePort", node_ports=[30081], etp="Local")
    out += _svc(n + 2, 2, type="LoadBalancer", node_ports=[30082], lb_ips=["192.0.2.10"],
                source_ranges=["203.0.113.0/24", "198.51.100.0/24"])
    return out


class Commits(Recording):
    """Recording that calls `after(self)` after each accepted commit."""

    def __init__(self, version: str = "1.0.6") -> None:
        FakeBackend.__init__(self, version=version)
        self.sent: list[list[Mapping[str, Any]]] = []
        self.refuse_next: NftRejected | None = None
        self.refuse_at: int | None = None  # refuse the commit of this index in `sent`
        self.after: Callable[[Commits], None] = lambda _: None

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if commands and self.refuse_at == len(self.sent):
            self.refuse_at = None
            self.refuse_next = NftRejected("Could not process rule: Invalid argument")
        super().commit(commands, fresh=fresh)
        if commands:
            self.after(self)


def restarted(backend: Backend, objects: Sequence[Obj], chunk: int) -> Proxier:
    """A new Proxier (an agent restart) fed `objects`, ready to sync."""
    proxier = Proxier(CONFIG, backend, fresh_chunk=chunk)
    listed(proxier, *objects)
    return proxier


def old_table(backend: Backend, objects: Sequence[Obj]) -> None:
    restarted(backend, objects, 10**9).sync()


@pytest.fixture
def commits() -> Iterator[Commits]:
    with started(Commits()) as b:
        assert isinstance(b, Commits)
        yield b


def one_transaction(objects_before: Sequence[Obj], objects: Sequence[Obj],
                    version: str = "1.0.6", generation: str = "b"
                    ) -> tuple[str, Proxier, FakeBackend]:
    """The table, proxier and backend of a one-transaction restart sync,
    its choosers picking from the endpoints maps of `generation` (a restart
    in steps over a table of generation "a" fills "b")."""
    backend = Recording() if version == "1.0.6" else FakeBackend(version=version)
    backend.start()
    old_table(backend, objects_before)
    proxier = restarted(backend, objects, 10**9)
    for family in (IPFamily.IPV4, IPFamily.IPV6):
        proxier.table_state(family).generation = generation
    assert proxier.sync().full
    return listing(backend), proxier, backend


def record(proxier: Proxier) -> list[Any]:
    out = []
    for f in (IPFamily.IPV4, IPFamily.IPV6):
        s = proxier.table_state(f)
        out.append((s.fragments, s.chains, s.sets, s.rule_count, len(s.index),
                    s.stale_chains, s.stale_sets))
    return out


@pytest.mark.parametrize("version", ["1.0.6", "1.1"])
def test_a_restart_in_chunks_ends_in_the_one_transaction_table(version: str) -> None:
    want, single, other = one_transaction(old_cluster(), new_cluster(), version)
    with started(Commits(version)) as backend:
        assert isinstance(backend, Commits)
        old_table(backend, old_cluster())
        assert listing(backend) != want
        proxier = restarted(backend, new_cluster(), CHUNK)
        backend.sent.clear()
        report = proxier.sync()
        assert report.full and report.ops == sum(map(len, backend.sent))
        assert len(backend.sent) > 2  # in steps
        assert listing(backend) == want
        assert record(proxier) == record(single)
        # the record is right: a partial sync after it agrees with the other
        for p in (proxier, single):
            listed(p, *_svc(40, 2))
            assert not p.sync().full
        assert listing(backend) == listing(other)
    other.close()


def _size(commands: Sequence[Mapping[str, Any]]) -> int:
    """A transaction's size: its JSON text's (a command may hold many elements)."""
    return len(transaction_text(commands))


def test_it_goes_in_steps_none_near_the_single_transaction(commits: Commits) -> None:
    single = one_transaction(old_cluster(), new_cluster())[2]
    assert isinstance(single, Recording)
    whole = _size(single.sent[-1])
    old_table(commits, old_cluster())
    commits.sent.clear()
    restarted(commits, new_cluster(), CHUNK).sync()
    sizes = [_size(c) for c in commits.sent]
    # skeleton, 8 chunks of about 6 endpoints (16 services of 2-4), the final switch
    assert len(sizes) == 10, sizes
    # the skeleton step is the skeleton (its 2 x 192 shared choosers most of
    # it), nothing of the services
    empty = one_transaction([], [])[2]
    assert isinstance(empty, Recording)
    skeleton = _size(empty.sent[-1])
    assert sizes[0] <= skeleton, (sizes, skeleton)
    services = whole - skeleton
    # (the chunk of the affinity service's cascade is the largest)
    assert max(sizes[1:-1]) < services / 2, (sizes, services)
    # the final step deletes the old generation's 3 x 32 endpoints maps,
    # 3 vip-endpoints maps and 192 shared choosers of each family
    assert sizes[-1] < skeleton / 2, (sizes, skeleton)
    final = commits.sent[-1]
    assert not any("rule" in body for c in final for body in c.values())
    # before the final step, elements only of the new endpoints maps, with their choosers
    stepped = {body["element"]["name"] for step in commits.sent[:-1] for c in step
               for body in c.values() if "element" in body}
    # ... and of the new hairpin set
    shared = {"hairpin-endpoints-b", "vip-endpoints-tcp-b", "nodeport-endpoints-tcp-b",
              # eTP=Local external destinations' choosers (ruleset v8)
              "vip-local-endpoints-tcp-b", "nodeport-local-endpoints-tcp-b",
              "external-cluster-choosers-b", "external-local-choosers-b",
              "nodeport-cluster-choosers-b", "nodeport-local-choosers-b"}
    assert {"hairpin-endpoints-b", "vip-endpoints-tcp-b"} <= stepped
    # ... and of the pick trees' bit sets of the new generation (ruleset v10)
    shared |= {n for n in stepped if n.startswith(("shared-vips-b", "shared-nodeports-b"))}
    assert all(n.startswith("endpoints-tcp-b-") for n in stepped - shared)
    assert not any("element" in body and body["element"]["name"].startswith(
        ("endpoints-", "hairpin-", "vip-", "nodeport-")) for c in final for body in c.values())
    # the old generation's hairpin set is emptied in one command
    flushed = {body["set"]["name"] for c in final for verb, body in c.items()
               if verb == "flush" and "set" in body}
    assert {"hairpin-endpoints", "hairpin-endpoints-c"} <= flushed
    single.close()


def _objects(doc: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [next(iter(o.items())) for o in doc["nftables"]]


def _targets(doc: Mapping[str, Any]) -> set[str]:
    """Every chain a rule or a verdict-map element jumps or goes to."""
    text = json.dumps(doc)
    return {t for verb in ("goto", "jump")
            for t in _find(text, f'"{verb}": {{"target": "')}


def _find(text: str, prefix: str) -> Iterator[str]:
    start = text.find(prefix)
    while start >= 0:
        start += len(prefix)
        end = text.index('"', start)
        yield text[start:end]
        start = text.find(prefix, end)


def _dispatch(doc: Mapping[str, Any] | None) -> set[str]:
    """The keys of the service-ips map (one per cluster IP . proto . port)."""
    assert doc is not None
    for kind, obj in _objects(doc):
        if kind == "map" and obj["name"] == "service-ips":
            return {json.dumps(e[0], sort_keys=True) for e in obj.get("elem", [])}
    return set()


def test_every_intermediate_table_is_consistent(commits: Commits) -> None:
    old_table(commits, old_cluster())
    before = commits.list_table("ip", "nftproxy")
    assert before is not None
    old_keys = _dispatch(before)
    seen: list[set[str]] = []

    def check(b: Commits) -> None:
        doc = list_family(b.list_table, "ip", "nftproxy")  # the affinity table's too
        assert doc is not None
        chains = {o["name"] for kind, o in _objects(doc) if kind == "chain"}
        missing = _targets(doc) - chains
        assert not missing, missing
        seen.append(_dispatch(doc))

    commits.sent.clear()
    commits.after = check
    restarted(commits, new_cluster(), CHUNK).sync()
    assert len(seen) == len(commits.sent) > 2
    assert all(keys == old_keys for keys in seen[:-1])  # old services answer, no new one yet
    single = one_transaction(old_cluster(), new_cluster())[2]
    assert seen[-1] != old_keys and seen[-1] == _dispatch(single.list_table("ip", "nftproxy"))
    single.close()


def _affinity(b: FakeBackend) -> Mapping[str, Any]:
    doc = b.list_table("ip", "nftproxy-affinity")
    assert doc is not None
    (found,) = [o for kind, o in _objects(doc) if kind == "set" and o["name"] == "affinity"]
    return found


def test_the_affinity_set_keeps_its_clients_and_stays_dynamic() -> None:
    with started(Commits("1.1")) as backend:
        assert isinstance(backend, Commits)
        old_table(backend, old_cluster())
        assert "dynamic" in _affinity(backend)["flags"]
        clients = [{"elem": {"val": {"concat": ["10.0.9.9", 7, i]}, "timeout": 60}}
                   for i in range(3)]  # the datapath remembered a client of each endpoint
        backend.commit([{"add": {"element": {
            "family": "ip", "table": "nftproxy-affinity", "name": "affinity", "elem": clients}}}])
        backend.sent.clear()
        restarted(backend, new_cluster(), CHUNK).sync()
        assert len(backend.sent) > 2
        after = _affinity(backend)
        assert after.get("elem") == clients
        assert "dynamic" in after["flags"]


def restarts_in_one_transaction(commits: Commits, objects: Sequence[Obj]) -> None:
    """A restart over `commits`' table syncs `objects` in ONE transaction,
    to what a one-transaction restart makes."""
    commits.sent.clear()
    restarted(commits, objects, CHUNK).sync()
    assert len(commits.sent) == 1
    assert listing(commits) == one_transaction(old_cluster(), objects, generation="a")[0]


def test_a_redeclared_set_means_one_transaction(commits: Commits) -> None:
    """A listed skeleton set declared otherwise (`cluster-ips` as an
    interval set, as another ruleset might): one transaction re-declares it."""
    old_table(commits, old_cluster())
    table = {"family": "ip", "table": "nftproxy"}
    listed = commits.list_table("ip", "nftproxy") or {"nftables": []}
    users = sorted({o["rule"]["chain"] for o in listed["nftables"]
                    if "rule" in o and "@cluster-ips" in json.dumps(o)})
    assert "KUBE-CLUSTER-IPS-CHECK" in users  # and the shared choosers' masquerade rule
    commits.commit([
        *({"flush": {"chain": {**table, "name": name}}} for name in users),
        {"delete": {"set": {**table, "name": "cluster-ips"}}},
        {"add": {"set": {**table, "name": "cluster-ips", "type": "ipv4_addr",
                         "flags": ["interval"]}}},
    ])
    restarts_in_one_transaction(commits, new_cluster())


def test_a_changed_base_chain_hook_means_one_transaction(commits: Commits) -> None:
    old_table(commits, old_cluster())
    doc = commits.list_table("ip", "nftproxy")
    assert doc is not None
    (base,) = [o for kind, o in _objects(doc) if kind == "chain" and o.get("hook") == "input"]
    obj = {k: base[k] for k in ("family", "table", "name", "type", "hook")}
    commits.commit([{"flush": {"chain": obj}}, {"delete": {"chain": obj}},
                    {"add": {"chain": {**obj, "prio": base["prio"] + 1}}}])
    restarts_in_one_transaction(commits, new_cluster())


def test_a_table_of_another_layout_means_one_transaction(commits: Commits) -> None:
    """A set the skeleton does not declare (ruleset v1's `firewall-ips`), or
    a skeleton set missing (v2's `firewall-vips`), is another ruleset
    version: stepping would switch the skeleton onto sets the old service
    chains do not fill, so the table is rewritten at once."""
    old_table(commits, old_cluster())
    table = {"family": "ip", "table": "nftproxy"}
    commits.commit([{"add": {"map": {**table, "name": "firewall-ips",
                                     "type": "ipv4_addr", "map": "verdict"}}}])
    restarts_in_one_transaction(commits, new_cluster())


def test_an_older_rulesets_service_sets_go_in_steps(commits: Commits) -> None:
    """A table of ruleset v4 (unsharded `endpoints-tcp-a`) or v3 (a set per
    affinity endpoint), with a chain that still uses them: the restart goes
    in steps and its final step deletes them, ending in the one-transaction
    table."""
    want = one_transaction(old_cluster(), new_cluster())[0]
    old_table(commits, old_cluster())
    table = {"family": "ip", "table": "nftproxy"}
    commits.declare(["add map ip nftproxy endpoints-tcp-a { typeof numgen random mod 1 . "
                     "numgen random mod 1 . numgen random mod 1 : ip daddr . tcp dport; }"])
    old = {"concat": [{"numgen": {"mode": "random", "mod": 1, "offset": k}} for k in (1, 2, 0)]}
    commits.commit([
        {"add": {"set": {**table, "name": "KUBE-SEP-ABCDEFGHIJKLMNOP-affinity",
                         "type": "ipv4_addr", "flags": ["timeout"], "timeout": 60}}},
        {"add": {"chain": {**table, "name": "KUBE-SVC-ABCDEFGHIJKLMNOP"}}},
        {"add": {"rule": {**table, "chain": "KUBE-SVC-ABCDEFGHIJKLMNOP", "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                       "right": "@KUBE-SEP-ABCDEFGHIJKLMNOP-affinity"}},
            {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
            {"dnat": {"family": "ip", "addr": {"map": {"key": old,
                                                        "data": "@endpoints-tcp-a"}}}}]}}},
    ])
    commits.sent.clear()
    restarted(commits, new_cluster(), CHUNK).sync()
    assert len(commits.sent) > 2  # in steps
    assert listing(commits) == want


def test_a_table_of_ruleset_v8_goes_in_steps(commits: Commits) -> None:
    """Ruleset v8 had no affinity table, and the shared affinity set and the
    affinity ports' chains in the main table: the restart goes in steps
    (step 0 adds the affinity table, which nothing reaches before the final
    step puts the `accept` elements in the main table's maps), and the
    final step deletes the old set with the chains that used it."""
    want = one_transaction(old_cluster(), new_cluster())[0]
    old_table(commits, old_cluster())
    commits.commit([{"delete": {"table": {"family": f, "name": "nftproxy-affinity"}}}
                    for f in ("ip", "ip6")])
    table = {"family": "ip", "table": "nftproxy"}
    commits.declare(["add set ip nftproxy affinity { typeof ip saddr . numgen random mod 1 . "
                     "numgen random mod 1; flags dynamic, timeout; size 1048576; }"])
    key = {"concat": [{"payload": {"protocol": "ip", "field": "saddr"}},
                      *({"numgen": {"mode": "random", "mod": 1, "offset": k}} for k in (1, 2))]}
    commits.commit([
        {"add": {"chain": {**table, "name": "KUBE-SVC-ABCDEFGHIJKLMNOP"}}},
        {"add": {"rule": {**table, "chain": "KUBE-SVC-ABCDEFGHIJKLMNOP", "expr": [
            {"match": {"op": "==", "left": key, "right": "@affinity"}},
            {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
            {"dnat": {"family": "ip", "addr": "10.244.0.5", "port": 8080}}]}}},
    ])
    commits.sent.clear()
    restarted(commits, new_cluster(), CHUNK).sync()
    assert len(commits.sent) > 2  # in steps
    assert listing(commits) == want
    main = commits.list_table_objects("ip", "nftproxy")
    assert main is not None and "affinity" not in main.sets


def _as_ruleset_v9(backend: FakeBackend) -> None:
    """Turn each family's main table into what ruleset v9 wrote: no pick
    trees, no sets of theirs and no rule looking them up; each shared
    destination's verdict-map element a goto to its chooser."""
    for family in ("ip", "ip6"):
        doc = backend.list_table(family, "nftproxy")
        assert doc is not None
        table = {"family": family, "table": "nftproxy"}
        objs = _objects(doc)
        sets = {o["name"]: o.get("elem", []) for kind, o in objs if kind in ("set", "map")}
        cmds: list[Any] = []
        for chain in ("KUBE-SERVICES", "KUBE-NODEPORTS"):
            kept = [o for kind, o in objs if kind == "rule" and o["chain"] == chain
                    and "@shared-" not in json.dumps(o)]
            cmds.append({"flush": {"chain": {**table, "name": chain}}})
            cmds += [{"add": {"rule": {**table, "chain": chain, "expr": r["expr"],
                                       **({"comment": r["comment"]} if "comment" in r else {})}}}
                     for r in kept]
        for name, nodeport in (("service-ips", False), ("service-nodeports", True)):
            for key, verdict in sets[name]:
                if "continue" not in verdict:
                    continue
                val = key["elem"]["val"]
                target = picked_chooser(sets, val["concat"], nodeport=nodeport)
                cmds += [{"delete": {"element": {**table, "name": name, "elem": [val]}}},
                         {"add": {"element": {**table, "name": name,
                                              "elem": [[key, {"goto": {"target": target}}]]}}}]
        picks = [o["name"] for kind, o in objs if kind == "chain" and o["name"].startswith("pick-")]
        cmds += [{"flush": {"chain": {**table, "name": c}}} for c in picks]
        cmds += [{"delete": {"map": {**table, "name": f"shared-{k}-root"}}}
                 for k in ("vips", "nodeports")]
        cmds += [{"delete": {"chain": {**table, "name": c}}} for c in picks]
        cmds += [{"delete": {"set": {**table, "name": n}}} for n in sets
                 if n.startswith("shared-") and not n.endswith("-root")]
        # (no rule of v9 looked the root maps up: the pick rule is gone above)
        backend.commit(cmds)


def test_a_table_of_ruleset_v9_goes_in_steps(commits: Commits) -> None:
    """Ruleset v9 sent each shared destination to its chooser by a goto
    element, without the pick trees (ruleset v10): the restart goes in
    steps (step 0 adds the pick trees' sets and root maps, which the new
    skeleton rule finds empty, so the gotos serve until the final step
    switches them to `continue`) and ends in the one-transaction table.
    Traffic keeps being served in between (the intermediate tables are
    checked by test_every_intermediate_table_is_consistent's invariant)."""
    want = one_transaction(old_cluster(), new_cluster())[0]
    old_table(commits, old_cluster())
    _as_ruleset_v9(commits)
    v9 = commits.list_table("ip", "nftproxy")
    assert v9 is not None and "pick-vip-" not in json.dumps(v9)
    commits.sent.clear()
    restarted(commits, new_cluster(), CHUNK).sync()
    assert len(commits.sent) > 2  # in steps
    assert listing(commits) == want


def test_a_missing_skeleton_set_means_one_transaction(commits: Commits) -> None:
    old_table(commits, old_cluster())
    doc = commits.list_table("ip", "nftproxy")
    assert doc is not None
    table = {"family": "ip", "table": "nftproxy"}
    chains = {o["chain"] for kind, o in _objects(doc)
              if kind == "rule" and "@firewall-vips" in json.dumps(o)}
    assert chains, "the skeleton matches on firewall-vips"
    commits.commit([*({"flush": {"chain": {**table, "name": c}}} for c in sorted(chains)),
                    {"delete": {"set": {**table, "name": "firewall-vips"}}}])
    restarts_in_one_transaction(commits, new_cluster())


def test_a_refused_step_raises_and_the_next_sync_converges(commits: Commits) -> None:
    old_table(commits, old_cluster())
    commits.sent.clear()
    commits.refuse_at = 2  # the second chunk
    proxier = restarted(commits, new_cluster(), CHUNK)
    with pytest.raises(NftRejected):
        proxier.sync()
    assert len(commits.sent) == 3
    # The steps stopped, and with them the thread rendering the next chunk.
    assert not [t for t in threading.enumerate() if t.name.startswith("render-ahead")]
    report = proxier.sync()
    assert report.full and len(commits.sent) > 5  # in steps again: they fill generation "c"
    want = one_transaction(old_cluster(), new_cluster(), generation="c")[0]
    assert listing(commits) == want


class OldKernel(Commits):
    """A kernel < 6.2: deleting a chain in the transaction that flushes the
    map whose elements go to it fails with EBUSY."""

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        verbs = {(verb, next(iter(body))) for c in commands for verb, body in c.items()}
        if {("delete", "chain"), ("flush", "map")} <= verbs:
            self.sent.append(list(commands))
            raise NftBusy("Could not process rule: Device or resource busy")
        super().commit(commands, fresh=fresh)


def test_after_ebusy_the_final_step_leaves_chains_flushed_for_a_later_delete() -> None:
    with started(OldKernel()) as backend:
        assert isinstance(backend, OldKernel)
        old_table(backend, old_cluster())
        proxier = restarted(backend, new_cluster(), CHUNK)
        with pytest.raises(NftBusy):
            proxier.sync()
        sent = len(backend.sent)
        assert proxier.sync().full  # in steps again, the deletes deferred
        assert len(backend.sent) - sent > 2
        assert proxier.table_state(IPFamily.IPV4).stale_chains
        proxier.sync()  # deletes them first
        assert not proxier.table_state(IPFamily.IPV4).stale_chains
        want = one_transaction(old_cluster(), new_cluster(), generation="c")[0]
        assert listing(backend) == want  # "a" went with the old chains, "b" with the refused try
