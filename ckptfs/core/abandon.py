"""Abandoning a working version: a killed writer's, a failed write's, an incomplete
checkpoint's.  Its staging file is kept aside (or dropped), the file shows its last
closed version again, and a file that never had one loses every name it has -- also
on a full state dir, with the reserve's room (``meta/reserve.py``).  Owns the names to
drop from the kernel's cache afterwards (``drop_stale_entries``).

Knows nothing of the close decision that calls it, of publishing or of the store.
"""

from __future__ import annotations

import logging

from ..errors import FsError
from ..meta.namespace import Inode
from .state import CoreState
from .write import restore_closed_size
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .held import HeldEntries

log = logging.getLogger(__name__)


class Abandon:
    """Keeps working versions nobody closed for good out of sight."""

    def __init__(self, st: CoreState, held: HeldEntries) -> None:
        self.st = st
        self.held = held
        self._stale_entries: list[tuple[int, bytes]] = []   # names to drop from the kernel

    def abandon(self, inode: Inode, why: str, keep: bool = True) -> None:
        """Keep a working version out of sight: move its staging file aside (for
        ``ckptfs gc``; dropped at once when ``keep`` is false, e.g. after ENOSPC) and
        show the last closed version again, or nothing if there never was one."""
        rt = self.st._rt(inode.ino)
        session = rt.session
        if session is None:
            return
        self.st.leases.abandoned(inode)
        rt.session = None
        if keep:
            kept = self.st.staging.abandon(inode.ino, session.ver)
            log.warning("%s left unpublished because %s; staged bytes kept at %s",
                        self.st._path_for_log(inode), why, kept)
        else:
            self.st.staging.remove(inode.ino, session.ver)
            log.warning("%s left unpublished because %s", self.st._path_for_log(inode), why)
        for handle in filter(None, map(self.st.handles.get, session.handles)):
            handle.wrote = False
        if inode.published or inode.dirty:
            self.restore_size(inode)
        elif inode.parent:
            for parent, name in inode.names:   # every name: it never had a closed version
                self.st._touch_dir(parent)
                self._stale_entries.append((parent, name))
            self._drop_names(inode)
        self.st.end_session(inode.ino, rt)     # its readers: the version before
        self.st.invalidate(inode.ino)

    def _drop_names(self, inode: Inode) -> None:
        """A file that never had a closed version loses every name, in one commit: a
        name it held (renamed over a published file) shows that entry again, the
        others go.  On a full state dir the reserve's room is given up for it; if even
        that fails, the log says so and the name stays, empty, until the state dir has
        room (the next mount removes it, ``recovery.py``): nothing closed is at stake."""
        def drop() -> None:
            with self.st.ns.batch():
                held = inode.held
                self.st.ns.on_rollback(lambda: setattr(inode, "held", held))
                self.held.show_again(inode)
                inode.held = []
                if inode.parent:
                    self.st.ns.unlink(inode, all_names=True)
        try:
            self.st.ns.with_room(drop)
        except FsError as exc:
            for copy in (inode, self.st.ns.maybe_get(inode.ino)):   # (reread after the
                if copy is not None:                                # rollback)
                    copy.size = 0   # no closed version: nothing to read
            log.error("%s stays as an empty file that was never closed: %s",
                      self.st._path_for_log(inode), exc.reason)

    def restore_size(self, inode: Inode) -> None:
        """The size (and mtime) of the last closed version, saved."""
        restore_closed_size(self.st, inode)

    async def drop_stale_entries(self) -> None:
        """Tell the kernel to forget names this node removed by itself (a killed
        writer's new file), before the request that removed them returns: re-creating
        the name at once must not meet a cached dentry of the dead inode."""
        while self._stale_entries:
            parent, name = self._stale_entries.pop()
            if self.st.invalidate_entry is not None:
                await self.st.invalidate_entry(parent, name)
