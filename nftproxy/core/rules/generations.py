"""Names of the objects that come in generations, and their shards.

Layer: rules (pure). One job: name the sets, maps and chains a full sync in
steps (core/nft/resync.py) fills for a generation the table does not hold --
the endpoints maps (sharded), the vip-endpoints and nodeport-endpoints
maps and the shared choosers (rules/dispatch.py), the hairpin sets -- and
tell a listed name's generation. rules/skeleton.py declares them (and
re-exports these names).
"""

from __future__ import annotations

from nftproxy.core.model import L4Protocol
from nftproxy.core.rules import dispatch, picks

__all__ = [
    "ENDPOINTS",
    "ENDPOINTS_SHARDS",
    "GENERATIONS",
    "HAIRPIN_ENDPOINTS",
    "chain_generation",
    "endpoints_generation",
    "endpoints_map",
    "endpoints_shard",
    "generation_of",
    "hairpin_set",
    "is_choosers_map",
    "is_endpoints_map",
    "is_external_local_chain",
    "is_hairpin_set",
    "is_indexed_map",
    "is_pick_chain",
    "is_unsharded_endpoints_map",
]

ENDPOINTS = "endpoints"
HAIRPIN_ENDPOINTS = "hairpin-endpoints"
GENERATIONS = ("a", "b", "c")
"""The endpoints maps, the shared choosers with their maps and the hairpin
sets come in generations: a full sync over an existing table
(core/nft/resync.py) fills one the table does not hold, chunk by chunk, so
a chain and the elements it picks from are always written in the same
transaction, and no transaction carries every hairpin element. Three, so
that one is free after a resync cut short."""


ENDPOINTS_SHARDS = 32
"""Each protocol's endpoints map comes in this many shards, a chain's by its
key (`endpoints_shard`): when a commit adds a rule that looks up a data map
from a chain that does not look it up yet (a new chooser), the kernel walks
every element of that map (nf_tables_bind_set), ~0.25 us each: 25 ms of
adding one service at 10,000 x 10 with one map of 100,000 elements, under
1 ms with a shard's ~3,000 (bench/RESULTS.md, fourth pass)."""


def endpoints_shard(fixed: tuple[int, int]) -> int:
    """The shard of the endpoints map that holds a chooser's elements, by
    its key (names.endpoints_key: uniform)."""
    return fixed[0] % ENDPOINTS_SHARDS


def endpoints_map(protocol: L4Protocol, generation: str, shard: int) -> str:
    """endpoints-tcp-a-07: one map per protocol (libnftables 1.0.6's JSON
    refuses a rule whose protocol differs from the map's `tcp dport`),
    generation and shard."""
    return f"{ENDPOINTS}-{protocol.nft}-{generation}-{shard:02}"


_GENERATION_OF = {
    endpoints_map(p, g, k): g
    for p in L4Protocol
    for g in GENERATIONS
    for k in range(ENDPOINTS_SHARDS)
}


def endpoints_generation(name: str) -> str | None:
    """The generation of endpoints map `name` (None: not one)."""
    return _GENERATION_OF.get(name)


def is_endpoints_map(name: str) -> bool:
    return name in _GENERATION_OF


_INDEXED = frozenset(
    [
        *_GENERATION_OF,
        *(
            name(p, g, local=local)
            for name in (dispatch.vip_endpoints_map, dispatch.nodeport_endpoints_map)
            for local in (False, True)
            for p in L4Protocol
            for g in GENERATIONS
        ),
    ]
)


def is_indexed_map(name: str) -> bool:
    """Whether `name` maps a chooser's key . endpoint index -> endpoint (an
    endpoints map, or a shared chooser's vip-/nodeport-endpoints map): its
    keys end in the index 0..N-1 of the chooser's N endpoints."""
    return name in _INDEXED


def hairpin_set(generation: str) -> str:
    """The hairpin set a generation's elements go to: hairpin-endpoints
    (generation a, the name of rulesets v2-v5), hairpin-endpoints-b, -c.
    KUBE-POSTROUTING looks up all three, so a resync in steps fills a new
    one while the old one still serves, and its final step flushes the old
    one: no step carries every endpoint's element (core/nft/resync.py)."""
    if generation == GENERATIONS[0]:
        return HAIRPIN_ENDPOINTS
    return f"{HAIRPIN_ENDPOINTS}-{generation}"


_FILLED_IN_STEPS = {
    **_GENERATION_OF,
    **{hairpin_set(g): g for g in GENERATIONS},
    **dispatch.generation_maps(GENERATIONS),
    **picks.generation_sets(GENERATIONS),
}


def generation_of(name: str) -> str | None:
    """The generation of a set that comes in generations (an endpoints map,
    a vip-endpoints or nodeport-endpoints map, a hairpin set), None for any
    other: the sets a resync in steps fills chunk by chunk."""
    return _FILLED_IN_STEPS.get(name)


_PICK_CHAINS = {name: g for g in GENERATIONS for name in picks.pick_chain_names(g)}
_CHAIN_GENERATION = {**dispatch.generation_chains(GENERATIONS), **_PICK_CHAINS}


def chain_generation(name: str) -> str | None:
    """The generation of a skeleton chain that comes in generations (a
    shared chooser, rules/dispatch.py), None for any other."""
    return _CHAIN_GENERATION.get(name)


_EXTERNAL_LOCAL = frozenset(
    name(g) for name in (dispatch.external_local_chain, dispatch.nodeport_local_chain)
    for g in GENERATIONS
)


def is_external_local_chain(name: str) -> bool:
    """Whether `name` is a generation's external-local or nodeport-local
    chain: what KUBE-EXT does for every eTP=Local port (rules/dispatch.py)."""
    return name in _EXTERNAL_LOCAL


def is_pick_chain(name: str) -> bool:
    """Whether `name` is a chain of a generation's pick tree (rules/picks.py)."""
    return name in _PICK_CHAINS


_CHOOSERS_MAPS = frozenset(
    dispatch.choosers_map(g, nodeport=nodeport, local=local)
    for g in GENERATIONS
    for nodeport in (False, True)
    for local in (False, True)
)


def is_choosers_map(name: str) -> bool:
    """Whether `name` is one of a generation's four verdict maps from an
    eTP=Local destination to its cluster or local chooser (rules/dispatch.py)."""
    return name in _CHOOSERS_MAPS


_HAIRPIN_SETS = frozenset(hairpin_set(g) for g in GENERATIONS)


def is_hairpin_set(name: str) -> bool:
    return name in _HAIRPIN_SETS


_UNSHARDED = frozenset(f"{ENDPOINTS}-{p.nft}-{g}" for p in L4Protocol for g in GENERATIONS)


def is_unsharded_endpoints_map(name: str) -> bool:
    """Whether `name` is an endpoints map of rulesets v3 and v4 (one per
    protocol and generation, endpoints-tcp-a): a listed leftover that the
    resync deletes once no chain picks from it."""
    return name in _UNSHARDED
