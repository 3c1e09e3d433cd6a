"""The pick trees: from a shared destination's endpoint count to its chooser.

Layer: rules (pure). One job: the names, the skeleton objects and a port's
elements of ruleset v10's pick trees (the shared choosers themselves are
rules/dispatch.py's).

A destination's element in `service-ips` / `service-nodeports` is a goto to
its shared chooser, and a commit that adds a goto element makes the kernel
re-validate the table's whole chain graph, walking every goto element of
those maps (~9,500 at 10k x 10: most of adding a service). So a partial
sync (service.RenderContext.pick_trees) writes the element as `continue`
(same key, same comment), makes the destination an element of the plain
set `shared-vips-<g>` / `shared-nodeports-<g>`, and spells its count N by
its membership in `<set>-bit0`..`-bit5` (the bits of N - 1). A plain
element is never validated (nor is deleting a goto element), so adding,
changing or deleting such a destination is elements only; the next full
sync writes the goto again, so only what changed since pays the tree's
lookups per new connection. The sets come in the table's generation, as
the choosers and endpoints maps they lead to. After the map, one skeleton
rule jumps through the root map (`meta l4proto` -> the generation's tree
root: the generation switches with the root's elements, as the dispatch
maps switch at a resync's final step); the root returns what is not a
member, and a member goes down a binary tree of 63 chains, one set lookup
per level, to dispatch-<proto>-<g>-N:

  KUBE-SERVICES:  meta l4proto vmap @shared-vips-root        (tcp : jump pick-vip-a)
  pick-vip-a:     ip daddr . l4proto . dport != @shared-vips-a return
                  ip daddr . l4proto . dport @shared-vips-a-bit5 goto pick-vip-a-1
                  goto pick-vip-a-0
  ...
  pick-vip-a-01001 (bits 5..1 decided):
                  meta l4proto tcp ... @shared-vips-a-bit0 goto dispatch-tcp-a-20
                  meta l4proto tcp goto dispatch-tcp-a-19   (and udp, sctp)
"""

from __future__ import annotations

from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.rules import expr
from nftproxy.core.rules.dispatch import (
    DISPATCH_MAX,
    PROTO_PORT,
    dispatch_chain,
    nodeport_dispatch_chain,
)
from nftproxy.core.rules.fragment import Chain, Element, Json, Key, Rule, SetDecl

__all__ = [
    "COUNT_BITS",
    "count_bit_set",
    "count_bits",
    "count_of",
    "generation_sets",
    "pick_chain",
    "pick_chain_names",
    "pick_chains",
    "root_map",
    "root_maps",
    "selector_elements",
    "selector_rule",
    "selector_sets",
    "shared_set",
    "tree_sets",
]

COUNT_BITS = (DISPATCH_MAX - 1).bit_length()
"""A count 1..DISPATCH_MAX is spelled by the bits of count - 1 (six)."""

_BOTH = (False, True)


def _shared(nodeport: bool) -> str:
    return "shared-nodeports" if nodeport else "shared-vips"


def shared_set(generation: str, *, nodeport: bool) -> str:
    """shared-vips-a / shared-nodeports-a: the destinations that go through
    the generation's pick tree."""
    return f"{_shared(nodeport)}-{generation}"


def count_bit_set(bit: int, generation: str, *, nodeport: bool) -> str:
    """shared-vips-a-bit3: the destinations whose count - 1 has bit 3 set
    (the generation's, as the choosers the tree leads to)."""
    return f"{shared_set(generation, nodeport=nodeport)}-bit{bit}"


def root_map(*, nodeport: bool) -> str:
    """shared-vips-root: meta l4proto -> jump to the generation's pick tree."""
    return f"{_shared(nodeport)}-root"


def pick_chain(generation: str, prefix: str = "", *, nodeport: bool) -> str:
    """pick-vip-a (the root), pick-vip-a-10 (bits 5 and 4 decided: 1, 0) ..."""
    kind = "nodeport" if nodeport else "vip"
    return f"pick-{kind}-{generation}" + (f"-{prefix}" if prefix else "")


def count_bits(count: int) -> tuple[int, ...]:
    """The bits of count - 1 (1 <= count <= DISPATCH_MAX), lowest first."""
    return tuple(b for b in range(COUNT_BITS) if (count - 1) >> b & 1)


def count_of(bits: tuple[int, ...] | list[int]) -> int:
    """The count whose `count_bits` are `bits`."""
    return 1 + sum(1 << b for b in bits)


def selector_elements(key: Key, count: int, generation: str, *, nodeport: bool) -> list[Element]:
    """A destination's elements of the pick tree's sets: its membership and
    the bits of its count in the generation's bit sets (no comments: the
    dispatch map's `continue` element carries the port's name)."""
    return [
        Element(shared_set(generation, nodeport=nodeport), key),
        *(
            Element(count_bit_set(b, generation, nodeport=nodeport), key)
            for b in count_bits(count)
        ),
    ]


def _tree_key(family: IPFamily, nodeport: bool) -> Json:
    return expr.concat_proto_dport() if nodeport else expr.concat_daddr_proto_dport(family)


