"""Cold reads file by file (decision 0015): writes a checkpoint through a sync ckptfs mount
over a private SeaweedFS, then reads every file in name order through a fresh mount and
prints, per round, the total time, the wait for each big file's first 4 MiB, and the CPU
seconds of the daemon, the store server and the reader, with the machine's idle time.

    .venv/bin/python tools/cold_files.py [--rounds 3] [--big-files 4 --big-size 256]
        [--small-files 20] [--mount-arg=--fetch-concurrency=16]
"""

from __future__ import annotations

import argparse
import shutil
import time

from blocked_window import measure
from ckptfs.bench.runner import Bench, daemon_status, write_tree

MiB = 1 << 20


def read_in_order(root, names: list[str]) -> list[tuple[str, float, float]]:
    """(name, seconds for the file, seconds until its first 4 MiB) per file."""
    out = []
    for name in names:
        t0 = time.perf_counter()
        first = None
        with open(root / name, "rb", buffering=0) as f:
            while True:
                data = f.read(4 * MiB)
                if first is None:
                    first = time.perf_counter() - t0
                if not data:
                    break
        out.append((name, time.perf_counter() - t0, first))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--big-files", type=int, default=4)
    p.add_argument("--big-size", type=int, default=256, help="MiB")
    p.add_argument("--small-files", type=int, default=20)
    p.add_argument("--mount-arg", action="append", default=[])
    args = p.parse_args()
    bench = Bench(argparse.Namespace(
        work_dir=None, big_files=args.big_files, big_size=args.big_size * MiB,
        small_files=args.small_files, store=None, endpoint_url=None,
        mount_arg=args.mount_arg, quick=True, prime=True))
    bench.open_store()
    weed = bench.server.process.pid
    names = sorted(name for name, _ in bench.workload.files())
    try:
        for rnd in range(args.rounds):
            writer = bench.mount(f"w{rnd}", "sync")
            write_tree(writer / "ckpt", bench.workload, f"w{rnd}")
            bench.umount(writer)
            reader = bench.mount(f"r{rnd}", "sync")
            try:
                pid = daemon_status(reader, bench.env)["pid"]
                bench.prime()
                files: list = []
                cpu = measure(lambda: files.extend(read_in_order(reader / "ckpt", names)),
                              {"daemon": pid, "store": weed})
            finally:
                bench.umount(reader)
            firsts = [f"{first * 1000:.0f}" for name, _, first in files
                      if name.startswith("model")]
            print(f"round {rnd}: {cpu['wall']:.2f} s; first 4 MiB of the big files (ms): "
                  f"{', '.join(firsts[:8])}{' ...' if len(firsts) > 8 else ''} "
                  f"(sum {sum(float(x) for x in firsts):.0f}); CPU s: daemon "
                  f"{cpu['daemon']:.2f}, store {cpu['store']:.2f}, reader "
                  f"{cpu['writer']:.2f}; machine idle {cpu['idle']:.2f} of "
                  f"{cpu['busy'] + cpu['idle']:.2f} core-s", flush=True)
    finally:
        bench.server.stop()
        shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()
