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
from ..namespace import Inode
from ..procstat import Opener
from ..remote import (MAX_CHUNK_SIZE, MAX_RDEV, SPECIAL_TYPES, TYPE_OF_BITS, BadEntry, Entry, KeyTooLong, check_key_fits, check_name,
                     entry_key)
from ..store import NotFound, StoreError
from .state import (Handle)

log = logging.getLogger(__name__)


class Names:
    """Part of ``Filesystem`` (core/filesystem.py): its state lives there."""

    # ------------------------------------------------------------------ lookups

    async def lookup(self, parent: int, name: bytes) -> Inode:
        if len(name) > 255:
            raise FsError(errno.ENAMETOOLONG)
        if name == b".":
            return self._dir(parent)
        if name == b"..":
            return self.ns.get(self._dir(parent).parent)
        await self.refresh_dir(parent)
        ino = self.ns.lookup(parent, name)
        if ino is None:
            if name in self._corrupt.get(parent, ()):
                raise FsError(errno.EIO, f"the store's entry for {name!r} is corrupt")
            raise FsError.enoent()
        return self.ns.get(ino)

    def getattr(self, ino: int) -> Inode:
        return self.ns.get(ino)

    async def listdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        """Entries of a directory, without staged (unsealed) checkpoint directories:
        those are found only by their exact name (DESIGN.md promise 4)."""
        await self.refresh_dir(ino)
        out = []
        for name, child in self.ns.children(ino):
            inode = self.ns.get(child)
            if not inode.staged:
                out.append((name, inode))
        return out

    def statvfs(self) -> os.statvfs_result:
        """Space as the writer sees it: the staging disk's."""
        return os.statvfs(self.staging.root)

    def readlink(self, ino: int) -> bytes:
        inode = self.ns.get(ino)
        if inode.type != "symlink":
            raise FsError(errno.EINVAL)
        return inode.target or b""

    # ------------------------------------------------------------------ creating names

    async def _check_absent(self, parent: int, name: bytes) -> None:
        check_name_or_raise(name)
        await self.refresh_dir(parent)
        if self.ns.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        await self._check_absent(parent, name)
        parent_inode = self._dir(parent)
        dir_id = uuid.uuid4().hex
        if not self._deferred():
            return await self._mkdir_in_store(parent_inode, name, mode, uid, gid, dir_id)
        if not self.oplog.pending:
            # Async mode with nothing journaled ahead: try the store first, briefly, so
            # two nodes making one directory share it from the start (their leases
            # then guard its seal); local-first if the store does not answer.
            try:
                with trio.move_on_after(self.config.stale_wait):
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
        staged = self.config.profiles.staged_on_create(name)
        inode = self.ns.reserve_inode("dir", mode, uid, gid, dir_id=dir_id, published=True,
                                      staged=staged)
        try:
            created = await self._mkdir_reserved(parent_inode, name, inode, abandon_on_cancel)
        except BaseException:
            self.ns.forget_reserved(inode)
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
        key = entry_key(parent_inode.dir_id, name)
        created = await self._store(self.store.put_if_absent, key, entry.to_json(),
                                    abandon_on_cancel=abandon_on_cancel)
        etag = created or ""
        if not created:
            # Another node (or process) won the race: adopt its directory.
            try:
                body, etag = await self._store(self.store.get, key,
                                               abandon_on_cancel=abandon_on_cancel)
                entry = Entry.from_json(body, MAX_CHUNK_SIZE)
            except (NotFound, BadEntry) as exc:
                raise FsError(errno.EIO, f"mkdir race on {key}: {exc}") from None
            if entry.type != "dir":
                raise FsError(errno.EEXIST)
        if self.ns.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        self._touch_dir(parent)
        inode.dir_id, inode.mode, inode.uid, inode.gid = entry.id, entry.mode, entry.uid, \
            entry.gid
        inode.mtime_ns, inode.staged, inode.remote_etag = entry.mtime_ns, entry.staged, \
            etag or None
        # A directory this node created in the store is known to be empty: its listing
        # is this node's until the TTL runs out (a lookup below it never has to wait for
        # the store, which may be gone by then).
        inode.listed_at = time.time() if created else 0.0
        try:
            self.ns.attach(inode, self.ns.get(parent), name)
        except FsError:
            if created:     # ours alone so far: the store forgets it too
                await self._unput_mkdir(key, created)
            raise
        return bool(created)

    async def _unput_mkdir(self, key: str, etag: str) -> None:
        """Take back a directory entry this node just put, whose local half failed."""
        try:
            await self._store(functools.partial(self.store.delete, key, if_match=etag))
        except (FsError, StoreError) as exc:
            log.warning("mkdir failed here but its entry %s stays in the store: %s", key,
                        exc)

    async def _mkdir_local(self, parent: Inode, name: bytes, mode: int, uid: int,
                           gid: int, dir_id: str) -> Inode:
        """Async mode: the directory exists here at once; the store gets it in log
        order (``_exec_mkdir``).  Inode, name and journal record are one transaction."""
        self._touch_dir(parent.ino)
        with self.ns.batch():
            inode = self.ns.new_inode(parent.ino, name, "dir", mode & 0o7777, uid, gid,
                                      dir_id=dir_id, published=False,
                                      mtime_ns=time.time_ns(),
                                      staged=self.config.profiles.staged_on_create(name))
            self._mark_parent_changed(parent)
            self.oplog.add({"kind": "mkdir", "ino": inode.ino, "parent_id": parent.dir_id,
                            "name": name.hex()}, dirs=[parent.ino])
        await self._sync_journal()
        return inode

    def _mark_parent_changed(self, parent: Inode) -> None:
        now = time.time_ns()
        parent.mtime_ns = parent.ctime_ns = now
        self.ns.save(parent)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        await self._check_absent(parent, name)
        self._touch_dir(parent)
        inode = self.ns.new_inode(parent, name, "symlink", 0o777, uid, gid, target=target,
                                  size=len(target))
        return await self._publish_new_name(inode, parent)

    async def _publish_new_name(self, inode: Inode, parent: int) -> Inode:
        """Put the entry of a name that has no data (symlink, special file, empty file):
        if the store refuses, the name goes again.  Async mode: the name is here at
        once and its entry is a record of the metadata log (``_exec_put``), after the
        records before it (a rename over the same name still pending must not land
        after it and overwrite it)."""
        if self._deferred():
            parent_inode = self.ns.get(parent)
            self.oplog.add({"kind": "put", "ino": inode.ino, "parent_id": parent_inode.dir_id,
                            "name": inode.name.hex()}, dirs=[parent])
            self._mark_parent_changed(parent_inode)
            await self._sync_journal()
            return inode
        try:
            await self._put_entry(inode)
        except BaseException:
            self.ns.unlink(inode)
            self.ns.delete_inode(inode.ino)
            raise
        self._mark_parent_changed(self.ns.get(parent))
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
        self._dir(parent)
        self._touch_dir(parent)
        inode = self.ns.new_inode(parent, name, kind, mode, uid, gid, rdev=rdev)
        return await self._publish_new_name(inode, parent)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
                     opener: Opener) -> tuple[Handle, Inode]:
        with self.upload_gate.busy():       # a writer at work: uploads wait (decision 0015)
            return await self._create(parent, name, mode, flags, uid, gid, opener)

    async def _create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                      gid: int, opener: Opener) -> tuple[Handle, Inode]:
        check_name_or_raise(name)
        await self.refresh_dir(parent)
        existing = self.ns.lookup(parent, name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            handle = await self.open(existing, flags, opener)
            return handle, self.ns.get(existing)
        parent_inode = self._dir(parent)
        self._touch_dir(parent)
        # A new name has no closed version until its writer's close: if the writer is
        # killed, the name goes again.  Inode, staging file, then the name: a full
        # state dir (ENOSPC) or no descriptor left (EMFILE) leaves nothing behind.
        inode = self.ns.reserve_inode("file", mode, uid, gid, max_ver=1)
        try:
            self.staging.create_empty(inode.ino, 1)
            try:
                self.ns.attach(inode, parent_inode, name)
            except BaseException:
                self.staging.remove(inode.ino, 1)
                raise
        except OSError as exc:
            self.ns.forget_reserved(inode)
            raise FsError(exc.errno or errno.EIO, f"staging file: {exc.strerror}") from None
        except BaseException:
            self.ns.forget_reserved(inode)
            raise
        rt = self._rt(inode.ino)
        session = self._start_session(inode, rt, 1)
        session.tracker.reset()
        session.wrote = True  # creating the file is a change worth publishing
        handle = self._new_handle(inode, opener, writable=True)
        await self.leases.writing(inode)
        return handle, inode

    # ------------------------------------------------------------------ removing names

    async def unlink(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        await self._remove(inode, parent, name)
        if self._deferred():
            await self._sync_journal()

    async def rmdir(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        await self.refresh_dir(inode.ino, force=not self._deferred())
        if self.ns.has_children(inode.ino):
            raise FsError(errno.ENOTEMPTY)
        await self._remove(inode, parent, name)
        if self._deferred():
            await self._sync_journal()

    async def _remove(self, inode: Inode, parent_ino: int, name: bytes) -> None:
        # Under the inode's lock: an entry PUT in flight (a publish) lands first, then
        # its key is deleted here, instead of landing after and resurrecting the name.
        rt = self._rt(inode.ino)
        async with rt.lock:
            inode = self.ns.get(inode.ino)
            if self.ns.lookup(parent_ino, name) != inode.ino:
                return
            parent = self.ns.get(parent_ino)
            if inode.published and not inode.links_pending and self._deferred() \
                    and not inode.link_id:
                self._log_delete(inode, parent, name)
            elif inode.published and not inode.links_pending:
                await self._store(self.store.delete, entry_key(parent.dir_id, name))
                if inode.link_id:
                    await self._change_nlink(inode, -1)
            elif self._deferred():
                self._release_held(inode, parent, name)
            else:
                await self._delete_held(inode, parent, name)
            self._touch_dir(parent.ino)
            self.ns.unlink(inode, parent_ino, name)
            self._mark_parent_changed(parent)
        self._drop_rt(inode.ino)
        if not inode.parent and not self._is_open(inode.ino):
            self._delete_inode(inode)

    def _log_delete(self, inode: Inode, parent: Inode, name: bytes) -> None:
        """Async mode: the store's entry of a removed name goes in log order, if it is
        still the object this node removed (``_exec_delete``)."""
        self.oplog.add({"kind": "delete", "ino": inode.ino, "parent_id": parent.dir_id,
                        "name": name.hex(), **self._identity(inode)}, dirs=[parent.ino])

    # ------------------------------------------------------------------ hard links

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A further name for a non-directory (decision 0008).  The first link moves
        the content into a shared inode object; each name is a "link" entry to it."""
        check_name_or_raise(new_name)
        inode = self.ns.get(ino)
        if inode.type == "dir":
            raise FsError(errno.EPERM, "hard links to directories")
        await self._check_absent(new_parent, new_name)
        new_dir = self._dir(new_parent)
        await self._follow_the_log("hard link")
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.get(ino)
            if not inode.parent:
                raise FsError.enoent("the file was removed")
            if self.ns.lookup(new_parent, new_name) is not None:
                raise FsError(errno.EEXIST)
            if inode.published and not inode.links_pending:
                if not inode.link_id:
                    await self._make_linked(inode)
                await self._change_nlink(inode, +1)
                key = entry_key(new_dir.dir_id, new_name)
                created = await self._store(self.store.put_if_absent, key,
                                            self._entry_of(inode).to_json())
                if not created:
                    await self._change_nlink(inode, -1)
                    raise FsError(errno.EEXIST)
            else:
                # Not published yet (a first version still being written, or queued in
                # async mode): its first publish writes the object and every name.
                if not inode.link_id:
                    self.ns.set_link_id(inode, uuid.uuid4().hex)
                inode.links_pending = True
            self._touch_dir(new_parent)
            self.ns.add_name(inode, new_parent, new_name)
            self._mark_parent_changed(self.ns.get(new_parent))
        self._drop_rt(ino)
        return self.ns.get(ino)


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
