"""Measure the two data paths of an async save (issue 23): one stream writing SIZE bytes
and closing, on local disk, on a ckptfs mount with kernel passthrough and on one with
``passthrough = off``; and N ranks writing SIZE/N each at once.  Same rounds, medians,
memory primed (the buffer is written once before timing).  Reports the blocked time
(write + close), the daemon's CPU seconds per GiB over the save (and over the save and
its upload, until ``ckptfs wait``), the seconds from the last close until ``ckptfs wait``
returns (everything durable in the store) and its FUSE requests by type (``status
--json``).  ``--upload-hold`` is passed to the mounts (decision 0015: uploads wait that
long for a writer that does not pause; read-behind uploads during a save need it short).  Uses a file:// store under WORKDIR.  Needs the pyfuse3 that
tools/setup.sh builds for the passthrough column.

    python tools/data_paths.py WORKDIR [--size-mib 1024] [--rounds 3] [--ranks 8]
        [--upload-hold SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def ckptfs(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "ckptfs", *args], check=True,
                          capture_output=True, text=True).stdout


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def save(directory: Path, name: str, buf: memoryview, ranks: int) -> float:
    part = len(buf) // ranks

    def one(rank: int) -> None:
        with open(directory / f"{name}.{rank}", "wb") as f:
            f.write(buf[rank * part:(rank + 1) * part])

    started = time.perf_counter()
    with ThreadPoolExecutor(ranks) as pool:
        list(pool.map(one, range(ranks)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--upload-hold", type=str, default=None)
    args = parser.parse_args()
    work = args.workdir
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    local = work / "local"
    local.mkdir(exist_ok=True)
    mounts = {}
    for name, extra in (("passthrough", ()), ("daemon", ("--passthrough", "off"))):
        mnt = work / f"{name}-mnt"
        mnt.mkdir(exist_ok=True)
        ckptfs("mount", str(mnt), "--store", f"file://{store}", "--state-dir",
               str(work / f"{name}-state"), "--durability", "async", *extra,
               *(("--upload-hold", args.upload_hold) if args.upload_hold else ()))
        mounts[name] = mnt
    try:
        buf = memoryview(os.urandom(args.size_mib << 20))
        times: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        total: dict[str, list[float]] = {}
        durable: dict[str, list[float]] = {}
        requests: dict[str, dict] = {}
        gib = len(buf) / (1 << 30)
        for rnd in range(args.rounds):
            for ranks in sorted({1, args.ranks}):
                for name, directory in (("local", local), *mounts.items()):
                    key = f"{name} x{ranks}"
                    status = json.loads(ckptfs("status", "--json", str(directory))) \
                        if name != "local" else None
                    before = cpu_seconds(status["pid"]) if status else 0.0
                    seconds = save(directory, f"r{rnd}", buf, ranks)
                    closed = time.perf_counter()
                    times.setdefault(key, []).append(seconds)
                    if status is not None:
                        after = json.loads(ckptfs("status", "--json", str(directory)))
                        cpu.setdefault(key, []).append(
                            (cpu_seconds(status["pid"]) - before) / gib)
                        requests[key] = {
                            op: n - status["fuse_requests"].get(op, 0)
                            for op, n in after["fuse_requests"].items()
                            if n - status["fuse_requests"].get(op, 0)
                            and op not in ("getxattr",)}
                        ckptfs("wait", str(directory))
                        durable.setdefault(key, []).append(time.perf_counter() - closed)
                        total.setdefault(key, []).append(
                            (cpu_seconds(status["pid"]) - before) / gib)
                    os.sync()
        for key in times:
            line = f"{key:<16} blocked median {statistics.median(times[key]):6.3f} s " \
                   f"(rounds {', '.join(f'{t:.3f}' for t in times[key])})"
            local_key = "local x" + key.split(" x")[1]
            line += f"  {statistics.median(times[key]) / statistics.median(times[local_key]):.2f}x local"
            if key in cpu:
                line += f"  daemon CPU s/GiB: save {statistics.median(cpu[key]):.2f}, " \
                        f"save+upload {statistics.median(total[key]):.2f}"
                line += f"  close->durable median {statistics.median(durable[key]):.2f} s " \
                        f"(rounds {', '.join(f'{t:.2f}' for t in durable[key])})"
                line += f"  requests {requests[key]}"
            print(line)
    finally:
        for mnt in mounts.values():
            subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt)],
                           capture_output=True)


if __name__ == "__main__":
    main()
