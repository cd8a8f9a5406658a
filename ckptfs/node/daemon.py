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
import logging
import os
import resource
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyfuse3
import trio

from .control import ControlServer
from ..errors import MountError
from ..core import Config, Filesystem
from ..fuse.datapath import DataPath, has_cap_sys_admin
from ..fuse.ops import FuseOps
from ..fuse import late_replies
from ..fuse.invalidations import InodeInvalidations
from ..data.liveness import DEFAULT_SETTLE
from ..data.spares import SpareFiles
from ..meta.namespace import ROOT_INO, Namespace
from ..meta.reserve import REARM_FACTOR, RoomReserve
from .preflight import (check_fuse_device, check_may_mount, check_mountpoint,
                        explain_mount_failure, resolve_allow_other)
from ..procstat import device_of_mount
from ..format.chunkid import BLAKE3, SHA256
from ..format.remote import FORMAT_KEY, FORMAT_VERSION, READABLE_VERSIONS
from ..cluster.stale import StaleStagedWatch
from ..data.buffers import BufferPool
from ..data.cache import ChunkCache
from ..data.staging import Staging, fd_cap
from ..store import (CountingStore, ObjectStore, PreconditionFailed, RetryingStore,
                    StoreError, StoreStats, open_store, store_policy)

if TYPE_CHECKING:
    from ..cluster.peers import Peers
    from ..cluster.retention import Retention

log = logging.getLogger(__name__)


@dataclass
class MountOptions:
    mountpoint: Path
    store_url: str
    state_dir: Path
    endpoint_url: str | None = None
    single_writer: bool = False
    allow_other: str = "auto"               # config.SETTINGS "allow_other": auto|on|off
    config: Config | None = None
    metrics_address: str | None = None      # HOST:PORT of /metrics (metrics.py)
    retention: tuple = ()                   # retention.Rule per [[retention]] table
    s3_client: str = "direct"               # config.SETTINGS "s3_client"
    peer_listen: str | None = None          # HOST:PORT of the peer server (cluster/peers.py)
    peer_advertise: str | None = None       # HOST:PORT others reach it at
    peer_timeout: float = 10.0              # seconds a chunk from a peer may take
    peer_fanout: int = 8                    # askers per owner before relays serve


async def bind_peers(opts: MountOptions, ttl: float, store: ObjectStore, cache: ChunkCache,
                     node_id: str) -> tuple[Peers | None, list]:
    """With ``--peer-listen``: the peers and their server's listeners, bound now (a mount
    that cannot listen there fails with one line); its loop starts with the others."""
    if not opts.peer_listen:
        return None, []
    from ..cluster.peers import Peers
    peers = Peers(store, cache, node_id, opts.peer_listen, opts.peer_advertise, ttl,
                  opts.peer_timeout, opts.peer_fanout)
    try:
        return peers, await peers.bind()
    except OSError as exc:
        raise MountError(f"peer address {opts.peer_listen}: cannot listen there: "
                         f"{exc.strerror or exc}") from None


SOCKET_DIR = Path("/run/ckptfs")


def control_socket_path(state_dir: Path, socket_dir: Path = SOCKET_DIR) -> str:
    """Where the control socket lives: in ``socket_dir`` (root's, mode 0755), named by
    the state dir, so that every local user can reach it (the state dir is 0700);
    in the state dir itself when ``socket_dir`` cannot be made (a daemon not run by
    root serves its own user only)."""
    digest = hashlib.sha1(str(state_dir.absolute()).encode()).hexdigest()[:16]
    try:
        socket_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        if os.access(socket_dir, os.W_OK):
            return str(socket_dir / f"{digest}.sock")
    except OSError:
        pass
    path = str(state_dir / "control.sock")
    if len(path.encode()) < 100:
        return path
    return f"/tmp/ckptfs-{digest}.sock"


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
                wrap=None, timeout: float = 60.0, s3_client: str = "direct") -> RetryingStore:
    try:
        raw = open_store(url, endpoint_url, timeout, s3_client)
    except ValueError as exc:
        raise MountError(str(exc)) from None
    if wrap is not None:
        raw = wrap(raw)
    return RetryingStore(CountingStore(raw, stats), store_policy(timeout), stats=stats)