def selector_rule(*, nodeport: bool) -> Rule:
    """The rule after the dispatch map: jump to the generation's pick tree
    (the root map's element), whose root returns what is not a member."""
    root = expr.vmap({"meta": {"key": "l4proto"}}, root_map(nodeport=nodeport))
    what = "node ports" if nodeport else "VIPs"
    return Rule((root,), f"{what} of shared choosers: by endpoint count")


def selector_sets(family: IPFamily, generation: str) -> tuple[SetDecl, ...]:
    """Per kind: the generation's membership set and count bits, and the
    root map (its elements name the generation's tree root)."""
    out: list[SetDecl] = []
    for nodeport in _BOTH:
        key = PROTO_PORT if nodeport else (f"{family.nft_family} daddr", *PROTO_PORT)
        what = "node port" if nodeport else "VIP"
        out.append(
            SetDecl.keyed(
                shared_set(generation, nodeport=nodeport),
                key,
                comment=f"{what}s of the shared choosers",
            )
        )
        out += [
            SetDecl.keyed(
                count_bit_set(b, generation, nodeport=nodeport),
                key,
                comment=f"{what}s: endpoints - 1, bit {b}",
            )
            for b in range(COUNT_BITS)
        ]
        root = {"jump": {"target": pick_chain(generation, nodeport=nodeport)}}
        out.append(
            SetDecl.keyed(
                root_map(nodeport=nodeport),
                ("meta l4proto",),
                map="verdict",
                elements=tuple([p.nft, root] for p in L4Protocol),
                comment=f"{what}s of the shared choosers: the generation's pick tree",
            )
        )
    return tuple(out)


def _not_member(key: Json, generation: str, nodeport: bool) -> Rule:
    """The tree root's first rule: what is not a destination of the
    generation's shared choosers goes back to KUBE-SERVICES / KUBE-NODEPORTS."""
    outside = expr.match(key, "@" + shared_set(generation, nodeport=nodeport), "!=")
    return Rule((outside, expr.ret()), "not a destination of the shared choosers")


def _prefixes() -> list[str]:
    """The tree's nodes: the bits decided so far, highest first ("" is the root)."""
    return [format(v, f"0{n}b") if n else "" for n in range(COUNT_BITS) for v in range(1 << n)]


def pick_chains(family: IPFamily, generation: str) -> tuple[Chain, ...]:
    """The generation's pick trees: a node tests the next bit (highest
    first) and goes down; the last level tests bit 0 and goes to the
    chooser of its protocol and count."""
    out: list[Chain] = []
    for nodeport in _BOTH:
        key = _tree_key(family, nodeport)
        for prefix in _prefixes():
            bit = COUNT_BITS - 1 - len(prefix)
            member = expr.match(key, "@" + count_bit_set(bit, generation, nodeport=nodeport))
            if bit:
                rules = [] if prefix else [_not_member(key, generation, nodeport)]
                rules += _node_rules(member, prefix, generation, nodeport)
            else:
                rules = _leaf_rules(member, prefix, generation, nodeport)
            out.append(Chain(pick_chain(generation, prefix, nodeport=nodeport), tuple(rules)))
    return tuple(out)


def _node_rules(member: Json, prefix: str, generation: str, nodeport: bool) -> list[Rule]:
    """A node above the last level: down to `prefix`1 when the bit is set, else `prefix`0."""
    def child(bit: str) -> Json:
        return expr.goto(pick_chain(generation, prefix + bit, nodeport=nodeport))

    return [Rule((member, child("1"))), Rule((child("0"),))]


def _leaf_rules(member: Json, prefix: str, generation: str, nodeport: bool) -> list[Rule]:
    """A node of the last level: per protocol, to the chooser of the count
    with bit 0 set when it is, else to the one without."""
    leaf = nodeport_dispatch_chain if nodeport else dispatch_chain
    high = int(prefix + "1", 2) + 1
    rules: list[Rule] = []
    for p in L4Protocol:
        proto = expr.l4proto(p)
        rules += [
            Rule((proto, member, expr.goto(leaf(p, generation, high))), f"{high} endpoints"),
            Rule((proto, expr.goto(leaf(p, generation, high - 1))), f"{high - 1} endpoints"),
        ]
    return rules


def root_maps() -> frozenset[str]:
    """The pick trees' root maps (the only part not per generation)."""
    return frozenset(root_map(nodeport=nodeport) for nodeport in _BOTH)


def pick_chain_names(generation: str) -> list[str]:
    """Every pick tree chain of the generation."""
    return [pick_chain(generation, p, nodeport=n) for n in _BOTH for p in _prefixes()]


def generation_sets(generations: tuple[str, ...]) -> dict[str, str]:
    """Every membership and count bit set of the trees -> its generation."""
    return {
        name: g
        for nodeport in _BOTH
        for g in generations
        for name in tree_sets(g, nodeport=nodeport)
    }


def tree_sets(generation: str, *, nodeport: bool) -> tuple[str, ...]:
    """The generation's membership set and count bit sets of one kind."""
    bits = (count_bit_set(b, generation, nodeport=nodeport) for b in range(COUNT_BITS))
    return (shared_set(generation, nodeport=nodeport), *bits)
