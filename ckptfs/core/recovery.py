"""Recovery at mount: unclosed working versions abandoned, the journal replayed
(interrupted renames and exchanges, pending publishes)."""

from __future__ import annotations

import logging



log = logging.getLogger(__name__)


class Recovery:
    """Part of ``Filesystem`` (core/filesystem.py): its state lives there."""

    # ------------------------------------------------------------------ recovery

    async def start(self) -> None:
        """Finish an earlier run's work and account its local copies in the cache.

        A working version that was open for writing when the daemon stopped was never
        closed: it is abandoned (kept under ``abandoned/``), and a name that had no
        closed version at all goes, so nothing unclosed can be published later."""
        self.cache.evict_local = self._evict_local_copy
        closed: set[tuple[int, int]] = set()
        for inode in self.ns.all_inodes():
            if inode.type != "file":
                continue
            if inode.dirty or inode.local_copy:
                if self.staging.exists(inode.ino, inode.ver):
                    closed.add((inode.ino, inode.ver))
                    if not inode.dirty:
                        self.cache.track_local(inode.ino,
                                               self.staging.size(inode.ino, inode.ver))
                    self._restore_size(inode)
                    continue
                if inode.dirty:
                    log.error("closed version of %s is missing from staging",
                              self._path_for_log(inode))
                inode.dirty = inode.local_copy = False
            if not inode.published and inode.parent:
                log.warning("%s was open for writing when the daemon stopped and never "
                            "closed: removed", self._path_for_log(inode))
                self.ns.unlink(inode, all_names=True)
            self._restore_size(inode)
        for ino, ver in self.staging.versions():
            if (ino, ver) not in closed:
                kept = self.staging.abandon(ino, ver)
                log.warning("staging version %d.%d was open for writing when the daemon "
                            "stopped: not published, kept at %s", ino, ver, kept)
        await self.replay_journal()
        self._recovered.set()

    async def replay_journal(self) -> None:
        """Finish what a previous run of the daemon started (DESIGN.md "Recovery")."""
        self._restore_held_pointers()
        self._release_pointers()
        for ino, epoch in self.ns.publish_pending().items():
            inode = self.ns.maybe_get(ino)
            if inode is None or not inode.dirty or \
                    not self.staging.exists(inode.ino, inode.ver):
                self.ns.publish_pending_done(ino)
                continue
            self._publish_epoch[ino] = epoch
            self.queue.submit(ino)
        for seq, record in self.ns.journal():
            op = record.get("op")
            if op == "rename":
                await self._store(self.store.put, record["put"], record["body"].encode())
                if record.get("claim"):
                    await self._delete_claimed(record["delete"], record["claim"])
                else:
                    await self._store(self.store.delete, record["delete"])
                self.ns.journal_done(seq)
                log.info("finished an interrupted rename to %s", record["put"])
            elif op == "exchange":
                await self._finish_exchange(record["steps"])
                self.ns.journal_done(seq)
                log.info("finished an interrupted exchange")
            elif op == "meta":
                continue   # async mode's metadata log: its own worker replays it
            elif op == "publish":   # written by versions before the pending index
                self.ns.journal_done(seq)
                inode = self.ns.maybe_get(record["ino"])
                if inode is not None and inode.dirty and \
                        self.staging.exists(inode.ino, inode.ver):
                    self.ns.publish_pending_add(inode.ino)
                    self.queue.submit(inode.ino)
            else:
                log.error("unknown journal record %r dropped", record)
                self.ns.journal_done(seq)
