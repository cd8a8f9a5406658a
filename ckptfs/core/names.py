"""Names: lookup, listing, creating (mkdir, create, symlink, mknod), removing (unlink,
rmdir) and hard links."""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
import uuid

import trio

from ..errors import FsError
from ..meta.namespace import Inode
from ..procstat import Opener
from ..format.remote import (MAX_CHUNK_SIZE, MAX_RDEV, SPECIAL_TYPES, TYPE_OF_BITS, BadEntry, Entry, KeyTooLong, check_key_fits, check_name,
                     entry_key)
from ..store import NotFound, StoreError
from .critical import no_await
from .linkcount import unlink_linked
from .removals import DirRemovals
from .state import ALL_ATTRIBUTES, CoreState, Handle, dir_id_of
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .entries import EntryIO
    from .refresh import Refresh
    from .opening import Opening
    from .write import WritePath
    from .publish import Publish


log = logging.getLogger(__name__)


class Names:
    """Lookup, create, mkdir, unlink, links; no state of its own."""

    def __init__(self, st: CoreState, *, entries: EntryIO, removals: DirRemovals,
                 refresher: Refresh, opening: Opening, writes: WritePath, publisher: Publish,
                 delete_held: Callable[[Inode, Inode, bytes], Awaitable[None]],
                 release_held: Callable[[Inode, Inode, bytes], None],
                 log_delete: Callable[[Inode, Inode, bytes], None]) -> None:
        self.st = st
        self.entries = entries
        self.removals = removals
        self.refresher = refresher
        self.opening = opening
        self.writes = writes
        self.publisher = publisher
        self.delete_held = delete_held
        self.release_held = release_held
        self.log_delete = log_delete    # async: a removed name's delete record

    # ------------------------------------------------------------------ lookups

    async def lookup(self, parent: int, name: bytes) -> Inode:
        if len(name) > 255:
            raise FsError(errno.ENAMETOOLONG)
        if name == b".":
            return self.st._dir(parent)
        if name == b"..":
            return self.st.ns.get(self.st._dir(parent).parent)
        await self.refresher.refresh_dir(parent)
        ino = self.st.ns.lookup(parent, name)
        if ino is None:
            if name in self.refresher._corrupt.get(parent, ()):
                raise FsError(errno.EIO, f"the store's entry for {name!r} is corrupt")
            raise FsError.enoent()
        return self.st.ns.get(ino)

    def getattr(self, ino: int) -> Inode:
        return self.st.ns.get(ino)

    async def listdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        """Entries of a directory, without staged (unsealed) checkpoint directories:
        those are found only by their exact name (DESIGN.md promise 4)."""
        await self.refresher.refresh_dir(ino)
        out = []
        for name, child in self.st.ns.children(ino):
            inode = self.st.ns.get(child)
            if not inode.staged or child in self.st.sealed_here:
                out.append((name, inode))
        return out

    def statvfs(self) -> os.statvfs_result:
        """Space as the writer sees it: the staging disk's."""
        return os.statvfs(self.st.staging.root)

    def readlink(self, ino: int) -> bytes:
        inode = self.st.ns.get(ino)
        if inode.type != "symlink":
            raise FsError(errno.EINVAL)
        return inode.target or b""

    # ------------------------------------------------------------------ creating names

    async def _check_absent(self, parent: int, name: bytes) -> None:
        check_name_or_raise(name)
        await self.refresher.refresh_dir(parent)
        if self.st.ns.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        if name in self.refresher._corrupt.get(parent, ()):
            # Its entry may be a file another node holds, emptied or damaged: never
            # taken over (EIO, as a lookup of it).
            raise FsError(errno.EIO, f"the store's entry for {name!r} is corrupt")

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        await self._check_absent(parent, name)
        parent_inode = self.st._dir(parent)
        dir_id = uuid.uuid4().hex
        if not self.st._deferred():
            return await self._mkdir_in_store(parent_inode, name, mode, uid, gid, dir_id)
        if not self.st.oplog.pending and not self.refresher.store_slow():
            # Async mode with nothing journaled ahead: try the store first, briefly, so
            # two nodes making one directory share it from the start (their leases then
            # guard its seal); local-first if the store does not answer (or cannot now).
            try:
                with trio.move_on_after(self.st.config.stale_wait):
                    return await self._mkdir_in_store(parent_inode, name, mode, uid, gid,
                                                      dir_id, abandon_on_cancel=True)
            except FsError as exc:
                if exc.errno != errno.EIO:
                    raise
        return await self._mkdir_local(parent_inode, name, mode, uid, gid, dir_id)

    async def _mkdir_in_store(self, parent_inode: Inode, name: bytes, mode: int, uid: int,
                              gid: int, dir_id: str, abandon_on_cancel: bool = False) -> Inode:
        """Sync mode (and async mode's first try): the directory in the store, then
        here.  Its inode is written here first, unnamed, so that a full state dir fails
        the mkdir (ENOSPC) before the store has anything; the name comes last."""
        staged = self.st.config.profiles.staged_on_create(name)
        inode = self.st.ns.reserve_inode("dir", mode, uid, gid, dir_id=dir_id, published=True,
                                      staged=staged)
        try:
            created = await self._mkdir_reserved(parent_inode, name, inode, abandon_on_cancel)
        except BaseException:
            self.st.ns.forget_reserved(inode)
            raise
        if not created:
            raise FsError(errno.EEXIST)     # another's directory, now known here too
        return inode

    async def _mkdir_reserved(self, parent_inode: Inode, name: bytes, inode: Inode,
                              abandon_on_cancel: bool) -> bool:
        """Put the entry and name the reserved inode; False when another node's
        directory of that name was adopted instead."""
        parent = parent_inode.ino
        entry = Entry(type="dir", mode=inode.mode, uid=inode.uid, gid=inode.gid,
                      mtime_ns=inode.mtime_ns, id=inode.dir_id, staged=inode.staged)
        key = entry_key(dir_id_of(parent_inode), name)
        created = await self.entries.put_new(key, entry.to_json(), empty_is_free=True,
                                             abandon_on_cancel=abandon_on_cancel)
        etag = created or ""
        if created:
            await self.entries.landed(key)
        if not created:
            # Another node (or process) won the race: adopt its directory.
            try:
                body, etag = await self.entries._store(self.st.store.get, key,
                                               abandon_on_cancel=abandon_on_cancel)
                entry = Entry.from_json(body, MAX_CHUNK_SIZE)
            except (NotFound, BadEntry) as exc:
                raise FsError(errno.EIO, f"mkdir race on {key}: {exc}") from None
            if entry.type != "dir":
                raise FsError(errno.EEXIST)
        if self.st.ns.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        self.st._touch_dir(parent)
        inode.dir_id, inode.mode, inode.uid, inode.gid = entry.id, entry.mode, entry.uid, \
            entry.gid
        inode.mtime_ns, inode.staged, inode.remote_etag = entry.mtime_ns, entry.staged, \
            etag or None
        # A directory this node created in the store is known to be empty: its listing
        # is this node's until the TTL runs out (a lookup below it never has to wait for
        # the store, which may be gone by then).
        inode.listed_at = time.time() if created else 0.0
        try:
            self.st.ns.attach(inode, self.st.ns.get(parent), name)
        except FsError:
            if created:     # ours alone so far: the store forgets it too
                await self.entries.unput(key, created, "mkdir")
            raise
        return bool(created)

    async def _mkdir_local(self, parent: Inode, name: bytes, mode: int, uid: int,
                           gid: int, dir_id: str) -> Inode:
        """Async mode: the directory exists here at once; the store gets it in log
        order (``_exec_mkdir``).  Inode, name and journal record are one transaction."""
        self.st._touch_dir(parent.ino)
        with self.st.ns.batch():
            inode = self.st.ns.new_inode(parent.ino, name, "dir", mode & 0o7777, uid, gid,
                                      dir_id=dir_id, published=False,
                                      mtime_ns=time.time_ns(),
                                      staged=self.st.config.profiles.staged_on_create(name))
            self._mark_parent_changed(parent)
            self.st.oplog.add({"kind": "mkdir", "ino": inode.ino, "parent_id": parent.dir_id,
                            "name": name.hex()}, dirs=[parent.ino])
        self.st._sync_journal_soon()
        return inode

    def _mark_parent_changed(self, parent: Inode) -> None:
        now = time.time_ns()
        parent.mtime_ns = parent.ctime_ns = now
        self.st.ns.save(parent)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int,
                      gid: int) -> Inode:
        await self._check_absent(parent, name)
        self.st._touch_dir(parent)
        return await self._publish_new_name(parent, name, functools.partial(
            self.st.ns.new_inode, parent, name, "symlink", 0o777, uid, gid, target=target,
            size=len(target), save_id=uuid.uuid4().hex))

    async def _publish_new_name(self, parent: int, name: bytes,
                                make: Callable[[], Inode]) -> Inode:
        """A name with no data (symlink, special file) made by ``make``, parent's times
        and async log record (``_exec_put``) in one commit; sync: undone if its PUT
        fails or is not recorded here (an audit found such failed names kept)."""
        parent_inode = self.st.ns.get(parent)
        times = parent_inode.mtime_ns, parent_inode.ctime_ns
        with self.st.ns.batch():
            inode = make()
            if self.st._deferred():
                self.st.oplog.add({"kind": "put", "ino": inode.ino,
                                   "parent_id": parent_inode.dir_id, "name": name.hex()},
                                  dirs=[parent])
            self._mark_parent_changed(parent_inode)
        if self.st._deferred():
            self.st._sync_journal_soon()
            return inode
        key = entry_key(dir_id_of(parent_inode), name)
        etag: str | None = None
        try:
            etag = await self.entries._store(self.st.store.put, key,
                                             self.entries._entry_of(inode).to_json())
            inode.remote_etag, inode.published = etag, True
            self.st.ns.save(inode)
        except BaseException:
            if etag is not None:        # in the store, but not recorded here
                await self.entries.unput(key, etag, "the new name")

            def undo() -> None:
                with self.st.ns.batch():
                    self.st.ns.unlink(inode)
                    self.st.ns.delete_inode(inode.ino)
                    parent_inode.mtime_ns, parent_inode.ctime_ns = times
                    self.st.ns.save(parent_inode)
            self.st.ns.with_room(undo)      # a removal that must land (a full disk)
            raise
        await self.entries.landed(key)
        return inode

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Inode:
        """A FIFO, device node or socket: a metadata-only entry (the kernel does their
        I/O itself); or, for S_IFREG, an empty regular file published at once."""
        check_name_or_raise(name)   # ENAMETOOLONG before anything about the type
        fmt = stat.S_IFMT(mode)
        kind = "file" if fmt == 0 else TYPE_OF_BITS.get(fmt)
        if kind != "file" and kind not in SPECIAL_TYPES:
            raise FsError(errno.EINVAL, f"mknod of file type {fmt:o}")
        if kind not in ("chr", "blk"):
            rdev = 0
        if not 0 <= rdev <= MAX_RDEV:
            raise FsError(errno.EINVAL, f"device number {rdev} out of range")
        await self._check_absent(parent, name)
        self.st._dir(parent)
        self.st._touch_dir(parent)
        # An empty regular file is a save like any publish: its own save id (decision
        # 0016), or a late removal of another node's empty file matches it on content.
        save_id = uuid.uuid4().hex      # (a special file's too: made again is another)
        return await self._publish_new_name(parent, name, functools.partial(
            self.st.ns.new_inode, parent, name, kind, mode, uid, gid, rdev=rdev,
            save_id=save_id))

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int,
                     opener: Opener) -> tuple[Handle, Inode]:
        with self.st.upload_gate.busy():       # a writer at work: uploads wait (decision 0015)
            return await self._create(parent, name, mode, flags, uid, gid, opener)

    async def _create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                      gid: int, opener: Opener) -> tuple[Handle, Inode]:
        check_name_or_raise(name)
        await self.refresher.refresh_dir(parent)
        existing = self.st.ns.lookup(parent, name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            handle = await self.opening.open_by_name(parent, name, existing, flags, opener)
            return handle, self.st.ns.get(handle.ino)
        parent_inode = self.st._dir(parent)
        self.st._touch_dir(parent)
        # A new name has no closed version until its writer's close: if the writer is
        # killed, the name goes again.  Inode, staging file, then the name, in one LMDB
        # commit (issue 25): a full state dir (ENOSPC) or no descriptor left (EMFILE)
        # leaves nothing behind.
        made: int | None = None
        try:
            with self.st.ns.batch():
                inode = self.st.ns.reserve_inode("file", mode, uid, gid, max_ver=1)
                inode.attrs_unsent = list(ALL_ATTRIBUTES) if flags & os.O_EXCL else []
                self.st.staging.create_empty(inode.ino, 1)
                made = inode.ino
                self.st.ns.attach(inode, parent_inode, name)
        except OSError as exc:        # the staging file (the batch is rolled back)
            raise FsError(exc.errno or errno.EIO, f"staging file: {exc.strerror}") from None
        except BaseException:
            if made is not None:      # the commit failed: its staging file goes too
                self.st.staging.remove(made, 1)
            raise
        rt = self.st._rt(inode.ino)
        session = self.writes._start_session(inode, rt, 1)
        session.tracker.reset()
        session.wrote = True  # creating the file is a change worth publishing
        handle = self.opening._new_handle(inode, opener, writable=True)
        self.opening.decide_passthrough(handle, fresh=True)
        await self.st.leases.writing(inode)
        return handle, inode

    # ------------------------------------------------------------------ removing names

    async def unlink(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        await self._remove(inode, parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        await self.refresher.refresh_dir(inode.ino, force=not self.st._deferred())
        if self.st.ns.has_children(inode.ino):
            raise FsError(errno.ENOTEMPTY)
        await self._remove(inode, parent, name)

    async def _remove(self, inode: Inode, parent_ino: int, name: bytes) -> None:
        # Under the inode's lock: an entry PUT in flight (a publish) lands first, then
        # its key is deleted here, instead of landing after and resurrecting the name.
        rt = self.st._rt(inode.ino)
        async with rt.lock:
            inode = self.st.ns.get(inode.ino)
            if self.st.ns.lookup(parent_ino, name) != inode.ino:
                return
            parent = self.st.ns.get(parent_ino)
            stored = inode.published or bool(inode.held)    # sync: a store step comes
            local_step: Callable[[], None] | None = None
            if inode.published and not inode.links_pending and self.st._deferred() \
                    and not inode.link_id:
                local_step = functools.partial(self.log_delete, inode, parent, name)
            elif inode.type == "dir" and inode.published:
                key = entry_key(dir_id_of(parent), name)
                if not await self.removals.remove_dir(key, self.entries._identity(inode)["ident"]):
                    self.st._touch_dir(inode.ino)    # the next lookup lists what came
                    raise FsError(errno.ENOTEMPTY)
            elif inode.published and inode.link_id and not inode.links_pending:
                await unlink_linked(self.entries, inode, entry_key(dir_id_of(parent), name))
            elif inode.published and not inode.links_pending:
                await self.entries._store(self.st.store.delete, entry_key(dir_id_of(parent), name))
            elif self.st._deferred():
                local_step = functools.partial(self.release_held, inode, parent, name)
            else:
                await self.delete_held(inode, parent, name)
            if local_step is not None:      # async: the log record and removal, one commit
                with self.st.ns.batch():
                    local_step()
                    self._unlink_locally(inode, parent, name)
            else:       # sync: what the store has removed, here must follow
                self.st.record_store_change(
                    lambda: self._unlink_locally(inode, parent, name) or True,
                    [parent.ino], f"removal of {name!r}", stored)
        self.st._drop_rt(inode.ino)
        if not inode.parent and not self.st._is_open(inode.ino):
            self.publisher._delete_inode(inode)
        if self.st._deferred():
            self.st._sync_journal_soon()

    @no_await
    def _unlink_locally(self, inode: Inode, parent: Inode, name: bytes) -> None:
        """After the store step, under the lock: the name goes from the namespace."""
        self.st._touch_dir(parent.ino)
        self.st.ns.unlink(inode, parent.ino, name)
        self._mark_parent_changed(parent)

    # ------------------------------------------------------------------ hard links

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A further name for a non-directory (decision 0008): the first link moves the
        content into a shared inode object; each name is a "link" entry to it."""
        check_name_or_raise(new_name)
        inode = self.st.ns.get(ino)
        if inode.type == "dir":
            raise FsError(errno.EPERM, "hard links to directories")
        await self._check_absent(new_parent, new_name)
        new_dir = self.st._dir(new_parent)
        await self.st.follow_the_log("hard link")
        rt = self.st._rt(ino)
        async with rt.lock:
            inode = self.st.ns.get(ino)
            if not inode.parent:
                raise self.st.gone(ino, "the file was removed")
            if self.st.ns.lookup(new_parent, new_name) is not None:
                raise FsError(errno.EEXIST)
            created: str | None = None
            key = entry_key(dir_id_of(new_dir), new_name)
            if inode.published and not inode.links_pending:
                if not inode.link_id:
                    await self.entries._make_linked(inode)
                await self.entries._change_nlink(inode, +1)
                created = await self.entries.put_new(key,
                                                     self.entries._entry_of(inode).to_json())
                if not created:
                    await self.entries._change_nlink(inode, -1)
                    raise FsError(errno.EEXIST)
                await self.entries.landed(key)
            # Name, link id of a file not published yet (its first publish writes the
            # object and every name) and parent's times: one commit; if it fails, a
            # name already in the store goes again (an audit found it kept there).
            try:
                with self.st.ns.batch():
                    if created is None:
                        if not inode.link_id:
                            self.st.ns.set_link_id(inode, uuid.uuid4().hex)
                        inode.links_pending = True
                    self.st._touch_dir(new_parent)
                    self.st.ns.add_name(inode, new_parent, new_name)
                    self._mark_parent_changed(self.st.ns.get(new_parent))
            except BaseException:
                if created is not None:
                    await self.entries.unput_link(inode, key, created)
                raise
        self.st._drop_rt(ino)
        return self.st.ns.get(ino)


def check_name_or_raise(name: bytes) -> None:
    if len(name) > 255:
        raise FsError(errno.ENAMETOOLONG)
    try:
        check_name(name)
        check_key_fits("0" * 32, name)       # as long as a directory id gets
    except KeyTooLong as exc:
        raise FsError(errno.ENAMETOOLONG, str(exc)) from None
    except BadEntry:
        raise FsError(errno.EINVAL, f"invalid name {name!r}") from None