def probe_store(store: ObjectStore, single_writer: bool, chunk_size: int = 8 << 20,
                gc_settle: float = DEFAULT_SETTLE, create_marker: bool = True,
                state_dir: Path | None = None, chunk_hash: str = BLAKE3) -> "StoreFormat":
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
        if not create_marker and not store.exists(FORMAT_KEY):
            raise MountError(f"the store has lost its marker {FORMAT_KEY}, but the state dir "
                             f"{state_dir} has been mounted on it before: the bucket was "
                             f"deleted or emptied; restore it, or mount with a new "
                             f"--state-dir (the old one keeps its journaled work)")
        return read_format_marker(store, chunk_size, gc_settle, chunk_hash)
    except StoreError as exc:
        raise MountError(str(exc)) from None


@dataclass
class StoreFormat:
    """What ``ckptfs.json`` says about the store (decision 0003)."""

    chunk_size: int | None      # the size the store was created with (None: not recorded)
    gc_settle: float
    version: int = FORMAT_VERSION


def read_format_marker(store: ObjectStore, chunk_size: int, gc_settle: float,
                       chunk_hash: str = BLAKE3) -> StoreFormat:
    """Create the format marker (a new store records this node's chunk size and gc
    settle time), or read and check the existing one.  A store is format 1 until a node
    that names chunks with BLAKE3 mounts it: that node moves the marker to 2 (a compare
    and swap), so that releases before 2, which cannot verify such chunks, refuse the
    store at mount instead of meeting entries they cannot parse.  A node that writes
    sha256 chunks creates and keeps format-1 stores."""
    wanted = FORMAT_VERSION if chunk_hash != SHA256 else 1
    marker = {"format": wanted, "chunk_size": chunk_size, "gc_settle": gc_settle}
    if store.put_if_absent(FORMAT_KEY, json.dumps(marker).encode()):
        return StoreFormat(chunk_size, gc_settle, wanted)
    while True:
        body, etag = store.get(FORMAT_KEY)
        try:
            doc = json.loads(body)
            version = doc.get("format")
        except (ValueError, AttributeError):
            doc, version = {}, None
        if version not in READABLE_VERSIONS:
            raise MountError(f"store holds ckptfs format {version!r}, this release reads "
                             f"{' and '.join(map(str, READABLE_VERSIONS))}")
        if version >= wanted:
            break
        doc["format"] = wanted
        try:
            store.put(FORMAT_KEY, json.dumps(doc).encode(), if_match=etag)
        except PreconditionFailed:
            continue                    # another node changed it: read it again
        log.warning("store format upgraded from %d to %d (%s chunk ids): ckptfs releases "
                    "before format %d refuse to mount it (chunk_hash = sha256 keeps a "
                    "store at format 1)", version, wanted, chunk_hash, wanted)
        version = wanted
        break
    recorded = doc.get("chunk_size")
    recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) \
        else None
    settle = doc.get("gc_settle")
    settle = float(settle) if isinstance(settle, (int, float)) and settle >= 0 \
        else DEFAULT_SETTLE
    return StoreFormat(recorded, settle, version)


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


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (a checkpoint of
    many files needs descriptors for FUSE, the cache, uploads and staging); the soft
    limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard,
                        exc)
    return soft


def bind_metrics(address: str | None):
    """The metrics server, bound to ``--metrics-address`` before the store is opened or
    anything is mounted (None without one).  Port 0 takes a free port: status and the
    log say which."""
    if not address:
        return None
    from .metrics import Metrics
    metrics = Metrics()
    try:
        metrics.serve(address)
    except ValueError as exc:
        raise MountError(f"metrics address {address}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise MountError(f"metrics address {address} is in use: choose another "
                             f"--metrics-address or stop what listens there") from None
        raise MountError(f"metrics address {address}: cannot listen there: "
                         f"{exc.strerror or exc}") from None
    return metrics


