"""What ``ckptfs fsck`` costs over a real SeaweedFS: requests by kind and wall time of a
plain check and of ``--full`` over a store of DIRS directories of FILES_PER_DIR files of
CHUNKS_PER_FILE chunks each (small chunk bodies: request counts and the walk matter
here), written straight into the store.  Usage:
python tools/fsck_scale.py [DIRS] [FILES_PER_DIR] [CHUNKS_PER_FILE] [CHUNK_KIB]"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptfs.bench.seaweed import SeaweedServer
from ckptfs.cluster.fsck import check
from ckptfs.format.remote import Entry, chunk_key, entry_key
from ckptfs.store import CountingStore, S3Store, StoreStats


def populate(store: S3Store, dirs: int, files: int, chunks: int, chunk_bytes: int) -> None:
    store.put("ckptfs.json", b'{"format": 1}')
    jobs = []
    for d in range(dirs):
        dir_id = f"{d + 1:032x}"
        jobs.append((entry_key("root", f"step-{d}".encode()),
                     Entry(type="dir", mode=0o755, id=dir_id).to_json()))
        for f in range(files):
            parts = []
            for c in range(chunks):
                body = hashlib.sha256(f"{d}/{f}/{c}".encode()).digest() * (chunk_bytes // 32)
                sha = hashlib.sha256(body).hexdigest()
                jobs.append((chunk_key(sha), body))
                parts.append((sha, len(body)))
            jobs.append((entry_key(dir_id, f"shard-{f}.bin".encode()),
                         Entry(type="file", mode=0o644, size=sum(n for _, n in parts),
                               chunks=parts).to_json()))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda job: store.put(*job), jobs))


def main() -> None:
    dirs, files, chunks, kib = [int(a) for a in sys.argv[1:5]] + [20, 50, 4, 64][len(sys.argv) - 1:]
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(Path(tmp) / "seaweed")
        server.start()
        try:
            server.create_bucket("fsck-scale")
            os.environ.update(server.env())
            raw = S3Store("fsck-scale", "p", server.endpoint_url)
            populate(raw, dirs, files, chunks, kib << 10)
            print(f"store: {dirs} dirs x {files} files x {chunks} chunks of {kib} KiB "
                  f"= {dirs * files * chunks} chunks")
            for full in (False, True):
                stats = StoreStats()
                store = CountingStore(raw, stats)
                start = time.monotonic()
                report = check(store, full=full)
                took = time.monotonic() - start
                snap = stats.snapshot()
                print(f"{'--full' if full else 'plain '}: {took:6.2f} s, "
                      f"{snap['lists']} LIST, {snap['gets']} GET, {snap['heads']} HEAD, "
                      f"{snap['puts']} PUT, {snap['deletes']} DELETE; "
                      f"damaged={report.damaged}, hashed={report.chunks_hashed}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
