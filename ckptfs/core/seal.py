"""Seals: marks and pointers that seal a staged directory, pointer hold-back, waiting for
the uploads below, the seal itself (sync) or its record (async)."""

from __future__ import annotations

import errno
import json
import logging
import time

import trio

from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode

from .state import CoreState
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .entries import EntryIO
    from .refresh import Refresh


log = logging.getLogger(__name__)


class Seal:
    """Seals and held pointers; no state of its own (the held pointers are shared)."""

    def __init__(self, st: CoreState, *, entries: EntryIO, refresher: Refresh,
                 journal_publish: Callable[[Inode], None]) -> None:
        self.st = st
        self.entries = entries
        self.refresher = refresher
        self.journal_publish = journal_publish

    # A pointer file (`latest`, a Ray snapshot, ...) naming a checkpoint directory whose
    # seal is still pending (another node's writers hold leases on it) is held back: a
    # loader that follows the pointer by name must not reach an incomplete checkpoint.
    # It publishes (in the background) once every directory it names is sealed or gone.

    def _hold_pointer(self, inode: Inode) -> None:
        targets = {t for t in self._seal_targets(inode) if t != inode.parent}
        if not targets:
            return
        ino, before = inode.ino, self.st._held_pointers.get(inode.ino)

        def undo() -> None:     # the write failed: memory says what the disk says
            if before is None:
                self.st._held_pointers.pop(ino, None)
            else:
                self.st._held_pointers[ino] = before
        with self.st.ns.batch():
            self.st.ns.on_rollback(undo)
            self.st._held_pointers[ino] = targets
            self._persist_held_pointers()

    def _release_pointers(self) -> None:
        released = []
        for ptr, targets in list(self.st._held_pointers.items()):
            for t in list(targets):
                target = self.st.ns.maybe_get(t)
                if target is None or not target.parent or not target.staged:
                    targets.discard(t)
            if not targets:
                del self.st._held_pointers[ptr]
                released.append(ptr)
        if not released:
            return
        self._persist_held_pointers()
        for ptr in released:
            inode = self.st.ns.maybe_get(ptr)
            if inode is not None and inode.dirty and inode.parent:
                self.journal_publish(inode)

    def _persist_held_pointers(self) -> None:
        self.st.ns.meta_put("held_pointers", json.dumps(
            {str(k): sorted(v) for k, v in self.st._held_pointers.items()}))

    def _restore_held_pointers(self) -> None:
        raw = self.st.ns.meta_get("held_pointers")
        if raw:
            self.st._held_pointers = {int(k): set(v) for k, v in json.loads(raw).items()}

    # ------------------------------------------------------------------ sealing

    def _seals_after_close(self, inode: Inode, wait: bool):
        """Seal what a closed completion mark or pointer file completes.  With ``wait``
        returns an awaitable that seals now; otherwise seals in the background once the
        pending publishes below the directory are done (async durability)."""
        unknown: list[bytes] = []
        targets = self._seal_targets(inode, unknown)
        for name in unknown:
            # Made by another node since this one listed the parent (a Ray worker's
            # checkpoint, recorded by the controller here): look, then seal.
            self.st.nursery.start_soon(self._seal_pointed_later, inode.parent, name)
        if wait:
            async def seal_all() -> None:
                for ino in targets:
                    await self.seal(ino)
            return seal_all()
        looked = []
        for ino in targets:
            first_look = trio.Event()
            self.st.nursery.start_soon(self._seal_in_background, ino, first_look)
            looked.append(first_look)
        return looked

    async def first_looks(self, looked: list[trio.Event]) -> None:
        """Async mode: the close of a mark waits, at most ``stale_wait``, for its seals'
        first try -- journaled, and listed here when nobody else writes below
        (``_show_here_if_clear``): a rotation that lists right after the save (the HF
        Trainer's) finds the checkpoint.  A store that does not answer by then delays
        only the listing here, never the close further.  (Most closes seal nothing: no
        cancel scope for them.)"""
        if not looked:
            return
        with trio.move_on_after(self.st.config.stale_wait):
            for first_look in looked:
                await first_look.wait()

    def _seal_targets(self, inode: Inode, unknown: list[bytes] | None = None) -> list[int]:
        """Staged directories a closed mark or pointer seals; names a pointer gives that
        this node does not know go to ``unknown``."""
        if inode.type != "file" or not inode.parent:
            return []
        profiles = self.st.config.profiles
        parent = self.st.ns.get(inode.parent)
        targets = []
        if parent.staged and profiles.is_mark_for(parent.name, inode.name):
            targets.append(parent.ino)
        limit = profiles.pointer_size_limit(inode.name)   # 0: not a pointer
        if limit and inode.size <= limit:
            try:
                with open(self.st.staging.path(inode.ino, inode.ver), "rb") as f:
                    content = f.read(limit)
            except (OSError, FsError):
                content = b""
            for name in profiles.pointed_names(inode.name, content):
                ino = self.st.ns.lookup(parent.ino, name)
                if ino is None:
                    if unknown is not None:
                        unknown.append(name)
                elif self.st.ns.get(ino).staged:
                    targets.append(ino)
        return targets

    async def _seal_pointed_later(self, parent: int, name: bytes) -> None:
        try:
            await self.refresher.refresh_dir(parent, force=True)
        except FsError as exc:
            log.warning("pointer names %r: listing its directory failed (%s)", name, exc)
            return
        ino = self.st.ns.lookup(parent, name)
        if ino is not None and self.st.ns.get(ino).staged:
            await self._seal_in_background(ino)

    def _pending_under(self, dir_ino: int, inos=None) -> bool:
        for ino in self.st.queue.queued if inos is None else inos:
            cur = self.st.ns.maybe_get(ino)
            while cur is not None and cur.parent and cur.ino != ROOT_INO:
                if cur.parent == dir_ino:
                    return True
                cur = self.st.ns.maybe_get(cur.parent)
        return False

    def _refuse_if_failed_below(self, dir_ino: int) -> None:
        """A file below that the store refuses (it waits for an operator, decision 0016)
        makes the tree incomplete for now: EIO, never a wait without end or a seal of a
        partial checkpoint."""
        if self._pending_under(dir_ino, list(self.st.queue.failed)):
            raise FsError(errno.EIO, "a file below is refused by the store and waits for "
                                     "an operator (see `ckptfs status`): the tree is "
                                     "incomplete")

    async def _wait_uploads_under(self, dir_ino: int) -> None:
        """Until every closed file below a directory is in the store (a sealed or
        renamed tree appears complete).  An upload below it that waits for an operator
        makes the tree incomplete: EIO, never a wait without end."""
        while True:
            self._refuse_if_failed_below(dir_ino)
            if not self._pending_under(dir_ino, self.st.queue.active()):
                return
            await self.st.queue.wait_change()

    async def _seal_in_background(self, ino: int, first_look: trio.Event | None = None
                                  ) -> None:
        """``first_look``: set once the first try is over (``first_looks``)."""
        try:
            for attempt in range(10):
                try:
                    await self.seal(ino)
                    return
                except Exception as exc:  # a background task must never take the daemon down
                    if isinstance(exc, FsError) and exc.errno in (errno.ENOENT,
                                                                  errno.ENOTDIR):
                        return  # the directory is gone or replaced: nothing left to seal
                    log.warning("sealing inode %d failed (%s); retrying", ino, exc)
                    if first_look is not None:
                        first_look.set()
                    await trio.sleep(min(30, 2 ** attempt))
            log.error("gave up sealing inode %d; `ckptfs commit` seals it by hand", ino)
        finally:
            if first_look is not None:
                first_look.set()

    async def seal(self, ino: int) -> bool:
        """Make a staged directory visible: after everything closed below it is in the
        store, rewrite its entry with ``staged: false`` (one PUT).  Idempotent."""
        started = time.monotonic()
        inode = self.st.ns.get(ino)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        if self.st._deferred():
            return await self._seal_later(inode)
        if not await self.st.leases.may_seal(ino):
            return False  # other nodes still write below it: pending (leases.py)
        await self._wait_uploads_under(ino)
        rt = self.st._rt(ino)
        async with rt.lock:
            inode = self.st.ns.get(ino)
            if not inode.staged or not inode.parent:
                return False
            inode.staged, inode.sealed_at = False, time.time()
            try:
                await self.entries._rewrite_entry(inode)
            except BaseException:
                inode.staged = True
                self.st.ns.save(inode)
                raise
        self.st._drop_rt(ino)
        self._sealed(inode)
        self.st.observe("seal", time.monotonic() - started)
        return True

    async def _seal_for_leases(self, ino: int) -> bool:
        """A pending seal's retry (leases.py): True only once sealed.  In async mode it
        journals a seal record and answers False: the pending seal stays until the
        record finds the way clear and seals (or records it pending again)."""
        sealed = await self.seal(ino)
        return sealed and not self.st._deferred()

    def _sealed(self, inode: Inode) -> None:
        self.st._touch_dir(inode.parent)
        log.info("sealed %s", self.st._path_for_log(inode))
        self.st.after_seal(inode)          # retention (retention.py)
        self.st.invalidate(inode.parent)
        self._release_pointers()

    async def _seal_later(self, inode: Inode) -> bool:
        """Async mode: journal the seal; the store gets it in log order, after every
        upload below the directory (``_exec_seal``).  True if a seal is on its way."""
        if not inode.staged or not inode.parent:
            return False
        self._refuse_if_failed_below(inode.ino)
        if not self.st.oplog.pending_of("seal", inode.ino):
            parent = self.st.ns.get(inode.parent)
            self.st.oplog.add({"kind": "seal", "ino": inode.ino, "parent_id": parent.dir_id,
                            "name": inode.name.hex()}, dirs=[inode.parent])
            await self.st._sync_journal()
        await self._show_here_if_clear(inode.ino)
        return True

    async def _show_here_if_clear(self, ino: int) -> None:
        """A seal journaled here shows the directory in this node's listings at once
        when nobody else writes below it: no file of this node open there and no other
        node's lease (one LIST).  Its files from this node are here; another node's
        would not be in the store yet, so then it stays hidden until the seal lands.
        The store's seal still waits for every upload below (``_exec_seal``)."""
        try:
            clear = await self.st.leases.may_seal(ino)
        except FsError as exc:      # (the store is out: shown once the seal lands)
            log.info("inode %d: sealed here, shown once the store has it (%s)", ino, exc)
            return
        inode = self.st.ns.maybe_get(ino)
        if clear and inode is not None and inode.staged and inode.parent and \
                self.st.oplog.pending_of("seal", ino):
            self.st.sealed_here.add(ino)
            self.st._touch_dir(inode.parent)
            self.st.invalidate(inode.parent)
