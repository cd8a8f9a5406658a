"""Did the process that opened a file finish, or was it killed?  (DESIGN.md promise 2.)

The kernel closes a killed process's descriptors for it, and a FUSE filesystem receives
an ordinary FLUSH.  We record the opener at open/create and, at flush, read
``/proc/<tid>/stat``: a task that is exiting (``PF_EXITING``) with a signal or a non-zero
status in ``exit_code`` did not mean to close.  Knows nothing of files or FUSE.
"""

from __future__ import annotations

import os
import re
import select
from collections import OrderedDict
from dataclasses import dataclass, field

PF_EXITING = 0x4


@dataclass(frozen=True)
class Opener:
    tid: int
    tgid: int

    @classmethod
    def from_tid(cls, tid: int) -> "Opener":
        return cls(tid=tid, tgid=_tgid_of(tid) or tid)


def _read_proc(path: str) -> bytes | None:
    """A whole /proc file by raw reads (a buffered ``open`` costs as much again as the
    kernel's work for these small files, and a small file's close reads several)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_all(fd, 1 << 13)
    finally:
        os.close(fd)


def _read_all(fd: int, piece: int) -> bytes | None:
    """From ``fd``'s offset to its end, or None if a read fails."""
    parts: list[bytes] = []
    try:
        while True:
            part = os.read(fd, piece)
            if not part:
                return b"".join(parts)
            parts.append(part)
    except OSError:
        return None


def _tgid_of(tid: int) -> int | None:
    """The thread group of task ``tid``.  Most openers are a process's main thread
    (its thread-group leader, tgid == tid): ``pidfd_open`` accepts exactly those
    (EINVAL for any other thread), for a fraction of what generating
    ``/proc/<tid>/status`` costs the kernel (that read was 7% of a small-file copy's
    daemon time); another thread's group is read from its status."""
    try:
        os.close(os.pidfd_open(tid))
        return tid
    except ProcessLookupError:
        return None
    except OSError:
        pass            # EINVAL: not a leader; anything else: ask /proc
    raw = _read_proc(f"/proc/{tid}/status")
    if raw is None:
        return None
    start = raw.find(b"\nTgid:")
    if start < 0:
        return None
    try:
        return int(raw[start + 6:raw.index(b"\n", start + 1)])
    except ValueError:
        return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/<pid>/stat (after the command name), or None if gone."""
    raw = _read_proc(f"/proc/{pid}/stat")
    if raw is None:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def exit_state(pid: int) -> tuple[bool, int] | None:
    """(exiting, exit_code) of a task, or None if it no longer exists."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 50:
        return None
    flags = int(fields[9 - 3])
    exit_code = int(fields[52 - 3])
    return bool(flags & PF_EXITING), exit_code


SIGKILL_BIT = 1 << (9 - 1)       # SIGKILL in /proc's pending-signal masks


def kill_pending(pid: int) -> bool:
    """True if task ``pid`` has SIGKILL pending (for the thread or its group): it
    waits for nothing but the daemon's answer to die -- the kernel does not interrupt
    a FUSE request the daemon is working on.  A task that is gone is not: a child may
    write on through a descriptor it inherited."""
    raw = _read_proc(f"/proc/{pid}/status")
    if raw is None:
        return False
    for field in (b"\nSigPnd:", b"\nShdPnd:"):
        start = raw.find(field)
        if start < 0:
            continue
        try:
            mask = int(raw[start + len(field):raw.index(b"\n", start + 1)].strip(), 16)
        except ValueError:
            continue
        if mask & SIGKILL_BIT:
            return True
    return False


def died_unclean(opener: Opener) -> bool:
    """True if the opener is exiting because of a signal or with a non-zero status."""
    for pid in (opener.tid, opener.tgid):
        state = exit_state(pid)
        if state is None:
            continue  # thread gone: ask its thread group
        exiting, code = state
        if not exiting:
            return False
        return (code & 0x7F) != 0 or (code >> 8) != 0
    return False  # nobody left to ask: someone who inherited the descriptor closed it


def holds_for_writing(pid: int, ino: int, device: bytes,
                      tables: "MountTables | None" = None) -> bool:
    """Does process ``pid`` still hold a descriptor open for writing on inode ``ino`` of
    our mount (``device``: its ``major:minor`` in mountinfo)?  A FLUSH comes at every
    close: a forked child's, a ``subprocess`` closing its close-on-exec copy, a dup's.
    Only the opener's last close is a close it meant.

    Works in the process's own mount namespace (a container's bind mount of the mount
    point at another path has another mount id and path): the mount points of our
    device come from ``/proc/<pid>/mountinfo``, descriptors from ``/proc/<pid>/fd``
    (link targets are names the kernel already has: no request to our own mount), and
    ``fdinfo`` (``mnt_id``, ``ino``, ``flags``) is read only for descriptors under them.
    ``tables`` keeps each namespace's mount table between calls (``MountTables``)."""
    mounts = tables.of(pid, device) if tables is not None else _mounts_of_device(pid, device)
    if not mounts:
        return False
    prefixes = [mp.rstrip(b"/") + b"/" for mp in mounts.values()]
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(os.fsencode(f"{fd_dir}/{fd}"))
        except OSError:
            continue
        if not any(target.startswith(p) for p in prefixes):
            continue
        info = _fdinfo(pid, fd)
        if info is None or info.get(b"mnt_id") not in mounts or info.get(b"ino") != ino:
            continue
        if info.get(b"flags", 0) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            return True
    return False


def _mounts_of_device(pid: int | str, device: bytes) -> dict[int, bytes]:
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            return _of_device(f.read(), device)
    except OSError:
        return {}


