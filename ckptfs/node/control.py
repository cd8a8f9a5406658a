"""The daemon's control socket: one JSON request per connection, one or more JSON
replies (progress lines, then a last line with ``done`` or ``error``).  Serves
``status``, ``staged``, ``state``, ``wait``, ``commit``, ``prefetch``, ``gc`` and
``umount``.

Every local user may connect.  Who asks is known from the socket's peer credentials
(``SO_PEERCRED``): anyone may ask ``status``, ``staged``, ``state`` and ``wait``;
``commit`` and ``prefetch`` need the caller's own permission on the path (write, resp.
read, with search on every directory above it: checked like access(2), against the
uid and groups of the calling process); ``prefetch`` of a tree walks it as the caller
would, skipping (and counting) the files it may not read and the directories it may not
list and search; ``gc`` and ``umount`` are root's, and the daemon's own user's (a mount
made by an ordinary user, who could stop the daemon with a signal anyway).

Knows the filesystem's public calls and the daemon's stop and drain hooks (``Host``);
nothing of FUSE request details or of how the store is reached.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from .control_gate import Gate, Limits
from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode

log = logging.getLogger(__name__)

READ, WRITE, EXECUTE = 4, 2, 1
ANYONE = frozenset({"status", "staged", "state", "wait"})
ROOT_ONLY = frozenset({"gc", "umount"})

Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class Peer:
    """The process at the other end of the socket (``SO_PEERCRED``), with its groups."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @classmethod
    def of(cls, sock: socket.socket | trio.socket.SocketType) -> "Peer":
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return cls(pid, uid, gid, frozenset({gid}) | _groups_of(pid))

    @property
    def root(self) -> bool:
        return self.uid == 0


def _groups_of(pid: int) -> frozenset[int]:
    """Supplementary groups of a process (``/proc/<pid>/status``); none if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def permitted(inode: Inode, peer: Peer, want: int) -> bool:
    """May ``peer`` do ``want`` (READ|WRITE|EXECUTE bits) on ``inode``, by its mode bits
    like access(2): the owner class if the peer owns it, else the group class if it is
    in the group, else the others; root may do anything."""
    if peer.root:
        return True
    mode = inode.mode
    if peer.uid == inode.uid:
        bits = (mode >> 6) & 7
    elif inode.gid in peer.groups:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


class Host(Protocol):
    """What the control socket needs of the daemon."""

    fs: Any
    opts: Any
    config: Any
    stale: Any

    def status_doc(self) -> dict: ...
    def pending(self, inos: set[int] | None = None) -> dict: ...
    async def drain(self, deadline: float, progress=None) -> None: ...
    def stop_deadline(self) -> float | None: ...
    def request_stop(self, deadline: float) -> None: ...


ACCEPT_RETRY = 0.1      # s to wait after accept(2) failed for want of descriptors
REFUSE_PAUSE = 0.001    # s after refusing a connection: a flood costs at most ~1000/s
QUIETLY = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EAGAIN})


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process that connected (``SO_PEERCRED``), None if unknown."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", raw)[1]


def refuse(sock: socket.socket, message: str, code: str) -> None:
    """One line of error and close, without reading and without waiting: what does not
    fit the socket's send buffer at once is dropped."""
    try:
        sock.send(json.dumps({"error": f"ckptfs control socket: {message}",
                              "errno": code, "busy": True}).encode() + b"\n",
                  socket.MSG_DONTWAIT)
    except OSError:
        pass
    sock.close()


