"""The daemon: opens the store, checks it, mounts, runs FUSE beside the background
tasks in one trio nursery, serves the control socket, and shuts down in order (drain
uploads, unmount, close LMDB).  Knows nothing of FUSE request details.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from .errors import FsError
from .core import Config, Filesystem
from .fuse_ops import FuseOps
from .liveness import DEFAULT_SETTLE
from .namespace import Namespace
from .procstat import device_of_mount
from .remote import FORMAT_KEY, FORMAT_VERSION
from .stale import StaleStagedWatch
from .staging import ChunkCache, Staging
from .store import (CountingStore, ObjectStore, PreconditionFailed, RetryingStore,
                    RetryPolicy, StoreError, StoreStats, open_store)

log = logging.getLogger(__name__)


class MountError(Exception):
    """The mount cannot proceed; the message is the one-line reason for the user."""


@dataclass
class MountOptions:
    mountpoint: Path
    store_url: str
    state_dir: Path
    endpoint_url: str | None = None
    single_writer: bool = False
    allow_other: bool = True
    config: Config | None = None


def control_socket_path(state_dir: Path) -> str:
    path = str(state_dir / "control.sock")
    if len(path.encode()) < 100:
        return path
    digest = hashlib.sha1(path.encode()).hexdigest()[:16]
    return f"/tmp/ckptfs-{digest}.sock"


def check_mountpoint(path: Path) -> None:
    if not path.exists():
        raise MountError(f"mount point {path} does not exist")
    if not path.is_dir():
        raise MountError(f"mount point {path} is not a directory")
    if os.path.ismount(path):
        raise MountError(f"{path} is already a mount point")
    if any(os.scandir(path)):
        raise MountError(f"mount point {path} is not empty")


LOCK_NAME = "daemon.lock"


def lock_state_dir(state_dir: Path, mountpoint: Path) -> int:
    """One state dir, one daemon: take an exclusive ``flock`` on ``daemon.lock`` for the
    daemon's life (released by the kernel when the process ends, however it ends) and
    record who holds it.  Returns the descriptor; a held lock is a ``MountError`` that
    names the daemon holding it."""
    path = state_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            os.close(fd)
            raise MountError(f"cannot lock {path}: {exc.strerror}") from None
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = (f"pid {holder.get('pid', '?')}, mounted on {holder.get('mountpoint', '?')}"
               if holder else "starting up")
        raise MountError(f"state dir {state_dir} is in use by another ckptfs daemon "
                         f"({who}); give this mount its own --state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "mountpoint": str(mountpoint)}).encode(), 0)
    return fd


def prepare_state_dir(state_dir: Path) -> None:
    for sub in ("", "staging", "cache", "abandoned"):
        d = state_dir / sub
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)


def build_store(url: str, endpoint_url: str | None, stats: StoreStats,
                wrap=None, timeout: float = 60.0) -> RetryingStore:
    try:
        raw = open_store(url, endpoint_url, timeout)
    except ValueError as exc:
        raise MountError(str(exc)) from None
    if wrap is not None:
        raw = wrap(raw)
    return RetryingStore(CountingStore(raw, stats), RetryPolicy(timeout=timeout), stats=stats)


def probe_store(store: ObjectStore, single_writer: bool, chunk_size: int = 8 << 20,
                gc_settle: float = DEFAULT_SETTLE) -> "StoreFormat":
    """Fail fast, with one line, if the store cannot be used (DESIGN.md promise 8)."""
    try:
        store.check()
        key = f"probe/{uuid.uuid4().hex}"
        if not store.put_if_absent(key, b"1"):
            raise MountError("store refused a fresh conditional write")
        honoured = not store.put_if_absent(key, b"2")
        if honoured:
            honoured = _honours_if_match(store, key)
        store.delete(key)
        if not honoured and not single_writer:
            raise MountError("store does not honour conditional writes (If-None-Match: *, "
                             "If-Match on PUT and DELETE); mount with --single-writer if "
                             "only one node writes")
        return read_format_marker(store, chunk_size, gc_settle)
    except StoreError as exc:
        raise MountError(str(exc)) from None


@dataclass
class StoreFormat:
    """What ``ckptfs.json`` says about the store (decision 0003)."""

    chunk_size: int | None      # the size the store was created with (None: not recorded)
    gc_settle: float


def read_format_marker(store: ObjectStore, chunk_size: int, gc_settle: float) -> StoreFormat:
    """Create the format marker (a new store records this node's chunk size and gc
    settle time), or read and check the existing one."""
    marker = {"format": FORMAT_VERSION, "chunk_size": chunk_size, "gc_settle": gc_settle}
    if store.put_if_absent(FORMAT_KEY, json.dumps(marker).encode()):
        return StoreFormat(chunk_size, gc_settle)
    body, _ = store.get(FORMAT_KEY)
    try:
        doc = json.loads(body)
        version = doc.get("format")
    except (ValueError, AttributeError):
        doc, version = {}, None
    if version != FORMAT_VERSION:
        raise MountError(f"store holds ckptfs format {version!r}, this is {FORMAT_VERSION}")
    recorded = doc.get("chunk_size")
    recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) \
        else None
    settle = doc.get("gc_settle")
    settle = float(settle) if isinstance(settle, (int, float)) and settle >= 0 \
        else DEFAULT_SETTLE
    return StoreFormat(recorded, settle)


def _honours_if_match(store: ObjectStore, key: str) -> bool:
    """Renames and directory-entry rewrites compare and swap (decision 0003): a PUT and a
    DELETE with a stale ``If-Match`` must be refused."""
    etag = store.put(key, b"3")
    for attempt in (lambda: store.put(key, b"4", if_match='"0-stale"'),
                    lambda: store.delete(key, if_match='"0-stale"')):
        try:
            attempt()
            return False
        except PreconditionFailed:
            pass
    try:
        store.put(key, b"5", if_match=etag)
    except PreconditionFailed:
        return False
    return True


def set_readahead(mountpoint: Path, kb: int) -> bool:
    """Raise the kernel read-ahead of this mount's backing device, so sequential reads
    arrive as large requests instead of 128 KiB ones (fewer FUSE round trips).  Returns
    whether the value is in place."""
    # Not os.stat(mountpoint): that would ask this very daemon.  /proc/self/mountinfo
    # names the device without a FUSE round trip.
    try:
        with open("/proc/self/mountinfo") as f:
            devices = [line.split()[2] for line in f
                       if line.split()[4] == str(mountpoint)]
        if not devices:
            return False
        path = f"/sys/class/bdi/{devices[-1]}/read_ahead_kb"
        with open(path, "w") as f:
            f.write(str(kb))
        with open(path) as f:
            return int(f.read()) == kb
    except (OSError, ValueError) as exc:
        log.info("could not set read-ahead to %d KiB: %s", kb, exc)
        return True


def sweep_abandoned(directory: Path, cutoff: float, dry_run: bool) -> list[str]:
    """Staged bytes of killed writers older than ``cutoff`` (blocking: run in a thread)."""
    out = []
    for path in sorted(directory.iterdir()):
        if path.stat().st_mtime < cutoff:
            out.append(path.name)
            if not dry_run:
                path.unlink()
    return out


def sd_notify(message: str) -> None:
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(message.encode(), target)
        except OSError as exc:
            log.warning("sd_notify failed: %s", exc)


class Daemon:
    def __init__(self, opts: MountOptions, store_wrap=None) -> None:
        self.opts = opts
        self.config = opts.config or Config()
        self.stats = StoreStats()
        self.store_wrap = store_wrap
        self.fs: Filesystem | None = None
        self.stale: StaleStagedWatch | None = None
        self._shutdown = trio.Event()
        self._terminated = False
        # Stopping (umount, SIGTERM): pending uploads are waited for until ``_stop_at``
        # (trio clock), then the mount goes anyway and they stay journaled; a second
        # SIGTERM sets ``_stop_now`` and cuts every wait short.
        self._stop_at: float | None = None
        self._stop_now = trio.Event()
        self._drains: set[trio.CancelScope] = set()

    async def run(self, on_ready) -> None:
        opts = self.opts
        check_mountpoint(opts.mountpoint)
        prepare_state_dir(opts.state_dir)
        lock_fd = lock_state_dir(opts.state_dir, opts.mountpoint)
        try:
            await self._run_locked(on_ready)
        finally:
            os.close(lock_fd)

    async def _run_locked(self, on_ready) -> None:
        opts = self.opts
        store = build_store(opts.store_url, opts.endpoint_url, self.stats, self.store_wrap,
                            self.config.store_timeout)
        fmt = await trio.to_thread.run_sync(probe_store, store, opts.single_writer,
                                            self.config.chunk_size, self.config.gc_settle)
        if fmt.chunk_size is not None and fmt.chunk_size != self.config.chunk_size:
            log.warning("the store was created with %d-byte chunks; this node writes %d-byte "
                        "chunks (every node reads both)", fmt.chunk_size,
                        self.config.chunk_size)
        # gc and every writer must agree on the settle time: the store's value wins.
        self.config = dataclasses.replace(self.config, gc_settle=fmt.gc_settle)
        try:
            ns = Namespace(opts.state_dir / "meta.lmdb")
        except Exception as exc:  # lmdb.Error and friends
            raise MountError(f"cannot open {opts.state_dir / 'meta.lmdb'}: {exc}") from None
        bound = ns.meta_get("store_url")
        if bound is None:
            ns.meta_put("store_url", store.url)
        elif bound != store.url:
            ns.close()
            raise MountError(f"state dir {opts.state_dir} belongs to store {bound}, "
                             f"not {store.url}")
        staging = Staging(opts.state_dir / "staging", opts.state_dir / "abandoned")
        cache = ChunkCache(opts.state_dir / "cache", store, self.config.cache_size,
                           trio.CapacityLimiter(self.config.fetch_concurrency))
        control_path = control_socket_path(opts.state_dir)
        try:
            async with trio.open_nursery() as nursery:
                fs = self.fs = Filesystem(
                    ns, store, staging, cache, self.config, nursery,
                    invalidate=lambda ino: nursery.start_soon(self._invalidate, ino),
                    invalidate_entry=self._invalidate_entry,
                    check_complete=self._completeness_check())
                ops = FuseOps(fs, control_path, self.config.metadata_ttl,
                              writeback_cache=self.config.writeback_cache)
                options = set(pyfuse3.default_options)
                options |= {"fsname=ckptfs", "subtype=ckptfs"}
                if opts.allow_other:
                    options.add("allow_other")
                try:
                    pyfuse3.init(ops, str(opts.mountpoint), options)
                except RuntimeError as exc:
                    raise MountError(f"FUSE mount failed: {exc}") from None
                self.stale = StaleStagedWatch(ns, fs.is_writing, opts.mountpoint,
                                              self.config.stale_staged_after)
                try:
                    await nursery.start(fs.run)
                    await fs.start()
                    fs.leases.restore()
                    await nursery.start(fs.leases.run)
                    nursery.start_soon(self.stale.run)
                    await nursery.start(self._serve_control, control_path)
                    nursery.start_soon(self._signals)
                    nursery.start_soon(self._shutdown_when_asked)
                    nursery.start_soon(self._ready_after_init, on_ready, store.url)
                    await pyfuse3.main()
                finally:
                    self._terminated = True
                    pyfuse3.close(unmount=True)
                if fs.unfinished():
                    if self._stop_at is None:      # unmounted from outside (fusermount -u)
                        self._stop_at = trio.current_time() + self.config.stop_timeout
                    log.info("unmounted %s; finishing %d pending upload(s) for at most "
                             "%.0f s", opts.mountpoint, fs.unfinished(),
                             max(0.0, self._stop_at - trio.current_time()))
                    await self._drain(self._stop_at)
                else:
                    log.info("unmounted %s", opts.mountpoint)
                left = fs.pending_uploads()
                if left:
                    log.warning("%d upload(s) not finished stay journaled in %s; the next "
                                "mount resumes them", left, opts.state_dir)
                if not self._stop_now.is_set():
                    # Release idle seal leases: each call is bounded by store_timeout,
                    # and all of them together too.
                    with trio.move_on_after(self.config.store_timeout):
                        await fs.leases.shutdown()
                # Calls still in flight (a store that hangs) are given up, not waited for.
                store.close()
                nursery.cancel_scope.cancel()
        finally:
            staging.close_all()
            ns.close()
            try:
                os.unlink(control_path)
            except FileNotFoundError:
                pass

    async def _ready_after_init(self, on_ready, url: str) -> None:
        # The kernel sets the device's read-ahead when it processes FUSE_INIT, which
        # happens once pyfuse3.main() runs: set ours after that, check that it held,
        # and only then tell the waiting `ckptfs mount` (and systemd) we are ready.
        for _ in range(50):
            await trio.sleep(0.02)
            if set_readahead(self.opts.mountpoint, self.config.readahead_kb):
                break
        self.fs.mount_device = device_of_mount(os.fsencode(self.opts.mountpoint))
        if self.fs.mount_device is None:
            log.warning("could not find %s in /proc/self/mountinfo: a forked child's close "
                        "cannot be told from its parent's", self.opts.mountpoint)
        log.info("mounted %s on %s", url, self.opts.mountpoint)
        on_ready()
        sd_notify("READY=1")

    def _completeness_check(self):
        formats = self.config.checkpoint_formats
        if not formats:
            return None
        from .formats import check_complete
        return lambda fd, size: check_complete(fd, size, formats)

    async def _invalidate_entry(self, parent: int, name: bytes) -> None:
        """Drop a name from the kernel's dentry cache (a name we removed ourselves, e.g.
        a killed writer's new file: re-creating it must not hit the stale entry)."""
        if self._terminated:
            return
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name)
        except (FileNotFoundError, OSError):
            pass

    async def _invalidate(self, ino: int) -> None:
        if self._terminated:
            return
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
        except (FileNotFoundError, OSError):
            pass

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                pending = self.fs.pending_uploads() if self.fs else 0
                if not self._shutdown.is_set():
                    timeout = self.config.stop_timeout
                    log.info("signal %d: unmounting after %d pending upload(s), waiting at "
                             "most %.0f s (a second signal stops at once)", signum, pending,
                             timeout)
                    self._stop_at = trio.current_time() + timeout
                    self._shutdown.set()
                else:
                    log.warning("signal %d again: unmounting now; %d pending upload(s) stay "
                                "journaled", signum, pending)
                    self.stop_now()

    def stop_now(self) -> None:
        self._stop_now.set()
        self._stop_at = trio.current_time()
        for scope in self._drains:
            scope.cancel()
        self._shutdown.set()

    async def _drain(self, deadline: float, progress=None) -> None:
        """Wait until no upload is pending, or until ``deadline`` (trio clock), or a
        second signal; ``progress`` is awaited about once a second meanwhile."""
        fs = self.fs
        assert fs is not None
        with trio.CancelScope(deadline=deadline) as scope:
            self._drains.add(scope)
            try:
                if self._stop_now.is_set():
                    scope.cancel()
                while fs.unfinished():
                    if progress is not None:
                        await progress()
                    with trio.move_on_after(1):
                        await fs.wait_idle()
            finally:
                self._drains.discard(scope)

    def _pending(self) -> dict:
        """Pending uploads for a progress line: count, bytes, failures."""
        fs = self.fs
        assert fs is not None
        total = 0
        for ino in fs.queue.queued:
            inode = fs.ns.maybe_get(ino)
            if inode is not None:
                total += inode.size
        return {"pending_uploads": fs.pending_uploads(), "pending_bytes": total,
                "failing": {str(k): v for k, v in fs.queue.failing.items()}}

    async def _shutdown_when_asked(self) -> None:
        await self._shutdown.wait()
        if self._stop_at is None:
            self._stop_at = trio.current_time() + self.config.stop_timeout
        await self._drain(self._stop_at)
        sd_notify("STOPPING=1")
        if not self._terminated:
            pyfuse3.terminate()

    async def _serve_control(self, path: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._control_client, [listener])

    async def _control_client(self, stream: trio.SocketStream) -> None:
        # A client that goes away (Ctrl-C on `ckptfs wait`) or sends garbage must never
        # take the daemon down with it.
        try:
            await self._serve_request(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("control client went away")
        except Exception:  # noqa: BLE001
            log.exception("control request failed")

    async def _serve_request(self, stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while not data.endswith(b"\n"):
                piece = await stream.receive_some(65536)
                if not piece:
                    return
                data += piece
            try:
                request = json.loads(data)
                command = request["cmd"]
            except (ValueError, KeyError, TypeError):
                await stream.send_all(b'{"error": "bad request"}\n')
                return
            fs = self.fs
            assert fs is not None

            async def send(doc: dict) -> None:
                await stream.send_all(json.dumps(doc).encode() + b"\n")

            if command == "status":
                await send({"ok": True, "pid": os.getpid(), "mountpoint": str(self.opts.mountpoint),
                            "store": self.opts.store_url, "durability": self.config.durability,
                            "fs": fs.stats(), "store_stats": self.stats.snapshot(),
                            "node_id": fs.leases.node_id,
                            "pending_seals": fs.leases.pending_report(),
                            "held_leases": fs.leases.held_report(),
                            "lease_requests": vars(fs.leases.stats),
                            "stale_staged": [d.to_json() for d in self.stale.stale()],
                            "stale_staged_after": self.config.stale_staged_after})
            elif command == "staged":
                await send({"ok": True, "stale_staged_after": self.config.stale_staged_after,
                            "staged": [d.to_json() for _, d in self.stale.scan()]})
            elif command == "wait":
                while fs.unfinished():
                    await send(self._pending())
                    with trio.move_on_after(1):
                        await fs.wait_idle()
                if fs.queue.failed:
                    first = next(iter(fs.queue.failed.values()))
                    await send({"error": f"{len(fs.queue.failed)} upload(s) failed for good "
                                f"(not retried until the file is closed again or the next "
                                f"mount): {first}", **self._pending()})
                else:
                    await send({"ok": True, "done": True})
            elif command == "umount":
                timeout = request.get("timeout", self.config.stop_timeout)
                if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) \
                        or not math.isfinite(timeout) or timeout < 0:
                    await send({"error": f"bad timeout {timeout!r}"})
                    return
                deadline = trio.current_time() + timeout
                if self._stop_at is not None:
                    deadline = min(deadline, self._stop_at)

                async def progress() -> None:
                    await send({**self._pending(),
                                "remaining": max(0.0, deadline - trio.current_time())})

                await self._drain(deadline, progress)
                self._stop_at = min(deadline, trio.current_time())
                await send({"ok": True, "done": True, "journaled": fs.pending_uploads(),
                            "failed": len(fs.queue.failed),
                            "state_dir": str(self.opts.state_dir)})
                self._shutdown.set()
            elif command == "commit":
                await self._commit(fs, request.get("path", ""), send)
            elif command == "gc":
                await self._gc(fs, bool(request.get("dry_run")),
                               float(request.get("grace", self.config.gc_grace)), send)
            elif command == "prefetch":
                await self._prefetch(fs, request.get("path", ""), send)
            else:
                await send({"error": f"unknown command {command!r}"})

    def _relative(self, path: str) -> bytes | None:
        relative = os.path.relpath(path, self.opts.mountpoint)
        return None if relative.startswith("..") else os.fsencode(relative)

    async def _commit(self, fs: Filesystem, path: str, send) -> None:
        relative = self._relative(path)
        if relative is None:
            await send({"error": f"{path} is not under {self.opts.mountpoint}"})
            return
        try:
            inode = await fs.resolve(relative)
            sealed = await fs.seal(inode.ino)
        except FsError as exc:
            await send({"error": f"{path}: {os.strerror(exc.errno)}"})
            return
        await send({"done": True, "ok": True, "sealed": sealed,
                    "journaled": fs.oplog.pending_of("seal", inode.ino),
                    "pending": fs.leases.pending_of(inode.ino)})

    async def _gc(self, fs: Filesystem, dry_run: bool, grace: float, send) -> None:
        from .gc import GcConflict, collect

        messages: list[str] = []
        try:
            report = await trio.to_thread.run_sync(
                lambda: collect(fs.store, grace, dry_run, self.config.gc_settle,
                                progress=messages.append))
        except (GcConflict, StoreError) as exc:
            await send({"error": f"gc: {exc}"})
            return
        # Local leftovers: staged bytes of killed writers, past the grace period.
        abandoned = await trio.to_thread.run_sync(
            sweep_abandoned, self.opts.state_dir / "abandoned", time.time() - grace, dry_run)
        await send({"done": True, "ok": report.stopped is None, "dry_run": dry_run,
                    "generation": report.generation,
                    "staged_trees": report.staged_trees,
                    "entries_deleted": report.entries_deleted,
                    "chunks_deleted": report.chunks_deleted,
                    "chunk_bytes_deleted": report.chunk_bytes_deleted,
                    "chunks_kept": report.chunks_kept,
                    "leases_deleted": report.leases_deleted,
                    "chunks_condemned": report.chunks_condemned,
                    "bad_entries": report.bad_entries,
                    "orphan_inodes": report.orphan_inodes,
                    "stopped": report.stopped,
                    "local_abandoned": abandoned})

    async def _prefetch(self, fs: Filesystem, path: str, send) -> None:
        relative = self._relative(path)
        if relative is None:
            await send({"error": f"{path} is not under {self.opts.mountpoint}"})
            return
        try:
            top = await fs.resolve(relative)
            files = await fs.files_under(top, relative.lstrip(b"."))
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
                    "failed": failed})
