"""What the planner records of a commit, and how it batches elements
(nftproxy.core.nft.plan; the helpers are test_plan's).

Aspects:
- the record of a chain is a 16-byte digest, its size and the sets its
  rules reference -- never its rules; a different rule, even only its
  comment, is a different digest and rewrites the chain;
- an owner's elements are recorded packed, a fraction of their objects'
  size, and read back exactly as rendered (verdicts, DNAT targets, plain
  keys, comments);
- elements go in large batches: a full sync sends one `add element` per set,
  a partial sync of many owners one `add element` and one `delete element`
  per set, however many elements and owners.
"""

from __future__ import annotations

import marshal
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from builders import chain_of, endpoint, service_port
from test_plan import (
    AFFINITY,
    CHAINED,
    EP1,
    EP2,
    SKEL,
    SVC1,
    _ops,
    apply,
    commands_of,
    frag,
    fresh,
    partial,
    table,
)

from nftproxy.core.model import LoadBalancerIngress, ServicePort, TrafficPolicy
from nftproxy.core.nft.plan import SKELETON, Owner, stage_full
from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import (
    COMPRESS_FROM,
    Element,
    Fragment,
    Json,
    Rule,
    Target,
    Verdict,
    affinity_table_name,
    compact,
    pack_elements,
    unpack_elements,
)


def test_a_chain_is_recorded_as_a_digest_its_size_and_the_sets_it_uses() -> None:
    rendered = frag(AFFINITY, [EP1, EP2])
    state, _ = table(0, svc1=rendered)
    # a port with ClientIP affinity: its chains are the affinity table's,
    # and so is the set its rules name
    svc = affinity_table_name(names.service_chain(SVC1.name))
    record, chain = state.chains[svc], chain_of(rendered, svc)
    assert (record.name, record.hook, record.size) == (svc, None, len(chain.rules))
    assert isinstance(record.digest, bytes) and len(record.digest) == 16
    assert record.refs == ("affinity:affinity",)
    held = [getattr(record, f) for f in record.__slots__]
    assert sum(sys.getsizeof(v) for v in held) < 400  # the rules' JSON alone is > 1 KB
    skeleton_refs = {s for c in SKEL.chains for s in state.chains[c.name].refs}
    assert {"service-ips", "hairpin-endpoints"} <= skeleton_refs


def test_an_owners_elements_are_recorded_packed_and_read_back_as_rendered() -> None:
    rendered = frag(replace(SVC1, node_port=30080), [EP1, EP2])
    state, _ = table(0, svc1=rendered)
    record = state.fragments[SVC1.name]
    assert isinstance(record.packed, bytes)
    assert record.elements == rendered.elements
    values = {type(e.value) for e in rendered.elements}
    assert {Verdict, Target, type(None)} <= values  # every kind of value went through
    objects = sum(sys.getsizeof(e) + sys.getsizeof(e.key) + sys.getsizeof(e.comment or "")
                  for e in rendered.elements)
    assert len(record.packed) < objects / 2


def test_records_of_two_renders_of_one_port_are_the_same() -> None:
    port = replace(SVC1, node_port=30080)
    rendered, again = frag(port, [EP1, EP2]), frag(port, [EP1, EP2])
    assert rendered.elements[0] is not again.elements[0]  # two renders, equal
    assert compact(again) == compact(rendered)
    other = replace(rendered, elements=(*rendered.elements[:-1], replace(
        rendered.elements[-1], comment="another comment")))
    assert compact(other) != compact(rendered)


def test_packing_keeps_every_field_and_type() -> None:
    elements = (
        Element("service-ips", ("10.96.0.10", "tcp", 80), Verdict("goto", "dispatch-tcp-2"), "a"),
        Element("no-endpoint-services", ("fd00::1", "udp", 53), Verdict("drop")),
        Element("vip-endpoints-tcp", (2**32 - 1, 2**31 + 1, 0), Target("fd00::5", 8443)),
        Element("hairpin-endpoints", ("10.1.0.1", "10.1.0.1")),
        Element("firewall-allow", ("192.0.2.0/24",), None, "x" * 128),
    )
    back = unpack_elements(pack_elements(elements))
    assert back == elements
    assert [type(v) for e in back for v in e.key] == [type(v) for e in elements for v in e.key]
    assert unpack_elements(pack_elements(())) == ()


