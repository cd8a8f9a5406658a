"""The client of a daemon's control socket, for training scripts and for the ``ckptfs``
command alike::

    import ckptfs
    ckptfs.wait("/mnt/ckpt/run1/checkpoint-100", timeout=600)   # durable in the store
    ckptfs.state("/mnt/ckpt/run1/checkpoint-100/model.safetensors")  # "uploading", ...
    ckptfs.commit("/mnt/ckpt/run1/checkpoint-100")               # seal a staged dir

The mount that holds a path is found in ``/proc/self/mountinfo`` (the deepest mount
point above it, of type ``fuse.ckptfs``); its daemon names its control socket in the
``user.ckptfs.node.control`` attribute of the mount's root.  Errors: ``NotMounted`` (a
``ConnectionError``) when no ckptfs mount holds the path, ``ConnectionError`` when its
daemon cannot be reached, ``OSError`` subclasses with the daemon's one-line reason for
a refused request (``PermissionError``, ``FileNotFoundError``, ...), ``TimeoutError``.

Knows the control protocol (one JSON request, JSON lines back), nothing of the daemon's
insides.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

FSTYPE = "fuse.ckptfs"
CONTROL_XATTR = "user.ckptfs.node.control"

Progress = Callable[[dict], None]


class NotMounted(ConnectionError):
    """No ckptfs mount holds the path."""


@dataclass
class CommitResult:
    sealed: bool               # sealed by this call (False: it was visible already)
    pending: dict | None       # the seal waits for other nodes still writing below it
    journaled: bool = False    # async mode: journaled; shown once in the store (wait)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees, in order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            try:
                sep = fields.index("-")
            except ValueError:
                continue
            out.append((_unescape(fields[4]), fields[sep + 1]))
    return out


def mount_of(path: str | os.PathLike) -> Path:
    """The mount point of the ckptfs mount that holds ``path``."""
    target = os.path.abspath(path)
    best, best_type = "", ""
    for point, fstype in mounts():
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fstype
    if best_type != FSTYPE:
        raise NotMounted(f"{path} is not a ckptfs mount nor below one (it is on {best}, "
                         f"{best_type or 'unknown'})")
    return Path(best)


def control_socket(mountpoint: Path) -> str:
    try:
        return os.getxattr(mountpoint, CONTROL_XATTR).decode()
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise ConnectionError(f"{mountpoint}: the daemon is gone (transport endpoint "
                                  "not connected)") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ConnectionError(f"{mountpoint}: permission denied reading "
                                  f"{CONTROL_XATTR} ({exc.strerror})") from None
        raise NotMounted(f"{mountpoint} is not a ckptfs mount ({exc.strerror})") from None


BUSY_RETRY_FOR = 60.0   # s a request the daemon turned away as busy is retried (no timeout)


def request(mountpoint: Path, doc: dict, timeout: float | None = None) -> Iterator[dict]:
    """Send ``doc`` to the daemon serving ``mountpoint``; yield its replies.  Past
    ``timeout`` seconds (overall) ``TimeoutError``; every failure to reach or understand
    the daemon is a ``ConnectionError`` with one line.  A connection the daemon turns
    away because its caps are full (``busy``: many connections of this user at once)
    is tried again, with backoff, until ``timeout`` (or ``BUSY_RETRY_FOR``)."""
    path = control_socket(mountpoint)
    deadline = None if timeout is None else time.monotonic() + timeout
    give_up = time.monotonic() + BUSY_RETRY_FOR if deadline is None else deadline
    pause = 0.05
    while True:
        sock = _connect(mountpoint, path)
        try:
            sock.sendall(json.dumps(doc).encode() + b"\n")
            lost = None
        except OSError as exc:      # turned away before it read: its reply is there
            lost = exc
        replies = _replies(mountpoint, sock, deadline)
        first = next(replies, None)
        if first is None:
            if lost is not None:
                raise ConnectionError(f"{mountpoint}: lost the connection to the daemon "
                                      f"({lost.strerror or lost})") from None
            return iter(())
        if first.get("busy") and time.monotonic() + pause < give_up:
            replies.close()
            time.sleep(pause)
            pause = min(1.0, pause * 2)
            continue
        return itertools.chain([first], replies)


def _connect(mountpoint: Path, path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ConnectionError(f"{mountpoint}: permission denied on the control socket "
                                  f"{path}") from None
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
            raise ConnectionError(f"{mountpoint}: the daemon's control socket {path} is gone "
                                  f"({exc.strerror}); is the daemon still running?") from None
        raise ConnectionError(f"{mountpoint}: cannot reach the daemon at {path} "
                              f"({exc.strerror})") from None
    return sock


def _replies(mountpoint: Path, sock: socket.socket,
             deadline: float | None) -> Generator[dict, None, None]:
    buffer = b""
    with sock:
        while True:
            while b"\n" not in buffer:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{mountpoint}: timed out")
                    sock.settimeout(left)
                try:
                    piece = sock.recv(65536)
                except TimeoutError:
                    raise TimeoutError(f"{mountpoint}: timed out") from None
                except OSError as exc:
                    raise ConnectionError(f"{mountpoint}: lost the connection to the daemon "
                                          f"({exc.strerror or exc})") from None
                if not piece:
                    if buffer.strip():
                        break
                    return
                buffer += piece
            line, _, buffer = buffer.partition(b"\n")
            try:
                yield json.loads(line)
            except ValueError:
                raise ConnectionError(f"{mountpoint}: the daemon sent a reply that is not "
                                      f"JSON: {line[:80]!r}") from None


def refused(reply: dict) -> OSError:
    """The ``OSError`` (subclass by errno) for an error reply."""
    code = getattr(errno, str(reply.get("errno")), errno.EIO)
    return OSError(code, reply["error"])


def _final(mountpoint: Path, replies: Iterator[dict], progress: Progress | None) -> dict:
    for reply in replies:
        if reply.get("error"):
            raise refused(reply)
        if reply.get("done"):
            return reply
        if progress is not None:
            progress(reply)
    raise ConnectionError(f"{mountpoint}: the daemon closed the connection early")


def wait(path: str | os.PathLike, timeout: float | None = None,
         progress: Progress | None = None) -> None:
    """Block until every file closed at or below ``path`` is durable in the store.
    ``TimeoutError`` after ``timeout`` seconds; ``OSError`` if an upload below it is
    refused by the store and waits for an operator (it stays staged and retried).  ``progress`` gets each progress reply (pending uploads, bytes)."""
    path = Path(os.path.abspath(path))
    mount = mount_of(path)
    _final(mount, request(mount, {"cmd": "wait", "path": str(path)}, timeout), progress)


def state(path: str | os.PathLike) -> str:
    """``staged``, ``uploading``, ``published``, ``remote`` or ``cached``."""
    path = Path(os.path.abspath(path))
    mount = mount_of(path)
    return _final(mount, request(mount, {"cmd": "state", "path": str(path)}), None)["state"]


def commit(path: str | os.PathLike) -> CommitResult:
    """Seal a staged checkpoint directory (make it listed everywhere).  In async mode
    the seal is journaled and this returns at once (``journaled``); the directory is
    listed once it is in the store, which ``wait(path)`` waits for."""
    path = Path(os.path.abspath(path))
    mount = mount_of(path)
    reply = _final(mount, request(mount, {"cmd": "commit", "path": str(path)}), None)
    return CommitResult(bool(reply.get("sealed")), reply.get("pending") or None,
                        bool(reply.get("journaled")))
