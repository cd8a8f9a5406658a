"""Where does a writer's time go through the mount?  Writes four 256 MiB files with
1 MiB writes, then fsync, into local disk and into an async ckptfs mount over a private
SeaweedFS, and prints write() time and fsync() time per file.  Extra arguments go to
`ckptfs mount` (e.g. --writeback-cache, --upload-concurrency 2).

    .venv/bin/python tools/write_split.py [mount args...]
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckptfs.bench.runner import block
from ckptfs.bench.seaweed import SeaweedServer


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="ckptfs-write-split-"))
    server = SeaweedServer(work / "seaweed")
    server.start()
    env = dict(os.environ)
    env.update(server.env())
    mnt = work / "mnt"
    mnt.mkdir()
    try:
        server.create_bucket("split")
        subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(mnt), "--store",
                        "s3://split/x", "--state-dir", str(work / "state"), "--durability",
                        "async", *sys.argv[1:]], env=env, check=True, capture_output=True)
        for target in (work / "local", mnt / "ckpt"):
            target.mkdir()
            total_write = total_fsync = 0.0
            for r in range(4):
                fd = os.open(target / f"f{r}", os.O_CREAT | os.O_WRONLY)
                t0 = time.perf_counter()
                for i in range(256):
                    os.write(fd, block(f"{target}/{r}/{time.time()}", i, 1 << 20))
                t1 = time.perf_counter()
                os.fsync(fd)
                t2 = time.perf_counter()
                os.close(fd)
                total_write += t1 - t0
                total_fsync += t2 - t1
                print(f"{target.name:6} file {r}: write {t1 - t0:.2f}s fsync {t2 - t1:.2f}s")
            print(f"{target.name:6} total: write {total_write:.2f}s fsync {total_fsync:.2f}s")
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt)], env=env,
                       check=True, capture_output=True)
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
