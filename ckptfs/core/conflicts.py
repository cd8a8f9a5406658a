"""Conflicts keep bytes under a visible name (decision 0016): when another node's object
holds the name this node's directory or file version was meant for, and writing over it
would drop what that node was told is saved, this node's object moves -- on this node
-- to ``NAME.ckptfs-conflict-<node>`` and reaches the store there.

Knows the namespace and the log line; nothing of the store, publishing or FUSE.
"""

from __future__ import annotations

import logging

from ..meta.namespace import Inode
from .state import CoreState

log = logging.getLogger(__name__)


class NameTaken(Exception):
    """The name holds another node's object this one must not join or write over."""


def keep_under_own_name(st: CoreState, inode: Inode, why: str, what: str) -> bytes:
    """Move ``inode`` to a free ``NAME.ckptfs-conflict-<node>[-n]`` in its directory
    (said once, as a WARNING) and return the new name; the caller saves nothing more."""
    base = inode.name + b".ckptfs-conflict-" + st.leases.node_id.encode()[:12]
    name, n = base, 1
    while st.ns.lookup(inode.parent, name) is not None:
        n += 1
        name = base + b"-" + str(n).encode()
    log.warning("%s: %s; this node's %s is kept as %s", st._path_for_log(inode), why, what,
                name.decode(errors="replace"))
    st.ns.move(inode, inode.parent, name)
    st._touch_dir(inode.parent)
    return name