class ControlServer:
    def __init__(self, host: Host, path: str, limits: Limits | None = None) -> None:
        self.host = host
        self.path = path
        if limits is None:
            limits = Limits.for_fd_limit(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.gate = Gate(limits)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            sock.bind(self.path)
            # Any local user may connect; what each may ask is checked per request, and
            # what each may hold is capped (control_gate.py).
            os.chmod(self.path, 0o666)
            sock.listen(128)
            sock.setblocking(False)
            task_status.started()
            async with trio.open_nursery() as nursery:
                await self._accept_loop(sock, nursery)

    async def _accept_loop(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        """Accept, then admit or refuse at once by the peer's uid.  Not
        ``trio.serve_listeners``: it logs a traceback every 0.1 s while accept fails
        with EMFILE, and it raises (ending the daemon) on any other accept error."""
        gate = self.gate
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno not in QUIETLY:
                    gate.accept_failed(exc)
                    await trio.sleep(ACCEPT_RETRY)
                continue
            uid = peer_uid(conn)
            refusal = "the peer's credentials are unknown" if uid is None else gate.admit(uid)
            if refusal is not None:
                refuse(conn, refusal, "EAGAIN")
                if uid is not None:
                    gate.offence(uid, "connections over the cap")
                await trio.sleep(REFUSE_PAUSE)
            elif uid is not None:           # admitted: always, its credentials are known
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
                nursery.start_soon(self._client, stream, uid)

    async def _client(self, stream: trio.SocketStream, uid: int) -> None:
        # A client that goes away (Ctrl-C on `ckptfs wait`) or sends garbage must never
        # take the daemon down with it.
        try:
            await self._serve_request(stream, uid)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("control client went away")
        except Exception:  # noqa: BLE001
            log.exception("control request failed")
        finally:
            self.gate.release(uid)

    async def _read_request(self, stream: trio.SocketStream, uid: int) -> bytes | None:
        """The request line, at most ``max_request`` bytes, arrived within the deadline;
        otherwise one line of error and None (None too if the client went away)."""
        limits = self.gate.limits
        data = bytearray()
        with trio.move_on_after(limits.deadline):
            while True:
                piece = await stream.receive_some(limits.max_request + 1 - len(data))
                if not piece:
                    return None
                end = piece.find(b"\n")
                data += piece if end < 0 else piece[:end + 1]
                if len(data) > limits.max_request:
                    await self._reject(stream, uid, f"request over {limits.max_request} "
                                       "bytes", "EMSGSIZE")
                    return None
                if end >= 0:
                    return bytes(data)
        await self._reject(stream, uid, f"no complete request within {limits.deadline:g} s",
                           "ETIMEDOUT")
        return None

    async def _reject(self, stream: trio.SocketStream, uid: int, message: str,
                      code: str) -> None:
        self.gate.offence(uid, message)
        with trio.move_on_after(1):
            await stream.send_all(json.dumps({"error": f"ckptfs control socket: {message}",
                                              "errno": code}).encode() + b"\n")

    async def _serve_request(self, stream: trio.SocketStream, uid: int) -> None:
        async with stream:
            data = await self._read_request(stream, uid)
            if data is None:
                return
            try:
                request = json.loads(data)
                command = request["cmd"]
            except (ValueError, KeyError, TypeError, RecursionError):
                command = None
            if not isinstance(command, str):
                await stream.send_all(b'{"error": "bad request"}\n')
                return

            async def send(doc: dict) -> None:
                await stream.send_all(json.dumps(doc).encode() + b"\n")

            peer = Peer.of(stream.socket)
            await self.dispatch(command, request, peer, send)

    async def dispatch(self, command: str, request: dict, peer: Peer, send: Send) -> None:
        host = self.host
        fs = host.fs
        if command in ROOT_ONLY and not (peer.root or peer.uid == os.geteuid()):
            await send({"error": f"{command}: permission denied: only root (or uid "
                                 f"{os.geteuid()}, who mounted it) may run "
                                 f"`ckptfs {command}` (you are uid {peer.uid})",
                        "errno": "EACCES"})
            return
        if command == "status":
            await send({**host.status_doc(), "control": self.gate.report()})
        elif command == "staged":
            await send({"ok": True, "stale_staged_after": host.config.stale_staged_after,
                        "staged": [d.to_json() for _, d in host.stale.scan()]})
        elif command == "state":
            inode = await self._resolve(request.get("path", ""), peer, 0, send)
            if inode is not None:
                await send({"ok": True, "done": True, "state": fs.state_of(inode.ino),
                            "type": inode.type, "size": inode.size})
        elif command == "wait":
            await self._wait(request.get("path"), peer, send)
        elif command == "umount":
            await self._umount(request, send)
        elif command == "commit":
            await self._commit(request.get("path", ""), peer, send)
        elif command == "gc":
            await self._gc(bool(request.get("dry_run")),
                           float(request.get("grace", host.config.gc_grace)), send)
        elif command == "prefetch":
            await self._prefetch(request.get("path", ""), peer, send)
        else:
            await send({"error": f"unknown command {command!r}"})

    # ------------------------------------------------------------------ paths

    def _relative(self, path: str) -> bytes | None:
        relative = os.path.relpath(path, self.host.opts.mountpoint)
        return None if relative.startswith("..") else os.fsencode(relative)

    async def _resolve(self, path: str, peer: Peer, want: int, send: Send) -> Inode | None:
        """The inode at ``path`` if ``peer`` may reach it (search on every directory
        above it) and do ``want`` on it; otherwise send the error and return None."""
        fs = self.host.fs
        relative = self._relative(path) if isinstance(path, str) else None
        if relative is None:
            await send({"error": f"{path} is not under {self.host.opts.mountpoint}"})
            return None
        try:
            inode = fs.ns.get(ROOT_INO)
            for part in relative.split(b"/"):
                if part in (b"", b"."):
                    continue
                if not permitted(inode, peer, EXECUTE):
                    raise FsError(errno.EACCES)
                inode = await fs.lookup(inode.ino, part)
            if want and not permitted(inode, peer, want):
                raise FsError(errno.EACCES)
        except FsError as exc:
            await send({"error": f"{path}: {os.strerror(exc.errno)}",
                        "errno": errno.errorcode.get(exc.errno, "EIO")})
            return None
        return inode

    def _under(self, top: Inode, inos) -> set[int]:
        """The inodes among ``inos`` that are ``top`` or below it."""
        ns = self.host.fs.ns
        if top.ino == ROOT_INO:
            return set(inos)
        out = set()
        for ino in inos:
            cur = ns.maybe_get(ino)
            while cur is not None:
                if cur.ino == top.ino:
                    out.add(ino)
                    break
                if not cur.parent or cur.ino == ROOT_INO:
                    break
                cur = ns.maybe_get(cur.parent)
        return out

    def _followed(self, top: Inode) -> Inode:
        """``top``, or the inode its name moved to beside readers since: a file's
        owed version (and its publish) goes with the name (core/taken.py)."""
        now = self.host.fs.ns.maybe_get(self.host.fs.now_at(top.ino))
        return now if now is not None else top

    def _unfinished_under(self, top: Inode) -> set[int]:
        """Uploads (and held pointer files) at or below ``top``, and — async mode —
        metadata records of the store-bound log that touch ``top``, a directory below
        it or one above it (a pending mkdir or rename of an ancestor: the path is not
        in the store yet).  Records count by their sequence number, negated."""
        fs = self.host.fs
        found = self._under(top, fs.queue.active() | set(fs._held_pointers) |
                            fs.closing_at_release)
        above = set()
        cur = top
        while cur is not None:
            above.add(cur.ino)
            if not cur.parent or cur.ino == ROOT_INO:
                break
            cur = fs.ns.maybe_get(cur.parent)
        for seq, record in fs.oplog.pending.items():
            inos = set(record.get("dirs", ())) | {record.get("ino")} - {None}
            if inos & above or self._under(top, inos):
                found.add(-seq)
        return found

    # ------------------------------------------------------------------ commands

    async def _wait(self, path: str | None, peer: Peer, send: Send) -> None:
        """Until every closed file at or below ``path`` (default: the whole mount) is in
        the store; a progress line about once a second meanwhile."""
        host, fs = self.host, self.host.fs
        top = fs.ns.get(ROOT_INO)
        if path is not None:
            top = await self._resolve(path, peer, 0, send)
            if top is None:
                return
        asked_again = False
        while active := self._unfinished_under(top := self._followed(top)):
            if fs.oplog.refused and any(seq < 0 for seq in active):
                if not asked_again:
                    asked_again = True          # (the store may be fixed by now)
                    await fs.oplog.try_refused_again()
                    continue
                # The log applies records in order: the rest wait behind the refused one.
                await send({"error": f"{sum(seq < 0 for seq in active)} metadata "
                                     f"record(s) wait for one the store refuses, kept "
                                     f"journaled and retried: needs an operator: "
                                     f"{next(iter(fs.oplog.refused.values()))}",
                            **host.pending(active if top.ino != ROOT_INO else None)})
                return
            await send(host.pending(active if top.ino != ROOT_INO else None))
            with trio.move_on_after(1):
                await fs.wait_idle()
            await trio.sleep(0)
        failed = self._under(top, fs.queue.failed)
        if failed:
            first = fs.queue.failed[next(iter(failed))]
            await send({"error": f"{len(failed)} upload(s) refused by the store, kept "
                                 f"staged and retried: needs an operator: {first}",
                        **host.pending(failed)})
        else:
            await send({"ok": True, "done": True})

    async def _umount(self, request: dict, send: Send) -> None:
        host = self.host
        timeout = request.get("timeout", host.config.stop_timeout)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) \
                or not math.isfinite(timeout) or timeout < 0:
            await send({"error": f"bad timeout {timeout!r}"})
            return
        deadline = trio.current_time() + timeout
        stop_at = host.stop_deadline()
        if stop_at is not None:
            deadline = min(deadline, stop_at)

        async def progress() -> None:
            await send({**host.pending(), "remaining": max(0.0, deadline - trio.current_time())})

        await host.drain(deadline, progress)
        fs = host.fs
        await send({"ok": True, "done": True, "journaled": fs.pending_uploads(),
                    "failed": len(fs.queue.failed), "state_dir": str(host.opts.state_dir)})
        host.request_stop(min(deadline, trio.current_time()))

    async def _commit(self, path: str, peer: Peer, send: Send) -> None:
        fs = self.host.fs
        inode = await self._resolve(path, peer, WRITE, send)
        if inode is None:
            return
        try:
            sealed = await fs.seal(inode.ino)
        except FsError as exc:
            await send({"error": f"{path}: {os.strerror(exc.errno)}",
                        "errno": errno.errorcode.get(exc.errno, "EIO")})
            return
        await send({"done": True, "ok": True, "sealed": sealed,
                    # async mode: the seal went into the metadata log (decision 0012)
                    "journaled": bool(sealed) and fs.config.durability == "async",
                    "pending": fs.leases.pending_of(inode.ino)})

    async def _gc(self, dry_run: bool, grace: float, send: Send) -> None:
        from ..data.staging import sweep_abandoned
        from ..cluster.gc import GcConflict, collect
        from ..store import StoreError

        host, fs = self.host, self.host.fs
        messages: list[str] = []
        try:
            report = await trio.to_thread.run_sync(
                lambda: collect(fs.store, grace, dry_run, host.config.gc_settle,
                                progress=messages.append))
        except (GcConflict, StoreError) as exc:
            await send({"error": f"gc: {exc}"})
            return
        # Local leftovers: staged bytes of killed writers, past the grace period.
        abandoned = await trio.to_thread.run_sync(
            sweep_abandoned, host.opts.state_dir / "abandoned", time.time() - grace, dry_run)
        await send({"done": True, "ok": report.stopped is None, "dry_run": dry_run,
                    "generation": report.generation,
                    "staged_trees": report.staged_trees,
                    "entries_deleted": report.entries_deleted,
                    "chunks_deleted": report.chunks_deleted,
                    "chunk_bytes_deleted": report.chunk_bytes_deleted,
                    "chunks_kept": report.chunks_kept,
                    "leases_deleted": report.leases_deleted,
                    "removal_marks_deleted": report.removal_marks_deleted,
                    "chunks_condemned": report.chunks_condemned,
                    "bad_entries": report.bad_entries,
                    "orphan_inodes": report.orphan_inodes,
                    "stopped": report.stopped,
                    "local_abandoned": abandoned})

    async def _prefetch(self, path: str, peer: Peer, send: Send) -> None:
        fs = self.host.fs
        top = await self._resolve(path, peer, READ, send)
        if top is None:
            return
        relative = self._relative(path) or b""

        def allowed(inode: Inode) -> bool:
            """What ``cat`` and ``ls`` would let the caller have: a file it may read,
            a directory it may list and search."""
            return permitted(inode, peer, READ | EXECUTE if inode.type == "dir" else READ)

        try:
            files, skipped = await fs.files_under(top, relative.lstrip(b"."), allowed)
        except FsError as exc:
            await send({"error": f"{path}: {os.strerror(exc.errno)}"})
            return
        total = sum(inode.size for _, inode in files)
        progress = {"done_bytes": 0}
        failed: list[str] = []

        def on_bytes(n: int) -> None:
            progress["done_bytes"] += n

        async def reporter() -> None:
            while True:
                await trio.sleep(0.5)
                await send({"progress": progress["done_bytes"], "total": total})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reporter)
            for name, inode in files:
                try:
                    await fs.warm(inode, on_bytes)
                except Exception as exc:  # noqa: BLE001 - reported, then exit non-zero
                    failed.append(f"{os.fsdecode(name)}: {exc}")
            nursery.cancel_scope.cancel()
        await send({"done": True, "ok": not failed, "files": len(files), "bytes": total,
                    "skipped": skipped, "failed": failed})