def fuse_ops(config: Config, fs: Filesystem, control_path: str,
             metrics) -> tuple[FuseOps, DataPath]:
    """The FUSE adapter of a mount and its data path (kernel passthrough or the daemon,
    fuse/datapath.py), the core told when an open may use passthrough."""
    data_path = DataPath(pyfuse3, config.passthrough, config.writeback_cache,
                         has_cap_sys_admin(), sync=config.durability == "sync")
    fs.passthrough_available = data_path.available
    ops = FuseOps(fs, control_path, config.metadata_ttl,
                  writeback_cache=config.writeback_cache, metrics=metrics,
                  passthrough=data_path.wanted)
    return ops, data_path


def start_retention(opts: MountOptions, config: Config, fs: Filesystem, nursery: trio.Nursery,
                    invalidate_entry, metrics):
    """The mount's retention rules (cluster/retention.py) fed by this filesystem's seals,
    or None without rules."""
    if not opts.retention:
        return None
    from ..cluster.retention import Hooks, Retention

    def open_below(parent: int, name: str) -> bool:
        top = fs.ns.lookup(parent, name.encode("utf-8", "surrogateescape"))
        if top is None:
            return False
        for handle in list(fs.handles.values()):
            cur = fs.ns.maybe_get(handle.ino)
            while cur is not None and cur.parent and cur.ino != ROOT_INO:
                if cur.ino == top:
                    return True
                cur = fs.ns.maybe_get(cur.parent)
        return False

    async def forget(parent: int, name: str) -> None:
        await fs.refresh_dir(parent, force=True)
        await invalidate_entry(parent, name.encode("utf-8", "surrogateescape"))

    def path_of(ino: int) -> str:
        return str(opts.mountpoint) + os.fsdecode(fs.ns.path_of(ino)).rstrip("/")

    retention = Retention(opts.retention, fs.store, config.profiles,
                          Hooks(open_below, forget, path_of))
    if metrics is not None:
        retention.on_removed = metrics.retention_removed.inc

    def after_seal(inode) -> None:
        parent = fs.ns.maybe_get(inode.parent)
        if parent is not None and parent.dir_id is not None and \
                retention.rule_for(os.fsdecode(inode.name)):
            nursery.start_soon(retention.after_seal, parent.ino, parent.dir_id,
                               os.fsdecode(inode.name))
    fs.after_seal = after_seal
    return retention


