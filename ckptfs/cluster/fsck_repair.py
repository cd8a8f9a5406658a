"""``ckptfs fsck --repair``: put back missing chunks from a node's local copies, the one
repair that cannot lose data.

A chunk an entry names but the store lost is looked for in a node's chunk cache (by id)
and then in its staging files (the bytes at the chunk's offset in a staging file of the
entry's size: a writer's closed version stays there until it is evicted).  A copy is
uploaded only if its bytes hash to the chunk's id (``format.remote``'s functions, so
every kind of id is verified), and only with a PUT that cannot overwrite
(``put_if_absent``): a chunk that came back meanwhile is left as it is.  Nothing else is
ever written, and nothing is deleted.  Reads the node's directories without a daemon
(a live one only adds files there); knows nothing of LMDB, inodes or FUSE.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .fsck import ChunkRef, FsckReport, damaged_files
from ..data.cache import cache_file
from ..format.remote import chunk_key, chunk_matches
from ..store import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class LocalCopies:
    """Where one node keeps bytes: its chunk cache and its staging directories."""

    cache_dir: Path
    staging_dirs: list[Path] = field(default_factory=list)

    def from_cache(self, chunk: str, length: int) -> bytes | None:
        try:
            data = cache_file(self.cache_dir, chunk).read_bytes()
        except OSError:
            return None
        return data if len(data) == length and chunk_matches(chunk, data) else None

    def from_staging(self, ref: ChunkRef) -> tuple[bytes, Path] | None:
        """The chunk's bytes from a staging file as long as the entry's file."""
        for folder in self.staging_dirs:
            try:
                names = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                continue
            for item in names:
                try:
                    if not item.is_file() or item.stat().st_size != ref.size:
                        continue
                    with open(item.path, "rb") as f:
                        f.seek(ref.offset)
                        data = f.read(ref.length)
                except OSError:
                    continue
                if len(data) == ref.length and chunk_matches(ref.chunk, data):
                    return data, Path(item.path)
        return None

    def find(self, chunk: str, refs: list[ChunkRef]) -> tuple[bytes, str] | None:
        """Verified bytes of ``chunk`` and where they came from, or None."""
        lengths = sorted({r.length for r in refs})
        for length in lengths:
            data = self.from_cache(chunk, length)
            if data is not None:
                return data, f"cache {cache_file(self.cache_dir, chunk)}"
        for ref in refs:
            found = self.from_staging(ref)
            if found is not None:
                return found[0], f"staging file {found[1]}"
        return None


def repair(store: ObjectStore, report: FsckReport, copies: LocalCopies,
           progress: Callable[[str], None] = lambda msg: None) -> None:
    """Upload each missing chunk ``copies`` hold (verified), then update ``report``:
    a chunk whose key is listed afterwards is repaired, no longer missing."""
    for chunk in list(report.missing_chunks):
        refs = report.refs.get(chunk, [])
        found = copies.find(chunk, refs)
        if found is None:
            progress(f"no local copy of chunk {chunk}")
            continue
        data, source = found
        key = chunk_key(chunk)
        store.put_if_absent(key, data)
        if not any(o.key == key for o in store.list(key)):
            log.error("fsck: chunk %s was uploaded but is not listed", chunk)
            continue
        log.info("fsck: chunk %s put back from %s", chunk, source)
        report.missing_chunks.remove(chunk)
        report.repaired.append((chunk, source))
    damaged_files(report)
