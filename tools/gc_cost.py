"""Count the store requests of the gc/dedup protocol (decision 0003) over a LocalStore:
a writer deduplicating chunks it verified recently, after a gc pass, and the gc passes
themselves.  Usage: python tools/gc_cost.py [FILES] [CHUNKS_PER_FILE] [DIRS]"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

from ckptfs.cluster.gc import collect
from ckptfs.data.liveness import ChunkLiveness, GuardedStore
from ckptfs.data.upload import ChunkUploader
from ckptfs.format.remote import Entry, entry_key
from ckptfs.store import CountingStore, LocalStore, StoreStats

CHUNK = 64 << 10   # small bodies: only request counts matter here


def main() -> None:
    files = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    per_file = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    dirs = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        root.mkdir()
        stats = StoreStats()
        store = CountingStore(LocalStore(root), stats)
        liveness = ChunkLiveness(store, settle=0.5)
        guarded = GuardedStore(store, liveness)
        uploader = ChunkUploader(store, liveness, None, lambda sha, gen: None)
        staging = Path(tmp) / "staging"
        dir_ids = ["root"] + [f"{i:032x}" for i in range(1, dirs)]
        for d in dir_ids[1:]:
            guarded.put(entry_key("root", d.encode()),
                        Entry(type="dir", mode=0o755, id=d).to_json())

        def write(tag: str, indexes: range) -> None:
            """Files ``tag<f>``; file f always holds the same bytes, whatever the tag."""
            for f in indexes:
                chunks = []
                for c in range(per_file):
                    seed = f"{f}-{c}"
                    staging.write_bytes(hashlib.sha256(seed.encode()).digest() * (CHUNK // 32))
                    sha, _, _, _ = uploader._upload_sync(staging, 0, CHUNK)
                    chunks.append((sha, CHUNK))
                entry = Entry(type="file", mode=0o644, size=CHUNK * per_file, chunks=chunks)
                guarded.put(entry_key(dir_ids[f % dirs], f"{tag}{f}".encode()),
                            entry.to_json())

        def measure(label: str, fn) -> None:
            before = stats.snapshot()
            started = time.monotonic()
            fn()
            after = stats.snapshot()
            delta = {k: after[k] - before[k] for k in ("puts", "gets", "heads", "lists",
                                                       "deletes")}
            print(f"{label:58s} {delta}  ({time.monotonic() - started:.2f}s)")

        half = files // 2
        print(f"{files} files x {per_file} chunks in {dirs} directories; settle 0.5 s")
        measure(f"write {files} files of new bytes", lambda: write("a", range(files)))
        measure(f"write {files} files of the same bytes again (remembered)",
                lambda: write("b", range(files)))
        for f in range(files):        # files 0..half-1 gone: their chunks unreferenced
            store.delete(entry_key(dir_ids[f % dirs], f"b{f}".encode()))
            if f < half:
                store.delete(entry_key(dir_ids[f % dirs], f"a{f}".encode()))
        time.sleep(1.1)
        measure("gc pass 1 (no candidates yet: walk, mark, condemn)",
                lambda: print("   ", collect(store, 0, False, 0.5)))
        time.sleep(1.1)
        measure("gc pass 2 (announce, settle, mark, delete condemned)",
                lambda: print("   ", collect(store, 0, False, 0.5)))
        measure(f"write {files - half} files whose chunks survived (remembered)",
                lambda: write("c", range(half, files)))
        measure(f"write {half} files whose chunks gc deleted (remembered)",
                lambda: write("d", range(half)))
        print(f"gc state reads by the writer: {liveness.state_reads}")

if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
