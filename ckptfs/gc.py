"""Garbage collection over the remote format: staged checkpoint trees older than the
grace period (unless a node still renews a seal lease below them), seal leases not
renewed within the grace period, then chunks no entry references (mark and sweep).  Works on the
``ObjectStore`` alone (blocking; run it in a thread); knows nothing of inodes or FUSE.
Nothing younger than the grace period is ever touched, so a writer still uploading
chunks, or a checkpoint still being written, is safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .leases import LEASE_ROOT, lease_prefix
from .remote import ROOT_DIR_ID, BadEntry, Entry, decode_name, dir_prefix
from .store import NotFound, ObjectStore

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    staged_trees: list[str] = field(default_factory=list)   # paths removed (or to remove)
    entries_deleted: int = 0
    chunks_deleted: int = 0
    chunk_bytes_deleted: int = 0
    chunks_kept: int = 0
    bad_entries: int = 0
    leases_deleted: int = 0


def collect(store: ObjectStore, chunk_size: int, grace: float, dry_run: bool,
            progress: Callable[[str], None] = lambda msg: None,
            workers: int = 16) -> GcReport:
    report = GcReport()
    cutoff_ns = int((time.time() - grace) * 1e9)
    cutoff = time.time() - grace
    referenced: set[str] = set()
    pool = ThreadPoolExecutor(workers)

    def fetch(key: str) -> tuple[str, Entry | None]:
        try:
            body, _ = store.get(key)
            return key, Entry.from_json(body, chunk_size)
        except NotFound:
            return key, None
        except BadEntry as exc:
            log.error("gc: bad entry %s: %s", key, exc)
            report.bad_entries += 1
            return key, None

    def delete_tree(dir_id: str) -> None:
        keys = [o.key for o in store.list(dir_prefix(dir_id))]
        for key in keys:
            _, entry = fetch(key)
            if entry is not None and entry.type == "dir" and entry.id:
                delete_tree(entry.id)
            if not dry_run:
                store.delete(key)
            report.entries_deleted += 1

    # Mark: walk every reachable directory.
    queue = [(ROOT_DIR_ID, "")]
    seen = {ROOT_DIR_ID}
    while queue:
        dir_id, path = queue.pop()
        keys = [o.key for o in store.list(dir_prefix(dir_id))
                if "/" not in o.key[len(dir_prefix(dir_id)):]]
        for key, entry in pool.map(fetch, keys):
            if entry is None:
                continue
            try:
                name = decode_name(key[len(dir_prefix(dir_id)):]).decode(errors="replace")
            except BadEntry:
                continue
            child_path = f"{path}/{name}"
            if entry.type == "dir" and entry.staged and entry.mtime_ns < cutoff_ns \
                    and not any(o.mtime > cutoff for o in store.list(lease_prefix(entry.id))):
                progress(f"staged tree {child_path}")
                report.staged_trees.append(child_path)
                delete_tree(entry.id)
                if not dry_run:
                    store.delete(key)
                report.entries_deleted += 1
                continue
            if entry.type == "dir" and entry.id and entry.id not in seen:
                seen.add(entry.id)
                queue.append((entry.id, child_path))
            for sha, _ in entry.chunks:
                referenced.add(sha)
    # Leases nobody renewed within the grace period: their node died, or their tree was
    # just reclaimed above (a live writer renews every lease_ttl / 3).
    for obj in store.list(LEASE_ROOT):
        if obj.mtime <= cutoff:
            if not dry_run:
                store.delete(obj.key)
            report.leases_deleted += 1
    # Sweep: chunks nobody references, older than the grace period.
    for obj in store.list("chunks/"):
        sha = obj.key.rsplit("/", 1)[-1]
        if sha in referenced or obj.mtime > cutoff:
            report.chunks_kept += 1
            continue
        if not dry_run:
            store.delete(obj.key)
        report.chunks_deleted += 1
        report.chunk_bytes_deleted += obj.size
    pool.shutdown()
    return report
