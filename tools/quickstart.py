"""The README's main job: a checkpoint saved into ckptfs and read back from a fresh mount.

1. mount ckptfs over a local directory standing in for the object store;
2. save a checkpoint the way trainers do: files written into ``tmp-checkpoint-1``, the
   directory renamed to ``checkpoint-1``, and ``latest`` overwritten in place;
3. unmount (which waits for uploads), mount again with *fresh* node-local state, read
   everything back and verify it byte for byte; print a summary; unmount.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def ckptfs(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ckptfs", *args], check=True)


def main() -> int:
    scratch = Path(tempfile.mkdtemp(prefix="ckptfs-quickstart-"))
    store, mnt = scratch / "store", scratch / "mnt"
    store.mkdir()
    mnt.mkdir()
    url = f"file://{store}"
    files = {
        "model.safetensors": os.urandom(24 << 20),
        "optimizer.pt": os.urandom(12 << 20),
        "config.json": json.dumps({"hidden_size": 64, "layers": 2}).encode(),
        "trainer_state.json": json.dumps({"global_step": 1}).encode(),
    }
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}

    ckptfs("mount", str(mnt), "--store", url, "--state-dir", str(scratch / "state-a"))
    t0 = time.perf_counter()
    try:
        tmp = mnt / "run" / "tmp-checkpoint-1"
        tmp.mkdir(parents=True)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        os.rename(tmp, mnt / "run" / "checkpoint-1")
        (mnt / "run" / "latest").write_text("checkpoint-0")
        (mnt / "run" / "latest").write_text("checkpoint-1")    # overwritten in place
        saved = time.perf_counter() - t0
    finally:
        ckptfs("umount", str(mnt))

    ckptfs("mount", str(mnt), "--store", url, "--state-dir", str(scratch / "state-b"))
    try:
        t0 = time.perf_counter()
        run = mnt / "run"
        assert sorted(os.listdir(run)) == ["checkpoint-1", "latest"], os.listdir(run)
        assert (run / "latest").read_text() == "checkpoint-1"
        ckpt = run / (run / "latest").read_text()
        assert sorted(os.listdir(ckpt)) == sorted(files)
        for name, digest in digests.items():
            got = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
            assert got == digest, f"{name}: content differs"
        loaded = time.perf_counter() - t0
    finally:
        ckptfs("umount", str(mnt))

    total = sum(len(d) for d in files.values())
    chunks = sum(1 for _ in (store / "chunks").glob("*/*"))
    print(f"quickstart OK: saved {len(files)} files ({total / 2**20:.1f} MiB) in {saved:.2f}s "
          f"(written into tmp-checkpoint-1, renamed to checkpoint-1, 'latest' overwritten in "
          f"place); the store holds {chunks} chunks; a fresh mount read everything back and "
          f"verified it in {loaded:.2f}s")
    shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
