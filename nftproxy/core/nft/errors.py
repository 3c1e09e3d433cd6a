"""Errors raised by the nftables backend, typed by what the caller does next.

Layer: nft (pure; no kernel access). One job: turn libnftables' error text
into one exception type per caller decision. Raised by every `Backend`
(nft/seam.py: kernel/libnftables.py and kernel/fake.py alike); caught by the
proxier.

Exception tree::

    NftError                  base of everything below
    ├── NftUnavailable        libnftables missing, or no context could be
    │                         created (e.g. the netns is gone). Fatal at start;
    │                         the original exception is chained (`from`).
    └── NftRejected           libnftables returned rc != 0; nothing of the
        │                     transaction was applied (it is atomic).
        │                     .kernel_message, .command_index, .command.
        │                     Other causes: a rendering bug -- log the
        │                     message, retry with a full sync after an interval.
        ├── NftNotFound       "No such file or directory" (ENOENT): a chain,
        │                     set, element or table we believed in is missing
        │                     (state drift) -> full sync from a fresh listing.
        ├── NftExists         "File exists" (EEXIST): e.g. a map element's
        │                     verdict changed without delete+add, or a set was
        │                     re-declared with other flags -> full sync.
        └── NftBusy           "Device or resource busy" (EBUSY): a deleted
                              chain/set is still referenced -> keep it flushed
                              and delete it in a later GC transaction.

Where the index comes from: libnftables 1.0.6 reports kernel errors as
`internal:0:0-0: Error: Could not process rule: <errno text>` with *no*
command index; only JSON parse errors name one ("Parsing command array at
index N failed"), so `command_index` is usually None
(docs/nft-python-notes.md §1).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from nftproxy.core.nft.jsontext import command_text

__all__ = [
    "NftBusy",
    "NftError",
    "NftExists",
    "NftNotFound",
    "NftRejected",
    "NftUnavailable",
    "rejection",
]


class NftError(Exception):
    """Base of all nftables backend errors."""


class NftUnavailable(NftError):
    """libnftables cannot be used: library missing or no context created."""


class NftRejected(NftError):
    """libnftables refused a transaction or command (rc != 0).

    `kernel_message` is libnftables' error text, verbatim. `command_index`
    is the 0-based index into the commands the caller passed, when
    libnftables named one; `command` is that command.
    """

    def __init__(
        self,
        kernel_message: str,
        command_index: int | None = None,
        command: Any = None,
    ) -> None:
        self.kernel_message = kernel_message
        self.command_index = command_index
        self.command = command
        super().__init__(kernel_message)

    def __str__(self) -> str:
        text = self.kernel_message
        if self.command_index is not None:
            shown = _shown(self.command)
            if len(shown) > 300:
                shown = shown[:297] + "..."
            text += f" [command {self.command_index}: {shown}]"
        return text


def _shown(command: Any) -> str:
    """A typed command as its JSON text; a raw JSON object (a list command) dumped."""
    if command is None:
        return "null"
    return json.dumps(command) if isinstance(command, Mapping) else command_text(command)


class NftNotFound(NftRejected):
    """ENOENT: an object the transaction names does not exist."""


class NftExists(NftRejected):
    """EEXIST: an object exists with a different definition or verdict."""


class NftBusy(NftRejected):
    """EBUSY: an object to delete is still referenced."""


_BY_ERRNO_TEXT: tuple[tuple[str, type[NftRejected]], ...] = (
    ("No such file or directory", NftNotFound),
    ("File exists", NftExists),
    ("Device or resource busy", NftBusy),
)
_INDEX = re.compile(r"at index (\d+)")


def rejection(
    kernel_message: str,
    commands: Sequence[Any] = (),
    *,
    first_index: int = 0,
) -> NftRejected:
    """The typed error for libnftables' error text.

    `first_index` is the position of `commands[0]` in the array libnftables
    parsed (1 when a metainfo object was prepended), so that "at index N"
    maps back to the caller's command. When the text carries several errno
    texts, the first one wins.
    """
    cls: type[NftRejected] = NftRejected
    first = len(kernel_message) + 1
    for text, kind in _BY_ERRNO_TEXT:
        pos = kernel_message.find(text)
        if 0 <= pos < first:
            cls, first = kind, pos
    index: int | None = None
    command: Any = None
    match = _INDEX.search(kernel_message)
    if match is not None:
        i = int(match.group(1)) - first_index
        if 0 <= i < len(commands):
            index, command = i, commands[i]
    return cls(kernel_message, index, command)
