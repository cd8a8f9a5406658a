"""Recovery at mount: unclosed working versions abandoned, the journal replayed
(interrupted renames and exchanges, pending publishes)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode
from .state import CoreState

if TYPE_CHECKING:
    from .abandon import Abandon
    from .entries import EntryIO
    from .read import ReadPath
    from .publish import Publish
    from .seal import Seal
    from .rename import Rename
    from .moves import EntryMoves


log = logging.getLogger(__name__)


class Recovery:
    """Mount-time recovery and journal replay; no state of its own."""

    def __init__(self, st: CoreState, *, entries: EntryIO, reads: ReadPath,
                 publisher: Publish, seals: Seal, renames: Rename,
                 moves: EntryMoves, abandoning: Abandon) -> None:
        self.st = st
        self.abandoning = abandoning
        self.entries = entries
        self.reads = reads
        self.publisher = publisher
        self.seals = seals
        self.renames = renames
        self.moves = moves

    # ------------------------------------------------------------------ recovery

    async def start(self) -> None:
        """Finish an earlier run's work and account its local copies in the cache.

        A working version that was open for writing when the daemon stopped was never
        closed: it is abandoned (kept under ``abandoned/``), and a name that had no
        closed version at all goes, so nothing unclosed can be published later."""
        self.st.cache.evict_local = self.reads._evict_local_copy
        closed: set[tuple[int, int]] = set()
        owed: list[int] = []
        for inode in self.st.ns.all_inodes():
            if inode.type != "file":
                continue
            if inode.dirty or inode.local_copy:
                if self.st.staging.exists(inode.ino, inode.ver):
                    closed.add((inode.ino, inode.ver))
                    if inode.dirty:
                        owed.append(inode.ino)
                    if not inode.dirty:
                        self.st.cache.track_local(inode.ino,
                                               self.st.staging.size(inode.ino, inode.ver))
                    self.abandoning.restore_size(inode)
                    continue
                if inode.dirty:
                    log.error("closed version of %s is missing from staging",
                              self.st._path_for_log(inode))
                inode.dirty = inode.local_copy = False
            if not inode.published and inode.parent:
                log.warning("%s was open for writing when the daemon stopped and never "
                            "closed: removed", self.st._path_for_log(inode))
                self.st.cut_off[inode.ino] = self._path_of(inode.ino)
                self.st.ns.with_room(lambda: self.st.ns.unlink(inode, all_names=True))
            self.abandoning.restore_size(inode)
        self._settle_unclosed_versions(closed)
        await self.replay_journal()
        self._publish_unjournaled(owed)
        self._drop_idle_nameless()
        self.st._recovered.set()

    def _settle_unclosed_versions(self, closed: set[tuple[int, int]]) -> None:
        """Every staged version that is no inode's closed version: a replaced one
        dropped, a second name of staged bytes dropped, the rest kept under
        ``abandoned/`` (a write the daemon died in, or a version of no inode)."""
        for ino, ver in self.st.staging.versions():
            if (ino, ver) not in closed:
                known = self.st.ns.maybe_get(ino)
                if known is not None and known.type == "file" and ver < known.ver:
                    # A closed version a later save replaced (a reader or an upload held
                    # it): nothing reads it after a restart.  Versions only grow, so an
                    # unclosed one is never older than the closed one.
                    log.debug("staging version %d.%d, replaced: dropped", ino, ver)
                    self.st.staging.remove(ino, ver)
                    continue
                if known is None and self.st.staging.has_another_name(ino, ver):
                    # A version a fresh inode took over beside its readers
                    # (``taken.hand_owed_version_to``) that an upload still held:
                    # its bytes are staged under the other name.
                    log.info("staging version %d.%d belongs to no inode and its bytes "
                             "have another name: dropped", ino, ver)
                    self.st.staging.remove(ino, ver)
                    continue
                kept = self.st.staging.abandon(ino, ver)
                if known is None:
                    # Its inode was removed (replaced by a rename, unlinked) while a
                    # reader or an upload still held this version: nothing names it.
                    log.info("staging version %d.%d belongs to no inode (replaced or "
                             "removed while a reader or an upload held it): kept at %s",
                             ino, ver, kept)
                    continue
                if ino not in self.st.cut_off and known.parent:
                    self.st.cut_off[ino] = self._path_of(ino)
                log.warning("staging version %d.%d was open for writing when the daemon "
                            "stopped: not published, kept at %s", ino, ver, kept)

    def _path_of(self, ino: int) -> bytes:
        """``ino``'s path, or a placeholder where a directory above it has no name
        left here (kept nameless for the work in it): recovery must go on."""
        try:
            return self.st.ns.path_of(ino)
        except FsError:
            return b"<inode %d>" % ino

    def _publish_unjournaled(self, owed: list[int]) -> None:
        """A closed version the store is owed whose publish no record names: a sync
        close the daemon died in (its upload was the close's own, nothing journaled),
        or a step that saved the version and would have journaled it next.  Kept and
        never published, it split the nodes for good (this one showed it, no other
        did).  Published now, like any closed version."""
        for ino in owed:
            inode = self.st.ns.maybe_get(ino)
            if inode is None or not inode.parent:
                continue
            with self.st.ns.batch():
                journaled = self.publisher.keep_trying(ino)
            if journaled:
                log.warning("%s: a closed version with no publish on record (the daemon "
                            "stopped in its close): published now",
                            self.st._path_for_log(inode))

    def _drop_idle_nameless(self) -> None:
        """A directory kept under no name for this node's work in it (another node moved
        it away, and this node never listed its new place: ``Refresh._forget_subtree``)
        is dropped from this node's metadata, with what is below it, once nothing there
        is owed to the store.  Nothing in the store changes: a listing of its new place
        takes it again.  Before, such a directory stayed in the metadata for good.  So
        does a file unlinked while open (or whose name moved to a fresh inode beside a
        reader, ``Opening._fresh_inode_for_name``, or one a rename replaced, lingering)
        when the daemon stopped before its last release: its record and local copy
        stayed for good."""
        pending = set(self.st.ns.publish_pending())
        for inode in list(self.st.ns.all_inodes()):
            if inode.parent or inode.ino == ROOT_INO or self._owes(inode, pending):
                continue
            if inode.type == "dir":
                log.info("directory %s (inode %d), kept under no name for this node's "
                         "work in it, is done with: dropped from this node's metadata",
                         inode.dir_id, inode.ino)
                self._drop_tree(inode)
            elif not inode.link_id or not any(r.get("ino") == inode.ino
                                              for r in self.st.oplog.pending.values()):
                # A file unlinked (or moved to a fresh inode) while open, the daemon
                # stopped before its last release: nothing can reach it any more.  A
                # hard-linked one too, unless a record of it is pending (its other
                # names find the shared object again at a listing): it was kept for
                # good, with its local copy.
                log.debug("inode %d, under no name and owing nothing: dropped", inode.ino)
                self.publisher._delete_inode(inode)

    def _owes(self, inode: Inode, pending: set[int]) -> bool:
        """Whether anything at or below ``inode`` still has work this node owes the
        store (a closed version to publish, a metadata record pending), or has a name
        elsewhere (a hard link).  ``pending``: the inodes with a publish pending, read
        once by the caller."""
        if inode.type == "dir":
            if self.st.oplog.is_busy(inode.ino):
                return True
            return any(self._owes(self.st.ns.get(child), pending)
                       for _, child in self.st.ns.children(inode.ino))
        # A file under no name owes nothing: no publish of it can name it (a closed
        # version of a file unlinked while open, or replaced while it lingered,
        # ``linger.py``; its pending publish is dropped with it).
        return bool(inode.aliases) or bool(inode.parent) and (
            inode.dirty or inode.ino in self.st.queue.queued or inode.ino in pending)

    def _drop_tree(self, inode: Inode) -> None:
        for name, child in self.st.ns.children(inode.ino):
            child_inode = self.st.ns.get(child)
            if child_inode.type == "dir":
                self._drop_tree(child_inode)
            else:
                self.st.ns.unlink(child_inode, inode.ino, name)
                self.publisher._delete_inode(child_inode)
        if inode.parent:
            self.st.ns.unlink(inode)
        self.publisher._delete_inode(inode)

    async def replay_journal(self) -> None:
        """Finish what a previous run of the daemon started (DESIGN.md "Recovery")."""
        self.seals._restore_held_pointers()
        self.seals._release_pointers()
        for ino, epoch in self.st.ns.publish_pending().items():
            inode = self.st.ns.maybe_get(ino)
            if inode is None or not inode.dirty or \
                    not self.st.staging.exists(inode.ino, inode.ver):
                self.st.ns.publish_pending_done(ino)
                continue
            self.st._publish_epoch[ino] = epoch
            self.st.queue.submit(ino)
        for seq, record in self.st.ns.journal():
            op = record.get("op")
            if op == "rename":
                await self.moves.replay(record)
                self.st.ns.journal_done(seq)
            elif op == "exchange":
                await self.renames._finish_exchange(record["steps"])
                self.st.ns.journal_done(seq)
                log.info("finished an interrupted exchange")
            elif op == "meta":
                continue   # async mode's metadata log: its own worker replays it
            elif op == "publish":   # written by versions before the pending index
                self.st.ns.journal_done(seq)
                inode = self.st.ns.maybe_get(record["ino"])
                if inode is not None and inode.dirty and \
                        self.st.staging.exists(inode.ino, inode.ver):
                    self.st.ns.publish_pending_add(inode.ino)
                    self.st.queue.submit(inode.ino)
            else:
                log.error("unknown journal record %r dropped", record)
                self.st.ns.journal_done(seq)