class Daemon:
    def __init__(self, opts: MountOptions, store_wrap=None) -> None:
        self.opts = opts
        self.config = opts.config or Config()
        self.stats = StoreStats()
        self.store_wrap = store_wrap
        self.fs: Filesystem | None = None
        self.ops: FuseOps | None = None
        self.data_path: DataPath | None = None
        self.stale: StaleStagedWatch | None = None
        self.spares: SpareFiles | None = None          # empty staging files made ahead
        self.metrics = None             # metrics.Metrics with --metrics-address
        self.peers: Peers | None = None  # cluster.peers.Peers with --peer-listen
        self.retention: Retention | None = None     # with the [[retention]] rules
        self._shutdown = trio.Event()
        self._terminated = False
        # Stopping (umount, SIGTERM): pending uploads are waited for until ``_stop_at``
        # (trio clock), then the mount goes anyway and they stay journaled; a second
        # SIGTERM sets ``_stop_now`` and cuts every wait short.
        self._stop_at: float | None = None
        self._stop_now = trio.Event()
        self._drains: set[trio.CancelScope] = set()
        self.nofile = 1024              # the descriptor limit, raised by ``run``
        self.allow_other = False        # resolved by ``run`` (preflight.resolve_allow_other)

    async def run(self, on_ready) -> None:
        opts = self.opts
        self.nofile = raise_fd_limit()
        # What can be known before anything is mounted (preflight.py), so that each
        # cause gets its own line and libfuse's advice is never needed.
        check_mountpoint(opts.mountpoint)
        check_fuse_device()
        check_may_mount(opts.mountpoint)
        self.allow_other, line = resolve_allow_other(opts.allow_other)
        log.info("%s", line)
        prepare_state_dir(opts.state_dir)
        lock_fd = lock_state_dir(opts.state_dir, opts.mountpoint)
        try:
            self.metrics = bind_metrics(self.opts.metrics_address)
            await self._run_locked(on_ready)
        finally:
            if self.metrics is not None:
                self.metrics.close()
            os.close(lock_fd)

    def _build_store(self):
        opts = self.opts
        return build_store(opts.store_url, opts.endpoint_url, self.stats, self.store_wrap,
                           self.config.store_timeout, opts.s3_client)

    async def _probe_store(self, store, bound: bool):
        """The store, probed (format, conditional writes); the store's settle time wins.
        ``bound``: this state dir has been mounted on this store before, so the store
        must still have its marker (decision 0016)."""
        opts = self.opts
        fmt = await trio.to_thread.run_sync(
            lambda: probe_store(store, opts.single_writer, self.config.chunk_size,
                                self.config.gc_settle, create_marker=not bound,
                                state_dir=opts.state_dir,
                                chunk_hash=self.config.chunk_hash))
        if fmt.chunk_size is not None and fmt.chunk_size != self.config.chunk_size:
            log.warning("the store was created with %d-byte chunks; this node writes %d-byte "
                        "chunks (every node reads both)", fmt.chunk_size,
                        self.config.chunk_size)
        # gc and every writer must agree on the settle time: the store's value wins.
        self.config = dataclasses.replace(self.config, gc_settle=fmt.gc_settle)
        return store

    def _open_namespace(self, store) -> tuple[Namespace, bool]:
        """The state dir's LMDB, bound to one store for good; and whether it was bound
        to it before this mount."""
        opts = self.opts
        try:
            ns = Namespace(opts.state_dir / "meta.lmdb",
                           root_owner=(os.geteuid(), os.getegid()),
                           reserve=RoomReserve(opts.state_dir / "reserve"))
        except Exception as exc:  # lmdb.Error and friends
            raise MountError(f"cannot open {opts.state_dir / 'meta.lmdb'}: {exc}") from None
        if ns.reserve is not None and not ns.reserve.held():
            log.warning("the state dir's disk has less than %d bytes free: no room is kept "
                        "for removals on a full disk until it has", REARM_FACTOR * ns.reserve.size)
        bound = ns.meta_get("store_url")
        if bound is not None and bound != store.url:
            ns.close()
            raise MountError(f"state dir {opts.state_dir} belongs to store {bound}, "
                             f"not {store.url}")
        return ns, bound is not None

    async def _open_store_and_namespace(self) -> tuple[ObjectStore, Namespace]:
        """The store, probed, and the state dir's LMDB bound to it."""
        store = self._build_store()
        ns, bound = self._open_namespace(store)
        try:
            await self._probe_store(store, bound)
        except BaseException:
            ns.close()
            raise
        if not bound:
            ns.meta_put("store_url", store.url)
        return store, ns

    def _open_staging(self) -> tuple[Staging, SpareFiles]:
        """Staging files, with as many cached descriptors as the fd limit allows, and
        the spare files its creates take (started in the mount's nursery)."""
        state_dir = self.opts.state_dir
        spares = SpareFiles(state_dir / "staging")
        staging = Staging(state_dir / "staging", state_dir / "abandoned",
                          max_fds=fd_cap(self.nofile), spares=spares)
        spares.clear()                 # a killed daemon's: empty, nobody's
        log.info("descriptor limit %d; at most %d staging descriptors open", self.nofile,
                 staging.max_fds)
        self.spares = spares
        return staging, spares

    def _open_cache(self, store: ObjectStore) -> ChunkCache:
        """The chunk cache, with one pool of chunk buffers for fetches and uploads
        (buffers.py)."""
        buffers = BufferPool(self.config.chunk_size, keep=max(
            self.config.upload_concurrency, self.config.fetch_concurrency))
        return ChunkCache(self.opts.state_dir / "cache", store, self.config.cache_size,
                          trio.CapacityLimiter(self.config.fetch_concurrency),
                          buffers=buffers)

    async def _run_locked(self, on_ready) -> None:
        opts = self.opts
        store, ns = await self._open_store_and_namespace()
        staging, spares = self._open_staging()
        cache = self._open_cache(store)
        control_path = control_socket_path(opts.state_dir)
        invalidations = InodeInvalidations(pyfuse3.invalidate_inode)
        try:
            async with trio.open_nursery() as nursery:
                fs = self.fs = Filesystem(
                    ns, store, staging, cache, self.config, nursery,
                    invalidate=invalidations,
                    invalidate_entry=self._invalidate_entry,
                    check_complete=self._completeness_check())
                fs.invalidate_attributes = invalidations.attributes_now
                self.peers, peer_listeners = await bind_peers(
                    self.opts, self.config.lease_ttl, store, cache, fs.leases.node_id)
                metrics = self._start_metrics(fs, staging)
                self._start_retention(fs, nursery)
                ops, self.data_path = fuse_ops(self.config, fs, control_path, metrics)
                self.ops = ops
                options = set(pyfuse3.default_options) | {"fsname=ckptfs", "subtype=ckptfs"}
                if self.allow_other:
                    options.add("allow_other")
                late_replies.install()
                try:
                    pyfuse3.init(ops, str(opts.mountpoint), options)
                except RuntimeError as exc:
                    raise MountError(explain_mount_failure(opts.mountpoint, str(exc))) \
                        from None
                try:
                    invalidations.start()
                    self.stale = StaleStagedWatch(ns, fs.is_writing, opts.mountpoint,
                                                  self.config.stale_staged_after)
                    await nursery.start(spares.run)
                    await nursery.start(fs.run)
                    await fs.start()
                    fs.restore_leases()
                    await nursery.start(fs.leases.run)
                    nursery.start_soon(self.stale.run)
                    await nursery.start(ControlServer(self, control_path).serve)
                    if self.peers is not None:
                        nursery.start_soon(self.peers.run, peer_listeners)
                    nursery.start_soon(self._signals)
                    nursery.start_soon(self._shutdown_when_asked)
                    nursery.start_soon(self._ready_after_init, fs, on_ready, store.url)
                    await pyfuse3.main()
                finally:
                    self._terminated = True
                    invalidations.close()
                    pyfuse3.close(unmount=True)
                await self._after_unmount(fs, store)
                nursery.cancel_scope.cancel()
        finally:
            staging.close_all()
            ns.close()
            try:
                os.unlink(control_path)
            except FileNotFoundError:
                pass

    async def _after_unmount(self, fs: Filesystem, store) -> None:
        """Finish pending work for at most the stop deadline, say what stays journaled,
        release idle leases, and give up store calls still in flight."""
        opts = self.opts
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
        if self.peers is not None:
            await self.peers.leave(min(5.0, self.config.store_timeout))
        # Calls still in flight (a store that hangs) are given up, not waited for.
        store.close()

    def _start_retention(self, fs: Filesystem, nursery: trio.Nursery) -> None:
        self.retention = start_retention(self.opts, self.config, fs, nursery,
                                         self._invalidate_entry, self.metrics)

    def _start_metrics(self, fs: Filesystem, staging: Staging):
        """The bound metrics server (``bind_metrics``), now fed by this filesystem."""
        metrics = self.metrics
        if metrics is None:
            return None
        from .metrics import Snapshot
        token = trio.lowlevel.current_trio_token()

        def take() -> Snapshot:      # on the trio thread: nothing changes meanwhile
            pending = self.pending()
            cache = fs.cache
            return Snapshot(upload=dict(vars(fs.uploader.stats)), store=self.stats.snapshot(),
                            cache=cache.counters(),
                            peers=self.peers.report() if self.peers else None,
                            pending_uploads=pending["pending_uploads"],
                            pending_bytes=pending["pending_bytes"],
                            open_handles=len(fs.handles))

        def snapshot() -> Snapshot | None:   # in the HTTP server's thread
            if self._terminated:
                return None
            try:
                return trio.from_thread.run_sync(take, trio_token=token)
            except trio.RunFinishedError:
                return None

        metrics.attach(snapshot)
        fs.observe = metrics.observe
        return metrics

    async def _ready_after_init(self, fs: Filesystem, on_ready, url: str) -> None:
        # The kernel sets the device's read-ahead when it processes FUSE_INIT, which
        # happens once pyfuse3.main() runs: set ours after that, check that it held,
        # and only then tell the waiting `ckptfs mount` (and systemd) we are ready.
        for _ in range(50):
            await trio.sleep(0.02)
            if set_readahead(self.opts.mountpoint, self.config.readahead_kb):
                break
        fs.mount_device = device_of_mount(os.fsencode(self.opts.mountpoint))
        if fs.mount_device is None:
            log.warning("could not find %s in /proc/self/mountinfo: a forked child's close "
                        "cannot be told from its parent's", self.opts.mountpoint)
        log.info("mounted %s on %s", url, self.opts.mountpoint)
        if self.data_path is not None:
            self.data_path.say_once()
        on_ready()
        sd_notify("READY=1")

    def _completeness_check(self):
        formats = self.config.checkpoint_formats
        if not formats:
            return None
        from ..format.checkpoints import check_complete
        return lambda fd, size, name=None: check_complete(fd, size, formats, name)

    async def _invalidate_entry(self, parent: int, name: bytes) -> None:
        """Drop a name from the kernel's dentry cache (a name we removed ourselves, e.g.
        a killed writer's new file: re-creating it must not hit the stale entry)."""
        if self._terminated:
            return
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name)
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

    def pending(self, inos: set[int] | None = None) -> dict:
        """Pending uploads (all, or those of ``inos``) for a progress line: count,
        bytes, failures."""
        fs = self.fs
        assert fs is not None
        everything = inos is None
        inos = fs.queue.queued if inos is None else inos
        total = 0
        for ino in inos:
            inode = fs.ns.maybe_get(ino) if ino > 0 else None   # <= 0: a metadata record
            if inode is not None:
                total += inode.size
        return {"pending_uploads": fs.pending_uploads() if everything else len(inos),
                "pending_bytes": total,
                "failing": {str(k): v for k, v in fs.queue.failing.items() if k in inos},
                "store_unavailable": fs.store_unavailable()}

    # Hooks of the control socket (control.Host).
    async def drain(self, deadline: float, progress=None) -> None:
        await self._drain(deadline, progress)

    def stop_deadline(self) -> float | None:
        return self._stop_at

    def request_stop(self, deadline: float) -> None:
        self._stop_at = deadline
        self._shutdown.set()

    def status_doc(self) -> dict:
        fs = self.fs
        assert fs is not None and self.stale is not None
        return {"ok": True, "pid": os.getpid(), "mountpoint": str(self.opts.mountpoint),
                "store": self.opts.store_url, "durability": self.config.durability,
                "allow_other": self.allow_other,
                "fs": fs.stats(), "store_stats": self.stats.snapshot(),
                "staging_spares": self.spares.report() if self.spares else None,
                "fuse_requests": dict(self.ops.requests) if self.ops else {},
                "fuse_request_seconds": {op: round(s, 3) for op, s in
                                         self.ops.request_seconds.items()} if self.ops else {},
                "node_id": fs.leases.node_id,
                "data_path": self.data_path.describe() if self.data_path else None,
                "pending_seals": fs.leases.pending_report(),
                "held_leases": fs.leases.held_report(),
                "lease_requests": vars(fs.leases.stats),
                "stale_staged": [d.to_json() for d in self.stale.stale()],
                "stale_staged_after": self.config.stale_staged_after,
                "pending_bytes": self.pending()["pending_bytes"],
                "oldest_pending_s": self._oldest_pending(fs),
                "cache_limit": fs.cache.limit,
                "metrics_address": self.metrics.address if self.metrics else None,
                "bytes_from_store": fs.cache.bytes_from_store,
                "peers": self.peers.report() if self.peers else None,
                "retention_removed": list(self.retention.removed) if self.retention else []}

    @staticmethod
    def _oldest_pending(fs: Filesystem) -> float | None:
        since = [t for ino, t in fs.queue.since.items() if ino in fs.queue.queued]
        return round(time.monotonic() - min(since), 1) if since else None

    async def _shutdown_when_asked(self) -> None:
        await self._shutdown.wait()
        if self._stop_at is None:
            self._stop_at = trio.current_time() + self.config.stop_timeout
        await self._drain(self._stop_at)
        sd_notify("STOPPING=1")
        if not self._terminated:
            pyfuse3.terminate()
