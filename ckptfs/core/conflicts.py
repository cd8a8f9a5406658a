"""Conflicts keep bytes under a visible name (decision 0016): when another node's object
holds the name this node's directory or file version was meant for, and writing over it
would drop what that node was told is saved, this node's object moves -- on this node
-- to ``NAME.ckptfs-conflict-<node>`` and reaches the store there.

Knows the namespace and the log line; nothing of the store, publishing or FUSE.
"""

from __future__ import annotations

import logging
from typing import Any

from ..meta.namespace import Inode
from .state import CoreState

log = logging.getLogger(__name__)


class NameTaken(Exception):
    """The name holds another node's object this one must not join or write over;
    ``link``: the shared inode object a link entry there names (a save may write that
    file through the name, as on the node that linked it)."""

    def __init__(self, why: str, link: str | None = None,
                 found: tuple[Any, str] | None = None) -> None:
        super().__init__(why)
        self.link = link
        self.found = found      # (entry, ETag) found there, where the step read it


# A conflict name the store refuses too (another node's object there, unknown here):
# this many further names are tried before the step fails with EIO.
CONFLICT_NAMES = 16


def keep_under_own_name(st: CoreState, inode: Inode, why: str, what: str, *,
                        name_of: bytes | None = None, first: int = 1) -> bytes:
    """Move ``inode`` to a free ``NAME.ckptfs-conflict-<node>[-n]`` in its directory
    (said once, as a WARNING) and return the new name; the caller saves nothing more.
    ``name_of``: the name the conflict is about (default: the inode's own); ``first``:
    the first ``n`` to try (the ones before it were refused by the store)."""
    base = (name_of or inode.name) + b".ckptfs-conflict-" + st.leases.node_id.encode()[:12]

    def numbered(n: int) -> bytes:
        return base if n == 1 else base + b"-" + str(n).encode()
    n = first
    while st.ns.lookup(inode.parent, numbered(n)) is not None:
        n += 1
    name = numbered(n)
    log.warning("%s: %s; this node's %s is kept as %s", st._path_for_log(inode), why, what,
                name.decode(errors="replace"))
    st.ns.move(inode, inode.parent, name)
    st._touch_dir(inode.parent)
    return name


def records_follow(st: CoreState, ino: int, dir_id: str, old: bytes, new: bytes,
                   after: int = 0) -> None:
    """Pending log records of ``ino`` (after ``after``) naming it as ``old`` in
    ``dir_id`` now name it ``new``: it moved there on this node without a record of
    its own (a conflict), and they must find it where it is."""
    for seq, record in list(st.oplog.pending.items()):
        if seq > after and record.get("ino") == ino and record.get("name") == old.hex() \
                and st.oplog.resolve(record.get("parent_id", "")) == dir_id:
            st.oplog.update(seq, {**record, "name": new.hex()})
