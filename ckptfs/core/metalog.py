"""Applying async mode's metadata log records to the store, in order (decision 0012): mkdir
(and joining another node's directory), move, delete, seal."""

from __future__ import annotations

import errno
import logging
import time

import trio

from ..errors import FsError
from ..namespace import Inode
from ..oplog import Blocked, OpDropped
from ..remote import (MAX_CHUNK_SIZE, BadEntry, Entry, entry_key)
from ..store import NotFound

log = logging.getLogger(__name__)


class NameTaken(Exception):
    """The name a journaled ``mkdir`` creates holds another node's object that is not a
    directory (or cannot be read): not joinable."""


class MetaLogApply:
    """Part of ``Filesystem`` (core/filesystem.py): its state lives there."""

    # ------------------------------------------------------------------ the metadata log

    async def _execute_meta(self, seq: int, record: dict) -> None:
        """Apply one record of the metadata log to the store (oplog.py)."""
        await self._recovered.wait()
        kind = record.get("kind")
        if kind == "mkdir":
            await self._exec_mkdir(seq, record)
        elif kind == "move":
            await self._exec_move(seq, record)
        elif kind == "delete":
            await self._delete_if_same(self._logged_key(record), record.get("ident"))
        elif kind == "seal":
            await self._exec_seal(seq, record)
        elif kind == "put":
            await self._exec_put(record)
        elif kind == "attrs":
            await self._exec_attrs(record)
        else:
            raise Blocked(f"unknown record kind {kind!r} (written by a newer ckptfs?)")

    async def _follow_the_log(self, what: str) -> None:
        """Async mode: a step that acts on the store at once (a hard link, the rename of
        a hard-linked name, an exchange) acts on the names as the store has them, so the
        records pending now are applied first -- else it would look for a name under
        the key a pending rename has not moved it to yet (ENOENT), or write over a name
        a pending rename has still to move away (that file lost in the store).  Bounded
        by ``store_timeout``: then EIO, and nothing is changed."""
        if not self._deferred():
            return
        epoch = self.oplog.epoch()
        if self.oplog.done_through(epoch):
            return
        with trio.move_on_after(self.config.store_timeout):
            await self.oplog.wait_through(epoch)
            return
        raise FsError(errno.EIO, f"{what}: earlier metadata changes of this node are not in "
                                 f"the store yet (ckptfs status)")

    def _logged_key(self, record: dict, dir_field: str = "parent_id",
                    name_field: str = "name") -> str:
        return entry_key(self.oplog.resolve(record[dir_field]),
                         bytes.fromhex(record[name_field]))

    async def _exec_mkdir(self, seq: int, record: dict) -> None:
        ino = record["ino"]
        key = self._logged_key(record)
        async with self._rt(ino).lock:      # an rmdir meanwhile waits, then sees it
            inode = self.ns.maybe_get(ino)
            if inode is None or inode.type != "dir" or inode.published or not inode.parent:
                return   # removed here before it reached the store: nothing to create
            created = await self._store(self.store.put_if_absent, key,
                                        self._content_entry(inode).to_json())
            if created is not None:
                inode.published, inode.remote_etag = True, created
                inode.listed_at = time.time()
                self.ns.save(inode)
            else:
                try:
                    await self._join_dir(inode, key)
                except NameTaken as exc:
                    # Kept under a name of its own; the log tries that name next.
                    self._rename_to_conflict(seq, record, inode, str(exc))
                    raise Blocked(f"renamed after a conflict: {exc}") from None
        self._drop_rt(ino)

    def _rename_to_conflict(self, seq: int, record: dict, inode: Inode, why: str) -> None:
        """Another node's object holds the name this directory was made under: the
        directory keeps everything under a visible name of its own,
        ``NAME.ckptfs-conflict-<node>`` (said once), and its record is retried under it
        (decision 0016: a conflict never deletes)."""
        base = inode.name + b".ckptfs-conflict-" + self.leases.node_id.encode()[:12]
        name, n = base, 1
        while self.ns.lookup(inode.parent, name) is not None:
            n += 1
            name = base + b"-" + str(n).encode()
        log.warning("%s: %s; this node's directory is kept as %s", self._path_for_log(inode),
                    why, name.decode(errors="replace"))
        self.ns.move(inode, inode.parent, name)
        self._touch_dir(inode.parent)
        self.oplog.update(seq, {**record, "name": name.hex(), "retry_now": True})

    async def _join_dir(self, inode: Inode, key: str) -> None:
        """The name was taken in the store meanwhile (two ranks' ``makedirs``, or this
        node's own put before a restart): a directory there is joined, with its id."""
        try:
            body, etag = await self._store(self.store.get, key)
        except NotFound:
            raise FsError(errno.EIO, f"{key} vanished while creating it") from None
        try:
            other = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry as exc:
            raise NameTaken(f"the store's entry {key} is corrupt ({exc})") from None
        if other.type != "dir":
            raise NameTaken(f"another node made {key} a {other.type}")
        old_id = inode.dir_id
        if other.id != old_id:
            log.info("%s was created by another node too: joined its directory",
                     self._path_for_log(inode))
            await self.leases.dir_id_changed(inode.ino, other.id)
            self.oplog.alias(old_id, other.id)
            self.ns.change_dir_id(inode, other.id)
            inode.staged = other.staged
        inode.published, inode.remote_etag, inode.listed_at = True, etag, 0.0
        self.ns.save(inode)
        if other.id != old_id:
            await self._rehome_children(inode, old_id)

    async def _rehome_children(self, inode: Inode, old_id: str) -> None:
        """Entries already published under a joined directory's old id move to its
        new one (files renamed into it before it reached the store)."""
        for name, child in self.ns.children(inode.ino):
            async with self._rt(child).lock:
                child_inode = self.ns.maybe_get(child)
                if child_inode is None or not child_inode.published:
                    continue
                old_key = entry_key(old_id, name)
                try:
                    body, _ = await self._store(self.store.get, old_key)
                except NotFound:
                    continue
                new_etag = await self._store(self.store.put, entry_key(inode.dir_id, name),
                                             body)
                await self._store(self.store.delete, old_key)
                if not child_inode.link_id:
                    child_inode.remote_etag = new_etag
                    self.ns.save(child_inode)
            self._drop_rt(child)

    async def _wait_publishes_before(self, seq: int, dir_ino: int) -> None:
        """Until the uploads below a directory closed before record ``seq`` are in the
        store (failed-for-good ones excepted: they never will be)."""
        while True:
            older = [ino for ino in self.queue.active()
                     if self._publish_epoch.get(ino, 0) < seq]
            if not self._pending_under(dir_ino, older):
                return
            await trio.sleep(0.05)

    async def _exec_move(self, seq: int, record: dict) -> None:
        ino = record["ino"]
        old_key = self._logged_key(record)
        new_key = self._logged_key(record, "to_id", "to_name")
        replaced = (record.get("replaced") or {}).get("ident")
        if record.get("type") == "dir":
            await self._wait_publishes_before(seq, ino)
        inode = self.ns.maybe_get(ino)
        if self._removed_since(inode):
            await self._move_of_removed(record, old_key, new_key, replaced)
            return
        seals = bool(record.get("seals")) and inode.staged and \
            not self._pending_under(ino, list(self.queue.failed))
        if seals and not await self.leases.may_seal(ino):
            seals = False    # other nodes still write below it: pending (leases.py)
        async with self._rt(ino).lock:
            inode = self.ns.maybe_get(ino)
            if self._removed_since(inode):     # while this waited for the lock
                seals = False
                await self._move_of_removed(record, old_key, new_key, replaced)
            else:
                seals = await self._move_locked(inode, old_key, new_key, seals, replaced)
        self._drop_rt(ino)
        if seals:
            self._sealed(inode)

    async def _move_locked(self, inode: Inode, old_key: str, new_key: str, seals: bool,
                           replaced: str | None) -> bool:
        """The store steps of a move, under the inode's lock; whether it sealed."""
        ino = inode.ino
        try:
            await self._move_entry(inode, old_key, new_key, seals)
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Not in the store under its old name.  Never published there: its own
            # publish writes the new name (a file with no closed version yet holds
            # the entry it replaced instead: ``replaced`` is None, rename.py).
            # Published, so another node moved or removed it first: this rename lost
            # the race (as if it had come second), and the entry it would have
            # replaced stays.
            seals = False
            if inode.dirty or ino in self.queue.queued or not inode.published:
                log.debug("move %s -> %s: %s", old_key, new_key, exc.reason)
                await self._delete_if_same(new_key, replaced)
            else:
                log.warning("rename to %s lost a race: another node moved or removed "
                            "%s first; what the store has stays", new_key, old_key)
        if seals:
            inode.staged = False
        self.ns.save(inode)
        return seals

    @staticmethod
    def _removed_since(inode: Inode | None) -> bool:
        return inode is None or not inode.parent or bool(inode.link_id)

    async def _move_of_removed(self, record: dict, old_key: str, new_key: str,
                               replaced: str | None) -> None:
        """The moved name was removed here since (or hard-linked: its names are then
        written by its publish): what the store has under the old name goes (its
        delete, later in the log, looks under the name it had then)."""
        await self._delete_if_same(old_key, record.get("ident"))
        await self._delete_if_same(new_key, replaced)

    async def _exec_put(self, record: dict) -> None:
        """The entry of a name made here with no data (symlink, special file), under the
        name it had when it was made: later records of the log move it from there."""
        ino = record["ino"]
        key = self._logged_key(record)
        async with self._rt(ino).lock:
            inode = self.ns.maybe_get(ino)
            if inode is None or not inode.parent or inode.published:
                pass    # removed here before it reached the store: nothing to write
            elif inode.link_id:
                await self._put_entry(inode)    # its shared object and every name
            else:
                etag = await self._store(self.store.put, key,
                                         self._entry_of(inode).to_json())
                inode.published, inode.remote_etag = True, etag
                self.ns.save(inode)
        self._drop_rt(ino)

    async def _exec_attrs(self, record: dict) -> None:
        """A published entry's attributes (chmod, chown, utimens, xattrs), rewritten
        under the name the store has for it at this point of the log."""
        ino = record["ino"]
        key = self._logged_key(record)
        async with self._rt(ino).lock:
            inode = self.ns.maybe_get(ino)
            if inode is not None and inode.parent and inode.published \
                    and not inode.link_id:
                try:
                    await self._rewrite_entry(inode, key)
                except FsError as exc:
                    if exc.errno != errno.ENOENT:
                        raise
                    # Another node renamed or removed it first: its attributes go with
                    # the next publish of this node's version, if there is one.
                    log.info("attributes of %s not rewritten: %s", key, exc.reason)
        self._drop_rt(ino)

    async def _exec_seal(self, seq: int, record: dict) -> None:
        started = time.monotonic()
        ino = record["ino"]
        await self._wait_publishes_before(seq, ino)
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.parent or not inode.staged or inode.type != "dir":
            return
        if self._pending_under(ino, list(self.queue.failed)):
            raise Blocked("a file below is refused by the store: the seal waits for it")
        if not await self.leases.may_seal(ino):
            return   # other nodes still write below it: pending (leases.py)
        key = self._logged_key(record)
        async with self._rt(ino).lock:
            inode = self.ns.maybe_get(ino)
            if inode is None or not inode.staged or not inode.parent:
                return      # removed (or sealed) here while this waited
            inode.staged, inode.sealed_at = False, time.time()
            try:
                await self._rewrite_entry(inode, key)
            except BaseException as exc:
                inode.staged = True
                self.ns.save(inode)
                if isinstance(exc, FsError) and exc.errno == errno.ENOENT:
                    raise OpDropped(exc.reason) from None
                raise
        self._drop_rt(ino)
        self._sealed(inode)
        self.observe("seal", time.monotonic() - started)