def _of_device(mountinfo: bytes, device: bytes) -> dict[int, bytes]:
    """Mount id -> mount point of every mount of ``device`` in a mountinfo text."""
    out = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[2] == device:
            out[int(fields[0])] = _unescape(fields[4])
    return out


@dataclass
class _Table:
    fd: int
    poller: select.poll
    text: bytes
    parsed: dict[bytes, dict[int, bytes]] = field(default_factory=dict)


class MountTables:
    """Each mount namespace's mount table, kept between closes and read again only when
    the kernel says it changed: a ``poll`` of an open ``mountinfo`` reports ``POLLPRI``
    after any mount or unmount in its namespace since the previous poll.  Reading and
    parsing it at every close was most of a small file's close, more so on a node with
    hundreds of mounts.  Keeps one descriptor per namespace, at most ``keep``, the least
    recently asked closed first.  One thread only (the daemon's trio thread)."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.reads = 0
        # (st_dev, st_ino) of the namespace -> its mountinfo descriptor, the poller
        # watching it, its text, and that text parsed per device asked for.
        self._tables: OrderedDict[tuple[int, int], _Table] = OrderedDict()

    def of(self, pid: int, device: bytes) -> dict[int, bytes]:
        """Mount id -> mount point of ``device``'s mounts in ``pid``'s namespace; empty
        if the process is gone (or its table cannot be read)."""
        try:
            ns = os.stat(f"/proc/{pid}/ns/mnt")
        except OSError:
            return {}
        key = (ns.st_dev, ns.st_ino)
        table = self._tables.get(key)
        if table is None:
            return self._open(pid, key, device)
        self._tables.move_to_end(key)
        if table.poller.poll(0):                # an event: the table changed since
            fresh = self._read(table.fd)
            if fresh is None:
                self._drop(key)
                return {}
            table.text, table.parsed = fresh, {}
        if device not in table.parsed:
            table.parsed[device] = _of_device(table.text, device)
        return table.parsed[device]

    def _open(self, pid: int, key: tuple[int, int], device: bytes) -> dict[int, bytes]:
        try:
            fd = os.open(f"/proc/{pid}/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return {}
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        text = self._read(fd)
        try:
            same = os.stat(f"/proc/{pid}/ns/mnt")
            same_ns = (same.st_dev, same.st_ino) == key
        except OSError:
            same_ns = False
        if text is None or not same_ns:        # gone, or moved to another namespace
            os.close(fd)
            return _of_device(text or b"", device)
        table = self._tables[key] = _Table(fd, poller, text)
        while len(self._tables) > self.keep:
            self._drop(next(iter(self._tables)))
        table.parsed[device] = _of_device(text, device)
        return table.parsed[device]

    def _read(self, fd: int) -> bytes | None:
        self.reads += 1
        try:
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            return None
        return _read_all(fd, 1 << 16)

    def _drop(self, key: tuple[int, int]) -> None:
        os.close(self._tables.pop(key).fd)

    def held(self) -> int:
        return len(self._tables)

    def close(self) -> None:
        while self._tables:
            self._drop(next(iter(self._tables)))


def _fdinfo(pid: int, fd: str) -> dict[bytes, int] | None:
    raw = _read_proc(f"/proc/{pid}/fdinfo/{fd}")
    if raw is None:
        return None
    out: dict[bytes, int] = {}
    for line in raw.splitlines():
        key, _, value = line.partition(b":")
        try:
            out[key] = int(value.strip(), 8) if key == b"flags" else int(value.strip())
        except ValueError:
            continue
    return out


def _top_mount(mount_path: bytes) -> list[bytes] | None:
    """The fields of ``/proc/self/mountinfo``'s line for the mount on top at
    ``mount_path`` (the last one wins), or None (nothing there, or unreadable)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split()
        if len(fields) > 4 and _unescape(fields[4]) == mount_path:
            found = fields
    return found


def device_of_mount(mount_path: bytes) -> bytes | None:
    """``major:minor`` of the mount at ``mount_path`` in this process's namespace, from
    ``/proc/self/mountinfo`` (never a stat of the mount itself: that would ask us)."""
    fields = _top_mount(mount_path)
    return fields[2] if fields is not None else None


def locked_in_kernel(device: bytes, ino: int, locks: bytes | None = None) -> bool:
    """Does any process hold (or wait for) a ``flock`` or POSIX lock on inode ``ino`` of
    the mount ``device`` (``major:minor`` as mountinfo gives it, decimal)?  The kernel
    keeps the locks of a FUSE file system that takes no lock requests itself, per
    kernel inode; ``/proc/locks`` lists them as ``MAJ:MIN:INO`` (hex, hex, decimal).
    Only locks of processes this process's pid namespace can see are listed.  ``locks``:
    the file's text (tests)."""
    if locks is None:
        locks = _read_proc("/proc/locks")
        if locks is None:
            return False
    try:
        major, minor = (int(part) for part in device.split(b":"))
    except ValueError:
        return False
    want = b"%02x:%02x:%d" % (major, minor, ino)
    return any(want in line.split() for line in locks.splitlines())


def fstype_of_mount(mount_path: bytes) -> str | None:
    """The file system type (``fuse.ckptfs``, ``ext4``, ...) of the mount on top at
    ``mount_path`` in this process's namespace, from ``/proc/self/mountinfo``; None if
    nothing is mounted there (or mountinfo cannot be read)."""
    fields = _top_mount(mount_path)
    if fields is None or b"-" not in fields[5:]:
        return None
    return fields[fields.index(b"-", 5) + 1].decode(errors="replace")


def _unescape(field: bytes) -> bytes:
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)
