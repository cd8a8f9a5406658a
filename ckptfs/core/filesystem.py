"""The filesystem core: POSIX semantics over the namespace, staging, cache and store.

``Filesystem`` is FUSE-agnostic (mountpoint-s3's split): the FUSE adapter and the
control socket call it; it raises ``FsError`` with an errno.  Remote metadata steps
(mkdir, unlink, rename, publishing an entry) are awaited here; namespace changes that
belong together happen with no ``await`` between them.

The façade: one class assembling the concern modules of this package over one
shared state (docs/architecture.md)."""

from __future__ import annotations

import logging
import shutil
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

from ..errors import FsError
from ..cluster.leases import LeaseManager
from ..meta.namespace import Inode, Namespace
from ..meta.oplog import MetaLog
from ..procstat import Opener, died_unclean
from ..data.liveness import ChunkLiveness, GuardedStore
from ..data.publish_queue import PublishQueue
from ..data.upload import ChunkUploader, UploadGate
from ..data.cache import ChunkCache
from ..store.health import StoreHealth
from ..data.staging import Staging
from ..format.remote import FORMAT_KEY
from ..store import ObjectStore, StoreError
from .state import (MAX_STAGED_FRACTION, Config, DirMarks,
                    Handle, Runtime)
from .entries import EntryIO
from .refresh import Refresh
from .names import Names
from .attributes import Attributes
from .rename import Rename
from .write import WritePath
from .read import ReadPath
from .publish import Publish
from .seal import Seal
from .metalog import MetaLogApply
from .recovery import Recovery
from .status import Status
from .state import InodeState

log = logging.getLogger(__name__)


# Seconds between looks for the store's marker (one HEAD each).
MARKER_CHECK_INTERVAL = 10.0


class Filesystem(InodeState, EntryIO, Refresh, Names, Attributes, Rename, WritePath, ReadPath, Publish, Seal, MetaLogApply, Recovery, Status):

    def __init__(self, ns: Namespace, store: ObjectStore, staging: Staging, cache: ChunkCache,
                 config: Config, nursery: trio.Nursery,
                 invalidate: Callable[[int], None] = lambda ino: None,
                 invalidate_entry: Callable[[int, bytes], Awaitable[None]] | None = None,
                 check_complete: Callable[[int, int], str | None] | None = None) -> None:
        self.ns = ns
        self.store = store
        self.staging = staging
        self.cache = cache
        self.config = config
        self.nursery = nursery
        self.invalidate = invalidate
        self.invalidate_entry = invalidate_entry
        self._stale_entries: list[tuple[int, bytes]] = []   # names to drop from the kernel
        # Structural check of a closed file (formats.check_complete): a reason if the
        # bytes are an incomplete checkpoint, None otherwise.
        self.check_complete = check_complete
        # ``major:minor`` of the mount, set by the daemon once mounted: lets flush ask
        # whether the opener still holds the file (procstat.holds_for_writing).
        self.mount_device: bytes | None = None
        # Did a handle's opener exit with a signal or an error (procstat.died_unclean)?
        # An attribute, so core tests inject it.
        self.died_unclean: Callable[[Opener], bool] = died_unclean
        self._init_tables()
        # Entry PUTs go through the gc/dedup guard (decision 0003), whatever path makes them.
        self.liveness = ChunkLiveness(store, config.gc_settle, ns.known_chunks())
        # Async mode: background uploads give way to a writer that is writing.
        self.upload_gate = UploadGate(config.upload_hold)
        # What background work knows of the store's health (decision 0016).
        self.store_health = StoreHealth()
        self.store = GuardedStore(store, self.liveness,
                                  lambda: self.store_health.marker_lost)
        self.uploader = ChunkUploader(
            store, self.liveness, trio.CapacityLimiter(config.upload_concurrency),
            ns.chunk_mark,
            slot=self.upload_gate.slot if config.durability == "async" else None,
            buffers=cache.buffers)
        # Async mode's metadata log (decision 0012) and the epochs of pending publishes.
        self.oplog = MetaLog(ns, on_done=self._meta_done, health=self.store_health)
        self._publish_epoch: dict[int, int] = {}
        self._recovered = trio.Event()     # set by start(): the log replays after recovery
        # Async mode: closed bytes not yet uploaded are bounded (writers wait past it).
        self.max_staged = config.max_staged or \
            int(shutil.disk_usage(staging.root).free * MAX_STAGED_FRACTION)
        self.writers_waiting = 0
        self._staged_bytes = (0.0, 0)          # (when counted, bytes)
        self.queue = PublishQueue(self._publish_from_queue, ready=self._publish_ready,
                                  health=self.store_health)
        self.leases = LeaseManager(ns, store, config.lease_ttl, self._writers,
                                   lambda ino: getattr(self.runtime.get(ino), "session", None)
                                   is not None,
                                   lambda ino: ino in self.queue.queued,
                                   self._seal_for_leases)
        if self._deferred():
            self.leases.open_wait = config.stale_wait

    def _init_tables(self) -> None:
        """The in-memory tables the concern modules share."""
        self.handles: dict[int, Handle] = {}
        self.runtime: dict[int, Runtime] = {}
        # The version the kernel page cache of an inode may hold; outlives the handles
        # (an inode's Runtime goes with its last close), bounded: forgetting one only
        # costs that file's cached pages at its next open.
        self.page_versions: OrderedDict[int, object] = OrderedDict()
        self._next_fh = 1
        self.write_requests = 0
        self.read_requests = 0
        self.dir_marks = DirMarks()                  # refresh's change and busy marks
        self._refreshing: dict[int, trio.Event] = {}
        self._refresh_failed: dict[int, FsError] = {}
        self._refresh_started: dict[int, float] = {}
        self._serving_stale = False
        self._held_pointers: dict[int, set[int]] = {}   # pointer inode -> staged targets
        self._corrupt: dict[int, set[bytes]] = {}   # names whose store entry is corrupt
        self.meta_limiter = trio.CapacityLimiter(16)
        self.observe: Callable[[str, float], None] = lambda what, seconds: None  # metrics
        self.after_seal: Callable[[Inode], None] = lambda inode: None   # retention.py

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The background workers: the publish queue and the metadata log."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.queue.run)
            await nursery.start(self.oplog.run, self._execute_meta)
            nursery.start_soon(self._watch_marker)
            task_status.started()

    async def _watch_marker(self) -> None:
        """Look for the store's format marker now and then, and at once when the store
        says the bucket is missing: a bucket deleted under the mount stops publishing
        (decision 0016).  A failed look says nothing (outages are seen elsewhere).  A
        store that had no marker at the first look (the core's tests over a bare
        ``MemoryStore``; a mount always has one) is not watched."""
        first = True
        while True:
            if not first:
                with trio.move_on_after(MARKER_CHECK_INTERVAL):
                    await self.store_health.check_marker.wait()
            try:
                present = await trio.to_thread.run_sync(self.store.inner.exists, FORMAT_KEY,
                                                        abandon_on_cancel=True)
            except StoreError:
                first = False
                continue
            if first and not present:
                return
            first = False
            self.store_health.marker_checked(present)

    def _deferred(self) -> bool:
        """Async mode: metadata changes are local first, the store follows in order."""
        return self.config.durability == "async"

    def _meta_done(self) -> None:
        self.queue.release_parked()

    def _publish_ready(self, ino: int) -> bool:
        return self.oplog.done_through(self._publish_epoch.get(ino, 0))
