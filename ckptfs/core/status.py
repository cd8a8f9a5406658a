"""Status and prefetch helpers: resolving paths, pending work, per-inode state, counters."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ..meta.namespace import ROOT_INO, Inode

from .state import CoreState, dir_id_of
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .names import Names
    from .write import WritePath
    from .read import ReadPath


log = logging.getLogger(__name__)

# How often ``wait_idle`` looks again while a close decision waits for its last release.
CLOSING_RECHECK = 0.005


class Status:
    """Status, pending work and counters; no state of its own."""

    def __init__(self, st: CoreState, *, names: Names, writes: WritePath,
                 reads: ReadPath) -> None:
        self.st = st
        self.names = names
        self.writes = writes
        self.reads = reads

    # ------------------------------------------------------------------ prefetch

    async def resolve(self, relative: bytes) -> Inode:
        inode = self.st.ns.get(ROOT_INO)
        for part in relative.split(b"/"):
            if part in (b"", b"."):
                continue
            inode = await self.names.lookup(inode.ino, part)
        return inode

    async def files_under(self, inode: Inode, prefix: bytes = b"",
                          allowed: Callable[[Inode], bool] | None = None,
                          ) -> tuple[list[tuple[bytes, Inode]], int]:
        """Every file below ``inode`` that a walk allowed into each node by ``allowed``
        reaches (all of them without it), and how many files and directories it left
        out: a directory not allowed is neither listed nor entered.  A walk without
        recursion: a deep or hostile tree cannot exhaust the stack; each directory id is
        visited once."""
        out: list[tuple[bytes, Inode]] = []
        skipped = 0
        stack = [(prefix, inode)]
        seen: set[str] = set()
        while stack:
            path, node = stack.pop()
            if node.type not in ("file", "dir"):
                continue
            if allowed is not None and not allowed(node):
                skipped += 1
            elif node.type == "file":
                out.append((path, node))
            elif dir_id_of(node) not in seen:
                seen.add(dir_id_of(node))
                for name, child in reversed(await self.names.listdir(node.ino)):
                    stack.append((path + b"/" + name if path else name, child))
        return out, skipped

    # ------------------------------------------------------------------ status

    def pending_uploads(self) -> int:
        """Closed files not yet in the store (pointers held for their checkpoint too),
        and metadata changes on their way (async mode)."""
        return len(self.st.queue.queued | set(self.st._held_pointers)) + len(self.st.oplog.pending)

    def store_unavailable(self) -> str | None:
        """One line while background work finds the store away (decision 0016)."""
        return self.st.store_health.describe(len(self.st.oplog.pending),
                                          len(self.st.queue.queued | set(self.st._held_pointers)))

    def unfinished(self) -> int:
        """Work still to reach the store that is not failed for good."""
        return len(self.st.queue.active()) + len(self.st.oplog.pending) + \
            len(self.st.closing_at_release)

    async def wait_idle(self) -> None:
        while self.unfinished():
            await self.st.queue.wait_idle()
            await self.st.oplog.wait_idle()
            if self.st.closing_at_release:      # (rare: a few ms until it is made)
                await trio.sleep(CLOSING_RECHECK)

    def is_writing(self, ino: int) -> bool:
        """An open writer, or a pending upload, for this inode on this node."""
        return bool(self.st._writers(ino)) or ino in self.st.queue.queued

    def state_of(self, ino: int) -> str:
        inode = self.st.ns.get(ino)
        if inode.ino in self.st.queue.queued:
            return "uploading"
        rt = self.st.runtime.get(ino)
        if inode.dirty or (rt is not None and rt.session is not None):
            return "staged"
        if inode.type == "file" and not inode.local_copy and inode.chunks and \
                all(self.st.cache.has(sha) for sha, _ in inode.chunks):
            return "cached"
        if inode.type == "file" and not inode.local_copy and inode.chunks:
            return "remote"
        return "published"

    def stats(self) -> dict:
        up = self.st.uploader.stats
        return {"pending_uploads": self.pending_uploads(),
                "failing_uploads": dict(self.st.queue.failing),
                "pending_metadata": len(self.st.oplog.pending),
                "staged_bytes": self.writes.staged_bytes(fresh=True),
                "max_staged": self.writes.max_staged,
                # fsyncs of the journal (one per batch of changes: journalsync.py).
                "journal_syncs": self.st.journal.syncs,
                "writers_waiting_for_uploads": self.writes.writers_waiting,
                # Async: seconds the uploads have been waiting for a writer to pause.
                "uploads_held_for_writer_s": round(self.st.upload_gate.held_for(), 2)
                if self.st._deferred() and self.st.queue.active() else 0.0,
                "failing_metadata": {str(k): v for k, v in self.st.oplog.failing.items()},
                "store_unavailable": self.store_unavailable(),
                "chunks_uploaded": up.chunks_uploaded,
                "chunks_deduplicated": up.chunks_deduplicated,
                "bytes_uploaded": up.bytes_uploaded,
                "bytes_deduplicated": up.bytes_deduplicated,
                "publishes": up.publishes, "publish_failures": up.publish_failures,
                # Chunks read behind a passthrough writer, hashed again at publish, and
                # those of them changed since their early upload (sent again).
                "chunks_reverified": up.chunks_reverified,
                "chunks_changed_after_upload": up.chunks_changed_after_upload,
                # CPU seconds of upload workers naming chunks (bench); sending: store_stats.
                "upload_hash_cpu_s": round(up.hash_cpu, 3),
                "cache_bytes": self.st.cache.total, "corrupt_chunks": self.st.cache.corrupt_events,
                "rotten_cache_chunks": self.st.cache.rotten,
                "fetches_in_flight": self.st.cache.fetches_in_flight,
                # The room kept on the state dir's disk for removals (meta/reserve.py).
                "state_dir_reserve": self.st.ns.reserve.describe()
                if self.st.ns.reserve is not None else "none",
                "open_handles": len(self.st.handles), "write_requests": self.writes.write_requests,
                "read_requests": self.reads.read_requests,
                "bytes_read_from_fetch_buffers": self.st.cache.served_from_memory}
