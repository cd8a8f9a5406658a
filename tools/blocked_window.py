"""Where the machine's CPU goes while a writer is blocked (decision 0015).  Writes the
bench's workload through the bare passthrough and through ckptfs mounts over a private
SeaweedFS, round after round (systems alternating), and prints for each write: its wall
time, the CPU seconds of the writer, the FUSE daemon and the store server during it, the
machine's busy and idle CPU seconds, and (ckptfs) the MiB uploaded before the last close
returned and the seconds `ckptfs wait` took after it.

    .venv/bin/python tools/blocked_window.py [--rounds 6] [--systems passthrough async]
        [--no-prime] [--mount-arg=--upload-hold=0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable

from ckptfs.bench.runner import Bench, ckptfs_cli, cpu_seconds, daemon_status, write_tree

MiB = 1 << 20


def machine_cpu() -> tuple[float, float]:
    """(idle, total) CPU seconds of the machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (ticks[3] + ticks[4]) / tick, sum(ticks[:8]) / tick


def measure(step: Callable[[], object], pids: dict[str, int]) -> dict[str, float]:
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    own = os.times()
    idle0, total0 = machine_cpu()
    t0 = time.perf_counter()
    step()
    out = {"wall": time.perf_counter() - t0}
    own1 = os.times()
    idle1, total1 = machine_cpu()
    out["writer"] = own1.user + own1.system - own.user - own.system
    out["busy"] = (total1 - total0) - (idle1 - idle0)
    out["idle"] = idle1 - idle0
    for name, pid in pids.items():
        out[name] = cpu_seconds(pid) - before[name]
    return out


def one_write(bench: Bench, system: str, rnd: int, weed: int) -> dict[str, float]:
    if system == "passthrough":
        source = bench.work / f"passthrough-src-{rnd}"
        source.mkdir()
        mnt = bench.work / f"mnt-passthrough-{rnd}"
        proc = bench.start_passthrough(source, mnt)
        try:
            bench.prime()
            return measure(lambda: write_tree(mnt / "ckpt", bench.workload, f"pt{rnd}"),
                           {"daemon": proc.pid, "store": weed})
        finally:
            bench.stop_passthrough(proc, mnt)
            shutil.rmtree(source)
    name = f"{system}-{rnd}-{uuid.uuid4().hex[:6]}"
    mnt = bench.mount(name, system)
    try:
        pid = daemon_status(mnt, bench.env)["pid"]
        bench.prime()
        out = measure(lambda: write_tree(mnt / "ckpt", bench.workload, name),
                      {"daemon": pid, "store": weed})
        out["uploaded_mib"] = daemon_status(mnt, bench.env)["fs"]["bytes_uploaded"] / MiB
        t0 = time.perf_counter()
        ckptfs_cli("wait", str(mnt), env=bench.env)
        out["wait"] = time.perf_counter() - t0
        return out
    finally:
        bench.umount(mnt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--systems", nargs="+", default=["passthrough", "async"],
                   choices=["passthrough", "sync", "async"])
    p.add_argument("--no-prime", dest="prime", action="store_false")
    p.add_argument("--mount-arg", action="append", default=[])
    args = p.parse_args()
    bench = Bench(argparse.Namespace(
        work_dir=None, big_files=4, big_size=256 * MiB, small_files=20, store=None,
        endpoint_url=None, mount_arg=args.mount_arg, quick=True, prime=args.prime))
    bench.open_store()
    weed = bench.server.process.pid
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for rnd in range(args.rounds):
            for system in args.systems if rnd % 2 == 0 else args.systems[::-1]:
                out = one_write(bench, system, rnd, weed)
                print(system, rnd, json.dumps({k: round(v, 2) for k, v in out.items()}),
                      flush=True)
                for key, value in out.items():
                    results.setdefault(system, {}).setdefault(key, []).append(value)
    finally:
        bench.server.stop()
        shutil.rmtree(bench.work, ignore_errors=True)
    medians = {system: {k: statistics.median(v) for k, v in rows.items()}
               for system, rows in results.items()}
    for system, row in medians.items():
        print("median", system, json.dumps({k: round(v, 2) for k, v in row.items()}))
    if "passthrough" in medians:
        for system in medians.keys() - {"passthrough"}:
            ratios = [a / b for a, b in zip(results[system]["wall"],
                                            results["passthrough"]["wall"])]
            print(f"{system} wall / passthrough wall: median "
                  f"{medians[system]['wall'] / medians['passthrough']['wall']:.2f}, "
                  f"per round {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