def test_a_large_record_is_compressed_and_reads_back_the_same() -> None:
    elements = tuple(
        Element("vip-endpoints-tcp", ("10.96.0.10", 80, i), Target(f"10.244.0.{i}", 8080),
                f"ns/web:http -> 10.244.0.{i}:8080 KUBE-SEP-{i:016d}")
        for i in range(40)
    )
    small = elements[:2]
    big_packed, small_packed = pack_elements(elements), pack_elements(small)
    assert unpack_elements(big_packed) == elements and unpack_elements(small_packed) == small
    assert len(small_packed) < COMPRESS_FROM < len(marshal.dumps([e.comment for e in elements]))
    assert len(big_packed) < COMPRESS_FROM  # 40 elements in less than 1 KB
    assert pack_elements(elements) == big_packed  # deterministic: records compare by bytes


def test_a_rule_that_differs_only_in_its_comment_rewrites_the_chain() -> None:
    rendered = frag(CHAINED, [EP1, EP2])
    state, kernel = table(0, svc1=rendered)
    bare = names.service_chain(SVC1.name)
    svc = affinity_table_name(bare)  # ClientIP affinity: the affinity table's chain
    chain = chain_of(rendered, svc)
    renamed = replace(chain, rules=(*chain.rules[:-1], Rule(chain.rules[-1].expr, "other")))
    changed = replace(rendered, chains=tuple(renamed if c.name == svc else c
                                             for c in rendered.chains))
    commands = partial(state, kernel, {SVC1.name: changed})
    assert commands_of(commands, "flush", "chain") == [bare]
    assert commands_of(commands, "add", "rule") == [bare] * len(chain.rules)
    assert state.chains[svc].digest != table(0, svc1=rendered)[0].chains[svc].digest


# --- batches -------------------------------------------------------------------------------


def many(n: int, first: int = 0, *, endpoints: int = 2) -> dict[Owner, Fragment]:
    """`n` services of every external kind, with `endpoints` endpoints each."""
    out: dict[Owner, Fragment] = {}
    for i in range(first, first + n):
        port: ServicePort = service_port(f"svc{i}", ns="many", cluster_ip=f"172.29.0.{i + 1}")
        if i % 2:
            port = replace(port, node_port=30000 + i, external_ips=(f"192.168.99.{i}",),
                           load_balancer_ingress=(LoadBalancerIngress(f"1.2.3.{i}"),),
                           load_balancer_source_ranges=("203.0.113.0/25",),
                           external_traffic_policy=TrafficPolicy.LOCAL)
        eps = [endpoint(f"10.182.{i}.{j + 1}", local=j == 0) for j in range(endpoints)]
        out[port.name] = frag(port, eps)
    return out


def _element_commands(commands: Sequence[Json], verb: str) -> Counter[str]:
    return Counter(name for v, k, name, _ in _ops(commands) if (v, k) == (verb, "element"))


def test_a_full_sync_sends_one_add_element_command_per_set() -> None:
    state, kernel = fresh({SKELETON: SKEL})
    desired = {SKELETON: SKEL, **many(60)}
    commands = apply(state, kernel, stage_full(state, None, desired), desired, full=True)
    adds = _element_commands(commands, "add")
    assert adds and set(adds.values()) == {1}
    sent = sum(len(spec["elem"]) for v, k, _, spec in _ops(commands)
               if (v, k) == ("add", "element"))
    static = sum(len(d.elements) for d in state.sets.values())
    assert sent == len(state.index) + static > 60 * 5


def test_a_partial_sync_of_many_owners_groups_elements_by_set() -> None:
    state, kernel = fresh({SKELETON: SKEL, **many(40)})
    changes: dict[Owner, Fragment | None] = {**many(20, endpoints=3), **many(10, 40)}
    changes.update({owner: None for owner in list(many(10, 20))})
    commands = partial(state, kernel, changes)
    for verb in ("add", "delete"):
        counted = _element_commands(commands, verb)
        assert counted and set(counted.values()) == {1}, verb
