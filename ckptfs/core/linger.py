"""A file a rename replaced stays openable a moment, nameless, before it goes.

rename(2) replaces a name atomically, and an open that resolved the name just before
reaches the replaced inode.  The daemon dropped that inode at once (nobody had it open)
and answered such an open ESTALE, for the kernel to look the name up again -- which it
does once: a reader opening ``latest.pt`` while a trainer ``os.replace``-d new saves onto
it got ESTALE back whenever a second replace came within that retry (an async mount, one
writer: 20 in 17 032 opens; four writers: 247 in 11 827).  Now the replaced inode lingers
``REPLACED_LINGER`` seconds: an open of it for reading gets the version it had -- the
order "open, then rename" that the lookup already took -- and it goes once nobody has it
open (the last release of a nameless inode deletes it, ``release.py``, once the
linger is over).  A writer still
gets ESTALE, and so the file the name has now.

Knows the namespace and which inodes are open; nothing of the store, FUSE or the log.
A daemon that stops meanwhile leaves the inode nameless: the next start drops it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..meta.namespace import Inode
from .state import CoreState

# Far longer than the moment between a path walk's lookup and its open, even on a
# loaded node; short enough that a replaced version's staging file is not kept long.
REPLACED_LINGER = 2.0


def linger_then_delete(st: CoreState, inode: Inode,
                       delete_inode: Callable[[Inode], None]) -> None:
    """``inode`` lost its last name to a rename (open or not): it goes after
    ``REPLACED_LINGER`` seconds, or with its last release after that if it is open
    then.  Not at the last release of a reader that opened it meanwhile: an open that
    resolved the name before the rename may still be on its way (four writers
    replacing one name beside two readers on a loaded node: a reader's open met the
    inode gone, and its retry the next one, ESTALE)."""
    st.lingering.add(inode.ino)
    st.nursery.start_soon(_delete_after_linger, st, inode.ino, delete_inode)


async def _delete_after_linger(st: CoreState, ino: int,
                               delete_inode: Callable[[Inode], None]) -> None:
    try:
        await trio.sleep(REPLACED_LINGER)
    finally:
        st.lingering.discard(ino)
    inode = st.ns.maybe_get(ino)
    if inode is not None and not inode.parent and not st._is_open(ino):
        delete_inode(inode)
