"""Profile the ckptfs daemon's write path and cold-read path with py-spy (issue 13).

    PYTHONPATH=$PWD python tools/profile_paths.py [--out DIR] [--durability sync|async]
        [--big-files 4] [--big-size 256] [--rate 250] [--native]

Starts a private SeaweedFS, mounts ckptfs through the CLI, attaches ``py-spy record``
to the daemon, writes the bench workload (``ckptfs.bench.runner.write_tree``) and waits until it
is durable; then mounts a fresh reader and cold-reads it, under a second recording.
Prints, per path, the daemon's CPU seconds per GiB (``/proc/<pid>/stat``) and where the
sampled time goes: by leaf frame (self) and by named cost (inclusive), scaled to seconds
per GiB.  Writes the raw collapsed stacks to DIR.  Needs py-spy (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckptfs.bench.runner import GiB, MiB, Workload, cpu_split, read_tree, write_tree
from ckptfs.bench.seaweed import SeaweedServer

# Named costs: a sample counts toward a name if any frame of its stack matches.
COSTS = {
    "FUSE write handler (core write)": ("write (ckptfs/core/write.py",),
    "FUSE read handler (core read)": ("read (ckptfs/core/read.py",),
    "staging pwrite": ("pwrite",),
    "upload worker (read back, hash, PUT)": ("_upload_from (ckptfs/data/upload.py",),
    "sha256": ("sha256", "hashlib", "sha256_block", "SHA256"),
    "blake3 (chunk ids, format 2)": ("blake3",),
    "crc32c (transfer checksum)": ("crc32c", "transfer_checksum"),
    "chunk id (either hash)": ("chunk_id (ckptfs/format/chunkid.py", "chunk_ok (ckptfs/format/chunkid.py"),
    "direct S3 client (s3_http)": ("ckptfs/store/s3_http.py",),
    "botocore request (signing, HTTP)": ("botocore",),
    "urllib3/http.client send/recv": ("urllib3", "http/client.py", "socket.py"),
    "cache fetch (GET+verify+write)": ("_fetch_sync (ckptfs/data/cache.py",),
    "cache pread (serve read)": ("pread (ckptfs/data/cache.py",),
    "pyfuse3 loop (request dispatch)": ("pyfuse3",),
    "trio scheduler": ("trio/_core",),
    "trio to_thread": ("to_thread_run_sync", "trio/_threads.py"),
    "LMDB": ("lmdb", "namespace.py"),
}


# With --native every thread samples as active: a sample waiting on a lock or in the
# event loop's poll is idle, not CPU.
IDLE = ("PyThread_acquire_lock_timed", "epoll_wait (", "poll (libc", "select (libc",
        "sem_wait", "pthread_cond_wait", "nanosleep")


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """tid -> (thread name, user s, system s) for every live thread of the daemon."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, _, tail = f.read().rpartition(")")
        except FileNotFoundError:
            continue
        fields = tail.split()
        out[int(tid)] = (head.partition("(")[2], int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def thread_report(before: dict, after: dict, gib: float) -> list[str]:
    """CPU per GiB by thread name (threads that ended meanwhile are not seen)."""
    by_name: dict[str, list[float]] = {}
    for tid, (name, user, system) in after.items():
        u0, s0 = before.get(tid, (name, 0.0, 0.0))[1:]
        key = "main (trio + FUSE loop)" if tid == min(after) else name
        acc = by_name.setdefault(key, [0.0, 0.0, 0])
        acc[0] += user - u0
        acc[1] += system - s0
        acc[2] += 1
    lines = ["  by thread (user + system s/GiB):"]
    for name, (user, system, n) in sorted(by_name.items(), key=lambda kv: -sum(kv[1][:2])):
        if user + system > 0:
            lines.append(f"    {user / gib:5.2f} + {system / gib:5.2f}  {name} ({n} threads)")
    return lines


def daemon_pid(mnt: Path, env: dict) -> int:
    out = subprocess.run([sys.executable, "-m", "ckptfs", "status", "--json", str(mnt)],
                         env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["pid"]


def cli(env: dict, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "ckptfs", *args], env=env, check=True,
                   capture_output=True, text=True)


def record(pid: int, out: Path, rate: int, native: bool) -> subprocess.Popen | None:
    if rate <= 0:
        return None         # --rate 0: CPU and per-thread split only, no sampling
    exe = Path(sys.executable).parent / "py-spy"
    cmd = [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
           "--output", str(out), "--threads"]
    # --native pauses the daemon for each sample (py-spy cannot unwind C frames of a
    # running process); without it, sampling does not stop the daemon.
    cmd.append("--native" if native else "--nonblocking")
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)          # let it attach
    return spy


