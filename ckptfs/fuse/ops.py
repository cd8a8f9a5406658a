"""The thin FUSE adapter: ``pyfuse3.Operations`` over ``Filesystem``.

Translates requests and replies, turns every exception into an errno (``FsError`` by
its number, anything unexpected into ``EIO`` with a log line, so the daemon stays up)
and knows nothing of S3 or LMDB.
"""

from __future__ import annotations

import collections
import errno
import functools
import json
import logging
import time

import pyfuse3
import trio

from ..errors import RESOURCE_ERRNOS, FsError, errno_of
from ..core import Filesystem
from ..meta.namespace import Inode
from ..procstat import Opener

log = logging.getLogger(__name__)

XATTR_STATE = b"user.ckptfs.state"
XATTR_STATS = b"user.ckptfs.stats"
XATTR_CONTROL = b"user.ckptfs.node.control"
XATTR_OURS = b"user.ckptfs."


def _errors(fn):
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        self.requests[op] += 1
        started = time.perf_counter()
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FsError as exc:
            # Answers, not failures: not logged (cp -a asks for every file's ACL).
            if exc.errno not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENODATA,
                                 errno.ENAMETOOLONG, errno.ENOTSUP):
                log.info("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except trio.Cancelled:
            raise
        except OSError as exc:
            if exc.errno not in RESOURCE_ERRNOS:
                log.exception("%s failed unexpectedly", fn.__name__)
            else:       # out of descriptors or space: the caller's error, one line
                log.warning("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(errno_of(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the daemon must stay up
            log.exception("%s failed unexpectedly", fn.__name__)
            raise pyfuse3.FUSEError(errno_of(exc)) from None
        finally:
            self.request_seconds[op] += time.perf_counter() - started
    return wrapper


class FuseOps(pyfuse3.Operations):
    supports_dot_lookup = True

    def __init__(self, fs: Filesystem, control_path: str, ttl: float,
                 writeback_cache: bool = False, metrics=None,
                 passthrough: bool = False) -> None:
        super().__init__()
        self.metrics = metrics          # metrics.Metrics, or None
        # Read by pyfuse3 at FUSE_INIT: let the kernel buffer writes in its page cache.
        self.enable_writeback_cache = writeback_cache
        # Read by a pyfuse3 built with passthrough (tools/patches/) at FUSE_INIT: ask the
        # kernel for it; a stock pyfuse3 ignores it (data path: daemon).
        self.enable_passthrough = passthrough
        self.fs = fs
        # Kernel requests served, by operation (``status --json``: ``fuse_requests``).
        self.requests: collections.Counter[str] = collections.Counter()
        self.request_seconds: collections.Counter[str] = collections.Counter()   # in handlers
        self.control_path = control_path
        self.ttl = ttl
        self._dirs: dict[int, tuple[int, list[tuple[bytes, Inode]]]] = {}
        self._next_dir_fh = 1

    def _attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = self.ttl
        a.attr_timeout = self.ttl
        a.st_mode = inode.st_mode
        a.st_nlink = self.fs.nlink(inode)
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
        a.st_size = inode.size
        a.st_blksize = 1 << 20
        a.st_blocks = self.fs.blocks(inode)
        a.st_atime_ns = inode.atime_ns or inode.mtime_ns
        a.st_mtime_ns = inode.mtime_ns
        a.st_ctime_ns = inode.ctime_ns or inode.mtime_ns
        return a

    # -------------------------------------------------------------- names

    @_errors
    async def lookup(self, parent_inode, name, ctx=None):
        return self._attrs(await self.fs.lookup(parent_inode, name))

    @_errors
    async def getattr(self, inode, ctx=None):
        return self._attrs(self.fs.getattr(inode))

    @_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        kwargs = {}
        if fields.update_mode:
            kwargs["mode"] = attr.st_mode
        if fields.update_uid:
            kwargs["uid"] = attr.st_uid
        if fields.update_gid:
            kwargs["gid"] = attr.st_gid
        if fields.update_size:
            kwargs["size"] = attr.st_size
        if fields.update_atime:
            kwargs["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kwargs["mtime_ns"] = attr.st_mtime_ns
        return self._attrs(await self.fs.setattr(inode, fh=fh, **kwargs))

    @_errors
    async def readlink(self, inode, ctx):
        return self.fs.readlink(inode)

    @_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._attrs(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid,
                                               ctx.gid))

    @_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attrs(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_errors
    async def unlink(self, parent_inode, name, ctx):
        await self.fs.unlink(parent_inode, name)

    @_errors
    async def rmdir(self, parent_inode, name, ctx):
        await self.fs.rmdir(parent_inode, name)

    @_errors
    async def symlink(self, parent_inode, name, target, ctx):
        return self._attrs(await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._attrs(await self.fs.link(inode, new_parent_inode, new_name))

    # -------------------------------------------------------------- files

    @_errors
    async def open(self, inode, flags, ctx):
        handle = await self.fs.open(inode, flags, Opener.from_tid(ctx.pid))
        return self._file_info(handle, pyfuse3.FileInfo(
            fh=handle.fh, keep_cache=handle.keep_cache, direct_io=handle.direct_io))

    def _file_info(self, handle, info: pyfuse3.FileInfo) -> pyfuse3.FileInfo:
        if handle.passthrough:
            # The kernel reads and writes the staging file itself from here on (the
            # descriptor is used by pyfuse3 before anything else runs).
            # (setattr: a stock pyfuse3's FileInfo has no such field; passthrough is
            # never decided with one, fuse/datapath.py)
            setattr(info, "backing_fd", self.fs.backing_fd(handle))
            info.keep_cache = False     # the kernel refuses keep_cache with passthrough
        return info

    @_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        handle, inode = await self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid,
                                             Opener.from_tid(ctx.pid))
        # direct_io: an open of a name whose inode passthrough handles write (opening.py)
        info = pyfuse3.FileInfo(fh=handle.fh, direct_io=handle.direct_io)
        return self._file_info(handle, info), self._attrs(inode)

    @_errors
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    @_errors
    async def write(self, fh, off, buf):
        n = await self.fs.write(fh, off, buf)
        if self.metrics is not None:
            self.metrics.written.inc(n)
        return n

    @_errors
    async def flush(self, fh):
        started = time.monotonic()
        try:
            await self.fs.flush(fh)
        finally:
            self._blocked("close", started)

    @_errors
    async def fsync(self, fh, datasync):
        started = time.monotonic()
        try:
            await self.fs.fsync(fh, datasync)
        finally:
            self._blocked("fsync", started)

    def _blocked(self, op: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.blocked.labels(op=op).observe(time.monotonic() - started)

    @_errors
    async def release(self, fh):
        await self.fs.release(fh)

    # -------------------------------------------------------------- directories

    @_errors
    async def readdir(self, fh, start_id, token):
        dir_ino, entries = self._dirs.get(fh, (0, []))
        for index in range(start_id, len(entries)):
            name, inode = entries[index]
            if name not in (b".", b"..") and (dir_ino, name) not in inode.names:
                # Renamed, removed or moved to a fresh inode since the opendir: the
                # kernel takes the name with these attributes (readdirplus), so never
                # an inode that no longer holds it.
                try:
                    inode = await self.fs.lookup(dir_ino, name)
                except FsError:
                    continue
            if not pyfuse3.readdir_reply(token, name, self._attrs(inode), index + 1):
                break

    @_errors
    async def releasedir(self, fh):
        self._dirs.pop(fh, None)

    @_errors
    async def opendir(self, inode, ctx):
        entries = await self.fs.listdir(inode)
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        self._dirs[fh] = (inode, entries)
        return fh

    @_errors
    async def fsyncdir(self, fh, datasync):
        # fsync on a directory seals it if it is a staged checkpoint (promise 4).
        entry = self._dirs.get(fh)
        if entry is not None:
            await self.fs.seal(entry[0])

    @_errors
    async def statfs(self, ctx):
        st = self.fs.statvfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.f_bsize
        out.f_frsize = st.f_frsize
        out.f_blocks = st.f_blocks
        out.f_bfree = st.f_bfree
        out.f_bavail = st.f_bavail
        out.f_files = st.f_files
        out.f_ffree = st.f_ffree
        out.f_favail = st.f_favail
        out.f_namemax = 255
        return out

    # -------------------------------------------------------------- xattrs

    @_errors
    async def getxattr(self, inode, name, ctx):
        if name == XATTR_STATE:
            return self.fs.state_of(inode).encode()
        if name == XATTR_STATS:
            return json.dumps(self.fs.stats(), sort_keys=True).encode()
        if name == XATTR_CONTROL:
            return self.control_path.encode()
        return self.fs.getxattr(inode, name)

    @_errors
    async def listxattr(self, inode, ctx):
        # user.ckptfs.* are readable by name but not listed (cp -a stays quiet).
        return self.fs.listxattr(inode)

    @_errors
    async def setxattr(self, inode, name, value, ctx):
        if name.startswith(XATTR_OURS):
            raise FsError(errno.EPERM, "user.ckptfs.* is ckptfs's read-only status")
        await self.fs.setxattr(inode, name, value)

    @_errors
    async def removexattr(self, inode, name, ctx):
        if name.startswith(XATTR_OURS):
            raise FsError(errno.EPERM, "user.ckptfs.* is ckptfs's read-only status")
        await self.fs.setxattr(inode, name, None)
