"""The commands of one transaction, as typed values.

Layer: nft (pure). One job: say what a transaction does, object by object,
in values that are checked when built, so that both printers can write
every one of them (core/nft/nfttext.py: nft's syntax; core/nft/jsontext.py:
libnftables JSON). core/nft/ops.py `Table` builds them; the planner orders
them; a backend prints them with the printer chosen at start-up.

What is checked here: families, and names (nft's syntax cannot quote a name,
and the kernel refuses one of 256 bytes or more). Rule expressions are
core/rules/expr.py's statements, element keys are checked by
fragment.Element, and comments are made sayable by names.comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import NAME, BaseHook, Element, Key, Rule, SetDecl

__all__ = [
    "AddChain",
    "AddElements",
    "AddRule",
    "AddSet",
    "AddTable",
    "Command",
    "CommandError",
    "DeleteChain",
    "DeleteElements",
    "DeleteSet",
    "DeleteTable",
    "FlushChain",
    "FlushSet",
    "Where",
    "check_name",
]

FAMILIES = ("ip", "ip6", "inet")
"""nftproxy writes ip and ip6 tables; tests also make inet ones, as other programs do."""


class CommandError(ValueError):
    """A command no printer could write, or the kernel would refuse."""


def check_name(name: str) -> str:
    """`name` if nft's syntax can say it and the kernel takes it."""
    if not NAME.match(name) or len(name.encode()) >= names.NAME_MAX:
        raise CommandError(f"invalid nftables object name {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class Where:
    """The table an object lives in."""

    family: str
    table: str

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise CommandError(f"family {self.family!r}")
        check_name(self.table)


@dataclass(frozen=True, slots=True)
class AddTable:
    """Add a table; `create`: refused (EEXIST) if it exists, which `add` is not."""

    where: Where
    comment: str | None = None
    create: bool = False

    def __post_init__(self) -> None:
        if self.comment is not None:
            names.check_comment(self.comment)


@dataclass(frozen=True, slots=True)
class DeleteTable:
    where: Where


@dataclass(frozen=True, slots=True)
class AddChain:
    where: Where
    name: str
    hook: BaseHook | None = None
    comment: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.comment is not None:
            names.check_comment(self.comment)


@dataclass(frozen=True, slots=True)
class FlushChain:
    where: Where
    name: str

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True)
class DeleteChain:
    where: Where
    name: str

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True)
class AddRule:
    where: Where
    chain: str
    rule: Rule

    def __post_init__(self) -> None:
        check_name(self.chain)
        if self.rule.comment is not None:
            names.check_comment(self.rule.comment)


@dataclass(frozen=True, slots=True)
class AddSet:
    """Declare a set or map (by typeof: the form both userspaces list)."""

    where: Where
    name: str
    decl: SetDecl

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.decl.key:
            raise CommandError(f"{self.name}: a declaration needs its key's selectors")
        if self.decl.comment is not None:
            names.check_comment(self.decl.comment)

    @property
    def kind(self) -> str:
        return "map" if self.decl.map else "set"


@dataclass(frozen=True, slots=True)
class FlushSet:
    where: Where
    name: str
    is_map: bool = False

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True)
class DeleteSet:
    where: Where
    name: str
    is_map: bool = False

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True)
class AddElements:
    """Add elements (fragment.Element: keys checked when built) to a set or map."""

    where: Where
    name: str
    elements: tuple[Element, ...]

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.elements:
            raise CommandError(f"{self.name}: no elements to add")


@dataclass(frozen=True, slots=True)
class DeleteElements:
    where: Where
    name: str
    keys: tuple[Key, ...]

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.keys:
            raise CommandError(f"{self.name}: no elements to delete")


Command: TypeAlias = (
    AddTable
    | DeleteTable
    | AddChain
    | FlushChain
    | DeleteChain
    | AddRule
    | AddSet
    | FlushSet
    | DeleteSet
    | AddElements
    | DeleteElements
)