def stop(spy: subprocess.Popen | None) -> None:
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
    err = spy.stderr.read().decode(errors="replace") if spy.stderr else ""
    if spy.returncode not in (0, -signal.SIGINT):
        print(f"py-spy exited {spy.returncode}: {err.strip()[-2000:]}", file=sys.stderr)


def summarize(path: Path, rate: int, gib: float, cpu: tuple[float, float], title: str) -> str:
    if not path.exists():
        return (f"== {title}: daemon CPU {sum(cpu) / gib:.2f} s/GiB (/proc: user "
                f"{cpu[0] / gib:.2f}, system {cpu[1] / gib:.2f})")
    self_time: collections.Counter = collections.Counter()
    named: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        if any(idle in frame for frame in frames[-4:] for idle in IDLE):
            continue
        total += n
        # Thread name frames ("thread (0x...)") lead the stack with --threads.
        leaf = frames[-1]
        self_time[leaf.split(" (")[0] + " (" + leaf.split(" (")[-1].split(":")[0]
                  if " (" in leaf else leaf] += n
        for name, needles in COSTS.items():
            if any(needle in frame for frame in frames for needle in needles):
                named[name] += n
    per = 1.0 / rate / gib
    lines = [f"== {title}: daemon CPU {sum(cpu) / gib:.2f} s/GiB (/proc: user "
             f"{cpu[0] / gib:.2f}, system {cpu[1] / gib:.2f}), sampled (non-idle) "
             f"{total * per:.2f} s/GiB over all threads"]
    lines.append("  by named cost (inclusive, s/GiB):")
    for name, n in named.most_common():
        lines.append(f"    {n * per:6.2f}  {name}")
    lines.append("  top leaf frames (self, s/GiB):")
    for leaf, n in self_time.most_common(25):
        lines.append(f"    {n * per:6.2f}  {leaf}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="ckptfs-prof-")))
    p.add_argument("--durability", default="sync", choices=["sync", "async"])
    p.add_argument("--big-files", type=int, default=4)
    p.add_argument("--big-size", type=int, default=256, help="MiB")
    p.add_argument("--rate", type=int, default=250)
    p.add_argument("--native", action="store_true")
    p.add_argument("--writes", type=int, default=1,
                   help="write the workload this many times, each from a new mount "
                        "(later writes find a store that already holds data)")
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-prof-work-"))
    workload = Workload(big_files=args.big_files, big_size=args.big_size * MiB)
    gib = workload.total / GiB
    server = SeaweedServer(work / "seaweed")
    server.start()
    report = []
    try:
        server.create_bucket("prof")
        env = dict(os.environ, **server.env())
        mounts = []

        def mount(name: str) -> Path:
            mnt = work / f"mnt-{name}"
            mnt.mkdir()
            cli(env, "mount", str(mnt), "--store", "s3://prof/", "--endpoint-url",
                server.endpoint_url, "--state-dir", str(work / f"state-{name}"),
                "--durability", args.durability)
            mounts.append(mnt)
            return mnt

        try:
            for i in range(args.writes):
                mnt = mount(f"writer-{i}")
                pid = daemon_pid(mnt, env)
                spy = record(pid, out / f"write-{i}.txt", args.rate, args.native)
                cpu0 = cpu_split(pid)
                threads0 = thread_cpu(pid)
                t0 = time.perf_counter()
                blocked = write_tree(mnt / f"ckpt-{i}", workload, f"prof-{i}")
                cli(env, "wait", str(mnt))
                durable = time.perf_counter() - t0
                cpu = tuple(b - a for a, b in zip(cpu0, cpu_split(pid)))
                threads = thread_report(threads0, thread_cpu(pid), gib)
                stop(spy)
                report.append(f"write {i + 1}/{args.writes} ({args.durability}): blocked "
                              f"{blocked:.2f}s durable {durable:.2f}s for {gib:.2f} GiB")
                report.append(summarize(out / f"write-{i}.txt", args.rate, gib, cpu,
                                        "write path"))
                report.extend(threads)
                cli(env, "umount", str(mnt))
                mounts.remove(mnt)

            mnt = mount("reader")
            pid = daemon_pid(mnt, env)
            spy = record(pid, out / "cold_read.txt", args.rate, args.native)
            cpu0 = cpu_split(pid)
            threads0 = thread_cpu(pid)
            seconds = read_tree(mnt / "ckpt-0", workload)
            cpu = tuple(b - a for a, b in zip(cpu0, cpu_split(pid)))
            threads = thread_report(threads0, thread_cpu(pid), gib)
            stop(spy)
            report.append(f"cold read: {seconds:.2f}s for {gib:.2f} GiB")
            report.append(summarize(out / "cold_read.txt", args.rate, gib, cpu,
                                    "cold-read path"))
            report.extend(threads)
        finally:
            for mnt in mounts:
                subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt)], env=env,
                               capture_output=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(report)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    print(f"(raw collapsed stacks in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
