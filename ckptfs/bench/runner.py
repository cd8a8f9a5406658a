"""``ckptfs bench``: a checkpoint workload run against ckptfs and its baselines, side by
side, in alternating rounds, printing medians and ratios (DESIGN.md §7).

Workload (default): 4 files of 256 MiB and 20 small files, never-repeating bytes,
written with 1 MiB writes, then fsync, then close.  Baselines: local disk; a bare pyfuse3
passthrough over local disk (``ckptfs.bench.passthrough``: the floor for a Python FUSE daemon);
and a direct, parallel boto3 (s3transfer) upload/download of the same files to the same
store.  ckptfs runs in ``sync`` and ``async`` modes.  A multi-rank save (``--ranks``
processes writing ``--rank-size`` each at once, default 8 x 128 MiB) runs on local disk, the
passthrough and each ckptfs mode.  Each ckptfs round uses a fresh mount
(new state dir) so reads are cold.  Daemon CPU (``/proc/<pid>/stat`` utime+stime, every
thread) is read before and after writing and cold-reading, and reported per GiB (issue
13); the write's is split by the daemon's own counters into hashing, PUT and the rest
(issue 23).  ``--mount-arg`` runs the ckptfs rows on another data path.  Uses the CLI, as a user would.  Knows nothing of ckptfs internals.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .seaweed import SeaweedServer

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Workload:
    big_files: int = 4
    big_size: int = 256 * MiB
    small_files: int = 20
    small_size: int = 64 * 1024
    write_size: int = MiB

    def files(self) -> list[tuple[str, int]]:
        out = [(f"model-{i:02d}.safetensors", self.big_size) for i in range(self.big_files)]
        out += [(f"small-{i:02d}.json", self.small_size) for i in range(self.small_files)]
        return out

    @property
    def total(self) -> int:
        return sum(size for _, size in self.files())


def block(tag: str, index: int, size: int) -> bytes:
    """``size`` bytes unique to (tag, index): never repeats across files or rounds."""
    seed = hashlib.sha256(f"{tag}/{index}".encode()).digest()
    reps = -(-size // 32)
    return (seed * reps)[:size]


def write_tree(root: Path, workload: Workload, tag: str, do_fsync: bool = True,
               phases: dict | None = None) -> float:
    """Write the workload under ``root``; return seconds until every close returned.
    ``phases``, if given, receives the seconds spent in ``fsync`` and in ``close``."""
    root.mkdir(parents=True, exist_ok=True)
    fsync_s = close_s = 0.0
    t0 = time.perf_counter()
    for name, size in workload.files():
        fd = os.open(root / name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            written = 0
            index = 0
            while written < size:
                n = min(workload.write_size, size - written)
                os.write(fd, block(f"{tag}/{name}", index, n))
                written += n
                index += 1
            if do_fsync:
                t = time.perf_counter()
                os.fsync(fd)
                fsync_s += time.perf_counter() - t
        finally:
            t = time.perf_counter()
            os.close(fd)
            close_s += time.perf_counter() - t
    if phases is not None:
        phases.update(fsync=fsync_s, close=close_s)
    return time.perf_counter() - t0


def read_tree(root: Path, workload: Workload) -> float:
    t0 = time.perf_counter()
    for name, _ in workload.files():
        with open(root / name, "rb", buffering=0) as f:
            while f.read(4 * MiB):
                pass
    return time.perf_counter() - t0


def drop_page_cache(path: Path) -> None:
    """Evict one tree's pages from the page cache (POSIX_FADV_DONTNEED)."""
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prime_memory(directory: Path, nbytes: int) -> None:
    """Write ``nbytes`` into a scratch file and delete it, so the timed step that follows
    takes pages the kernel has just touched.  A VM that hands freed memory back to its
    host (virtio-balloon free page reporting, as this project's machines do) pays ~2
    system s/GiB on the next first touch of a page, and without this a system's time
    swung 3x with what ran before it in the round (decision 0015).  Every system's timed
    step gets the same start; ``--no-prime`` measures without it."""
    path = directory / ".prime"
    block_ = b"\xa5" * MiB
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        for _ in range(-(-nbytes // MiB)):
            os.write(fd, block_)
    finally:
        os.close(fd)
        path.unlink()


def ckptfs_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfs", *args], check=True,
                          capture_output=True, text=True, env=env)


def daemon_status(mnt: Path, env: dict) -> dict:
    return json.loads(ckptfs_cli("status", "--json", str(mnt), env=env).stdout)


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads
    (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads."""
    return sum(cpu_split(pid))


def wait_mounted(mnt: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mnt):
        if proc.poll() is not None:
            raise RuntimeError(f"passthrough daemon exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"passthrough did not mount {mnt} within {timeout:.0f}s")
        time.sleep(0.05)


READER = r"""
import sys
with open(sys.argv[1], "rb", buffering=0) as f:
    while f.read(4 << 20):
        pass
"""


RANK = r"""
import os, sys
from ckptfs.bench.runner import block
path, size, tag, chunk = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
print("ready", flush=True)
sys.stdin.readline()
written = index = 0
while written < size:
    n = min(chunk, size - written)
    os.write(fd, block(tag, index, n))
    written += n
    index += 1
os.fsync(fd)
os.close(fd)
print("done", flush=True)
"""


def time_ranks(root: Path, ranks: int, size: int, tag: str, write_size: int = MiB) -> float:
    """Seconds until ``ranks`` processes, released at once (each started and with its
    file created beforehand), have each written ``size`` bytes of its own file with
    ``write_size`` writes, fsynced and closed it: a data-parallel job's save."""
    root.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(root / f"shard-{i:02d}.bin"),
                               str(size), f"{tag}/rank{i}", str(write_size)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(ranks)]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a rank writer failed to start")
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "done":
                raise RuntimeError("a rank writer failed")
        return time.perf_counter() - t0
    finally:
        for p in procs:
            if p.poll() is None and p.stdin is not None:
                p.stdin.close()
            p.wait()


def time_readers(target: Path, readers: int) -> float:
    """Seconds until ``readers`` processes started at once have each read ``target``."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(target)])
             for _ in range(readers)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="ckptfs-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.workload = Workload(big_files=args.big_files, big_size=args.big_size,
                                 small_files=args.small_files)
        self.env = dict(os.environ)
        self.server: SeaweedServer | None = None
        self.results: dict[str, dict[str, list[float]]] = {}
        self.rounds_done = 0

    def prime(self) -> None:
        """Before each timed step (``prime_memory``): twice the workload, room for the
        system's own copy and the store server's."""
        if self.args.prime:
            prime_memory(self.work, 2 * self.workload.total)

    def record(self, system: str, metric: str, value: float) -> None:
        self.results.setdefault(system, {}).setdefault(metric, []).append(value)

    def eight_ranks(self, system: str, root: Path, tag: str) -> None:
        """``--ranks`` processes saving ``--rank-size`` each at once (memory primed for
        all of it first): the time until the last one's close returned."""
        if self.args.ranks <= 0:
            return
        if self.args.prime:
            prime_memory(self.work, 2 * self.args.ranks * self.args.rank_size)
        self.record(system, "ranks_blocked",
                    time_ranks(root, self.args.ranks, self.args.rank_size, tag))

    # -------------------------------------------------------------- store
    def open_store(self) -> None:
        if self.args.store:
            self.store_url = self.args.store
            self.endpoint = self.args.endpoint_url
            return
        from .seaweed import SeaweedServer
        self.server = SeaweedServer(self.work / "seaweed")
        self.server.start()
        self.server.create_bucket("bench")
        self.env.update(self.server.env())
        self.store_url = "s3://bench/"
        self.endpoint = self.server.endpoint_url

    def s3_client(self):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint or None,
                            config=Config(max_pool_connections=32,
                                          s3={"addressing_style": "path"}),
                            aws_access_key_id=self.env.get("AWS_ACCESS_KEY_ID"),
                            aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY"),
                            region_name=self.env.get("AWS_DEFAULT_REGION", "us-east-1"))

    # -------------------------------------------------------------- systems
    def run_local(self, rnd: int) -> None:
        root = self.work / f"local-{rnd}"
        self.prime()
        blocked = write_tree(root, self.workload, f"local{rnd}")
        self.record("local", "blocked", blocked)
        self.record("local", "durable", blocked)
        drop_page_cache(root)
        self.prime()
        self.record("local", "cold_read", read_tree(root, self.workload))
        self.record("local", "warm_read", read_tree(root, self.workload))
        if not self.args.quick and self.workload.big_files:
            # The same 1 and 8 reader processes over a local file in the page cache:
            # what 8 readers cost this machine with no file system work at all.
            target = root / self.workload.files()[0][0]
            for readers in (1, 8):
                self.record("local", f"{readers}_readers", time_readers(target, readers))
        shutil.rmtree(root)
        self.eight_ranks("local", self.work / f"local-ranks-{rnd}", f"localranks{rnd}")
        shutil.rmtree(self.work / f"local-ranks-{rnd}", ignore_errors=True)

    def start_passthrough(self, source: Path, mnt: Path) -> subprocess.Popen:
        mnt.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-m", "ckptfs.bench.passthrough", str(source),
                                 str(mnt)], env=self.env)
        try:
            wait_mounted(mnt, proc)
        except BaseException:
            self.stop_passthrough(proc, mnt)
            raise
        return proc

    def stop_passthrough(self, proc: subprocess.Popen, mnt: Path) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)

    def run_passthrough(self, rnd: int) -> None:
        """The same workload through a bare pyfuse3 passthrough over local disk: a fresh
        daemon for writing, another for reading (so the FUSE page cache is cold)."""
        source = self.work / f"passthrough-src-{rnd}"
        source.mkdir()
        mnt = self.work / f"mnt-passthrough-{rnd}"
        gib = self.workload.total / GiB
        proc = self.start_passthrough(source, mnt)
        try:
            self.prime()
            cpu0 = cpu_seconds(proc.pid)
            phases: dict = {}
            blocked = write_tree(mnt / "ckpt", self.workload, f"passthrough{rnd}",
                                 phases=phases)
            self.record("passthrough", "blocked", blocked)
            self.record("passthrough", "blocked_in_fsync", phases["fsync"])
            self.record("passthrough", "cpu_s_per_gib_write",
                        (cpu_seconds(proc.pid) - cpu0) / gib)
            self.record("passthrough", "peak_rss_mib", peak_rss(proc.pid) / MiB)
            self.eight_ranks("passthrough", mnt / "ranks", f"passthroughranks{rnd}")
        finally:
            self.stop_passthrough(proc, mnt)
        shutil.rmtree(source / "ranks", ignore_errors=True)
        drop_page_cache(source)
        proc = self.start_passthrough(source, mnt)
        try:
            self.prime()
            cpu0 = cpu_seconds(proc.pid)
            self.record("passthrough", "cold_read", read_tree(mnt / "ckpt", self.workload))
            self.record("passthrough", "cpu_s_per_gib_cold_read",
                        (cpu_seconds(proc.pid) - cpu0) / gib)
            self.record("passthrough", "warm_read", read_tree(mnt / "ckpt", self.workload))
        finally:
            self.stop_passthrough(proc, mnt)
        shutil.rmtree(source)

    def run_boto3(self, rnd: int) -> None:
        if not self.store_url.startswith("s3://"):
            return
        from boto3.s3.transfer import TransferConfig
        bucket, _, prefix = self.store_url[5:].partition("/")
        key_prefix = f"{prefix.strip('/')}/boto3-{uuid.uuid4().hex[:8]}/".lstrip("/")
        src = self.work / f"boto3-src-{rnd}"
        write_tree(src, self.workload, f"boto3{rnd}", do_fsync=False)
        client = self.s3_client()
        cfg = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB,
                             max_concurrency=10)
        files = self.workload.files()
        gib = self.workload.total / GiB
        self.prime()
        # CPU of this process (every thread: only boto3's run meanwhile), beside the
        # daemon's: what a Python S3 client spends to move the same bytes.
        t0, cpu0 = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda nf: client.upload_file(str(src / nf[0]), bucket,
                                                         key_prefix + nf[0], Config=cfg), files))
        self.record("boto3", "durable", time.perf_counter() - t0)
        self.record("boto3", "cpu_s_per_gib_upload", (time.process_time() - cpu0) / gib)
        dst = self.work / f"boto3-dst-{rnd}"
        dst.mkdir()
        self.prime()
        t0, cpu0 = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda nf: client.download_file(bucket, key_prefix + nf[0],
                                                           str(dst / nf[0]), Config=cfg), files))
        self.record("boto3", "cold_read", time.perf_counter() - t0)
        self.record("boto3", "cpu_s_per_gib_download", (time.process_time() - cpu0) / gib)
        # The order a sync writer and a single reader work in: one file after another
        # (each file's parts still in parallel).  A sync close returns when its file is
        # in the store, so the next file's upload cannot start before.
        serial_prefix = key_prefix.rstrip("/") + "-serial/"
        self.prime()
        t0 = time.perf_counter()
        for name, _ in files:
            client.upload_file(str(src / name), bucket, serial_prefix + name, Config=cfg)
        self.record("boto3", "durable_file_by_file", time.perf_counter() - t0)
        shutil.rmtree(dst)
        dst.mkdir()
        self.prime()
        t0 = time.perf_counter()
        for name, _ in files:
            client.download_file(bucket, serial_prefix + name, str(dst / name), Config=cfg)
        self.record("boto3", "cold_read_file_by_file", time.perf_counter() - t0)
        shutil.rmtree(src)
        shutil.rmtree(dst)

    def state_dir(self, mnt: Path) -> Path:
        """The state dir of the ckptfs mount at ``mnt`` (``mount`` names both)."""
        return self.work / f"state-{mnt.name.removeprefix('mnt-')}"

    def variant_args(self, system: str) -> list[str]:
        """Extra mount arguments of a ckptfs row: ``ckptfs-<mode>+<variant>`` takes the
        ``--variant <variant>=<args>`` ones (a data path, a hash...), after
        ``--mount-arg``'s, which every ckptfs row takes."""
        _, _, variant = system.partition("+")
        if not variant:
            return []
        for spec in self.args.variant or []:
            label, _, args = spec.partition("=")
            if label == variant:
                return args.split()
        raise SystemExit(f"ckptfs bench: no --variant {variant}=ARGS for system {system}")

    def mount(self, name: str, durability: str, extra: list[str] | None = None) -> Path:
        mnt = self.work / f"mnt-{name}"
        mnt.mkdir(exist_ok=True)
        args = ["mount", str(mnt), "--store", self.store_url, "--state-dir",
                str(self.state_dir(mnt)), "--durability", durability]
        if self.endpoint:
            args += ["--endpoint-url", self.endpoint]
        args += self.args.mount_arg or []
        args += extra or []
        ckptfs_cli(*args, env=self.env)
        return mnt

    def umount(self, mnt: Path) -> None:
        """Unmount, then remove the mount's state dir, as every other system's round
        removes its files: a round must not find the page cache filled by earlier rounds'
        staging files when the baselines' rounds do not (on a VM whose memory is backed
        lazily, writing into never-touched pages costs ~2 system s/GiB more)."""
        ckptfs_cli("umount", str(mnt), env=self.env)
        shutil.rmtree(self.state_dir(mnt), ignore_errors=True)

    def run_ckptfs(self, rnd: int, system: str) -> None:
        durability = system.removeprefix("ckptfs-").partition("+")[0]
        extra = self.variant_args(system)
        name = f"{durability}-{rnd}-{uuid.uuid4().hex[:6]}"
        mnt = self.mount(name, durability, extra)
        try:
            status = daemon_status(mnt, self.env)
            pid = status["pid"]
            root = mnt / f"ckpt-{name}"
            self.prime()
            cpu0 = cpu_seconds(pid)
            t0 = time.perf_counter()
            phases: dict = {}
            blocked = write_tree(root, self.workload, name, phases=phases)
            ckptfs_cli("wait", str(mnt), env=self.env)
            durable = time.perf_counter() - t0
            cpu = cpu_seconds(pid) - cpu0
            self.record_cpu_split(system, status, daemon_status(mnt, self.env), cpu)
            self.record(system, "blocked", blocked)
            self.record(system, "blocked_in_fsync", phases["fsync"])
            self.record(system, "blocked_in_close", phases["close"])
            self.record(system, "durable", durable)
            if not self.args.quick:
                before = daemon_status(mnt, self.env)["fs"]["bytes_uploaded"]
                write_tree(mnt / f"resave-{name}", self.workload, name)
                ckptfs_cli("wait", str(mnt), env=self.env)
                after = daemon_status(mnt, self.env)["fs"]["bytes_uploaded"]
                self.record(system, "resave_uploaded_fraction",
                            (after - before) / self.workload.total)
            self.record(system, "peak_rss_mib", peak_rss(pid) / MiB)
            self.eight_ranks(system, mnt / f"ranks-{name}", f"{name}ranks")
            ckptfs_cli("wait", str(mnt), env=self.env)
        finally:
            self.umount(mnt)
        # Cold and warm reads from a fresh mount (new state dir: nothing cached).
        reader = self.mount(f"{name}-reader", durability, extra)
        try:
            pid = daemon_status(reader, self.env)["pid"]
            self.prime()
            cpu0 = cpu_seconds(pid)
            self.record(system, "cold_read", read_tree(reader / f"ckpt-{name}", self.workload))
            self.record(system, "cpu_s_per_gib_cold_read",
                        (cpu_seconds(pid) - cpu0) / (self.workload.total / GiB))
            self.record(system, "warm_read", read_tree(reader / f"ckpt-{name}", self.workload))
            if not self.args.quick and self.workload.big_files:
                self.eight_readers(rnd, system, name)
            self.record(system, "reader_peak_rss_mib", peak_rss(pid) / MiB)
        finally:
            self.umount(reader)

    def record_cpu_split(self, system: str, before: dict, after: dict, cpu: float) -> None:
        """Daemon CPU per GiB written, by where it went: naming chunks (hashing), sending
        them (PUT) and asking whether the store has them (HEAD) from the daemon's own
        counters (the thread time of upload workers and of the store's request threads),
        the rest (the FUSE loop, reading staging files back, metadata, other requests)
        by difference."""
        gib = self.workload.total / GiB

        def spent(read) -> float:
            return read(after) - read(before)
        hashing = spent(lambda s: s["fs"].get("upload_hash_cpu_s", 0.0))
        put = spent(lambda s: s["store_stats"].get("cpu_s", {}).get("put", 0.0))
        head = spent(lambda s: s["store_stats"].get("cpu_s", {}).get("exists", 0.0))
        self.record(system, "cpu_s_per_gib_write", cpu / gib)
        self.record(system, "cpu_s_per_gib_write_hash", hashing / gib)
        self.record(system, "cpu_s_per_gib_write_put", put / gib)
        self.record(system, "cpu_s_per_gib_write_head", head / gib)
        self.record(system, "cpu_s_per_gib_write_rest", (cpu - hashing - put - head) / gib)

    def eight_readers(self, rnd: int, system: str, name: str) -> None:
        """One cold reader of a big file on a fresh mount, then 8 at once on another."""
        for readers in (1, 8):
            mnt = self.mount(f"{name}-{readers}r", "sync", self.variant_args(system))
            try:
                target = mnt / f"ckpt-{name}" / self.workload.files()[0][0]
                target.parent.stat()
                before = daemon_status(mnt, self.env)["store_stats"]["chunk_bytes_got"]
                self.record(system, f"{readers}_readers", time_readers(target, readers))
                # Read-ahead of the next file may still be fetching: count it whole.
                deadline = time.monotonic() + 60
                while daemon_status(mnt, self.env)["fs"]["fetches_in_flight"] and \
                        time.monotonic() < deadline:
                    time.sleep(0.05)
                fetched = daemon_status(mnt, self.env)["store_stats"]["chunk_bytes_got"] - before
                self.record(system, f"{readers}_readers_fetched_x",
                            fetched / self.workload.big_size)
            finally:
                self.umount(mnt)

    # -------------------------------------------------------------- main
    def run(self) -> dict:
        self.open_store()
        try:
            for rnd in range(self.args.rounds):
                # Every other round runs the systems in reverse order: on a shared VM a
                # system run later in a round meets a busier page cache (and fresher,
                # costlier pages), and each ratio compares two systems of one round.
                order = self.args.systems if rnd % 2 == 0 else self.args.systems[::-1]
                # --big-files 0 --small-files 0: no checkpoint, the small trees only
                for system in order if self.workload.total else ():
                    print(f"bench: round {rnd + 1}/{self.args.rounds}: {system}",
                          file=sys.stderr, flush=True)
                    if system == "local":
                        self.run_local(rnd)
                    elif system == "passthrough":
                        self.run_passthrough(rnd)
                    elif system == "boto3":
                        self.run_boto3(rnd)
                    else:
                        self.run_ckptfs(rnd, system)
                if self.args.small_tree:
                    self.run_small_trees(rnd, order)
                self.rounds_done = rnd + 1
                if self.args.progress_json:
                    # The rounds so far, for a run that may be cut short.
                    Path(self.args.progress_json).write_text(json.dumps(self.summary()))
        finally:
            if self.server:
                self.server.stop()
            if not self.args.work_dir:
                shutil.rmtree(self.work, ignore_errors=True)
        return self.summary()

    # -------------------------------------------------------------- small files (issue 25)
    SMALL_SYSTEMS = ("local", "passthrough", "ckptfs-async", "ckptfs-sync")

    def run_small_trees(self, rnd: int, order: list[str]) -> None:
        """``cp -a`` and ``tar x`` of a tree of ``--small-tree`` files of 4 KiB into a
        fresh directory of each system (``bench/smallfiles.py``): the per-file cost a
        daemon adds.  Recorded as ``small_cp_a`` and ``small_tar_x`` (seconds)."""
        from .smallfiles import cp_a, make_tar, make_tree, tar_x
        if not hasattr(self, "_small"):
            src = self.work / "small-src"
            src.mkdir(exist_ok=True)
            tree = make_tree(src, self.args.small_tree, 4096)
            self._small = (tree, make_tar(tree, self.work / "small.tar"))
        tree, archive = self._small
        for system in order:
            if system not in self.SMALL_SYSTEMS:
                continue
            print(f"bench: round {rnd + 1}/{self.args.rounds}: {system}: small files",
                  file=sys.stderr, flush=True)
            name = f"small-{system}-{rnd}-{uuid.uuid4().hex[:6]}"
            proc: subprocess.Popen | None = None
            if system == "local":
                target = self.work / name
                target.mkdir()
            elif system == "passthrough":
                source = self.work / f"{name}-src"
                source.mkdir()
                target = self.work / f"mnt-{name}"
                proc = self.start_passthrough(source, target)
            else:
                target = self.mount(name, system.removeprefix("ckptfs-"))
            try:
                # Below a directory of its own: the ckptfs mounts of a run share the
                # store, and each sees what the others wrote there.
                into = target / name
                into.mkdir()
                self.record(system, "small_cp_a", cp_a(tree, archive, into))
                self.record(system, "small_tar_x", tar_x(tree, archive, into))
            finally:
                if system == "local":
                    shutil.rmtree(target)
                elif proc is not None:
                    self.stop_passthrough(proc, target)
                    shutil.rmtree(self.work / f"{name}-src")
                else:
                    ckptfs_cli("wait", str(target), env=self.env)
                    self.umount(target)

    def summary(self) -> dict:
        med = {s: {m: statistics.median(v) for m, v in ms.items()}
               for s, ms in self.results.items()}
        return {"workload": {"files": len(self.workload.files()),
                             "bytes": self.workload.total}, "medians": med,
                "ranks": self.args.ranks, "rank_size": self.args.rank_size,
                "rounds": self.rounds_done, "raw": self.results}


def ratios(summary: dict) -> list[str]:
    """The ratios issue 13 sets targets for, from the medians of one run."""
    med = summary["medians"]
    local = med.get("local", {})
    passthrough = med.get("passthrough", {})
    boto = med.get("boto3", {})
    lines: list[str] = []
    line, ratio = _liners(lines)
    rows = [s for s in med if s.startswith("ckptfs-")]
    for row in sorted(rows, key=lambda r: (r.partition("+")[2], r)):
        m = med[row]
        # "async" / "sync", or "async+<variant>": the targets are the mode's.
        label = row.removeprefix("ckptfs-")
        mode = label.partition("+")[0]
        if not m:
            continue
        ratio(f"{label}: blocked / passthrough blocked", m.get("blocked"),
              passthrough.get("blocked"), 1.15 if mode == "async" else None,
              "<= 1.15x" if mode == "async" else "-")
        # Issue 23's targets: async save blocked and an eight-rank save within 1.3x of
        # local disk; sync durable within 1.1x of boto3; daemon CPU <= 1.0 s/GiB written.
        ratio(f"{label}: blocked / local-disk write", m.get("blocked"), local.get("blocked"),
              1.3 if mode == "async" else None, "<= 1.3x" if mode == "async" else "-")
        ratio(f"{label}: {_ranks(summary)} ranks blocked / local disk", m.get("ranks_blocked"),
              local.get("ranks_blocked"), 1.3 if mode == "async" else None,
              "<= 1.3x" if mode == "async" else "-")
        ratio(f"{label}: durable / parallel boto3 upload", m.get("durable"),
              boto.get("durable"), 1.1 if mode == "sync" else None,
              "<= 1.1x" if mode == "sync" else "-")
        ratio(f"{label}: durable / boto3 upload file by file", m.get("durable"),
              boto.get("durable_file_by_file"), None, "-")
        ratio(f"{label}: cold read time / parallel boto3 download", m.get("cold_read"),
              boto.get("cold_read"), 1.0, "<= 1.0x")
        ratio(f"{label}: cold read time / boto3 download file by file", m.get("cold_read"),
              boto.get("cold_read_file_by_file"), None, "-")
        ratio(f"{label}: 8 readers / 1 reader (time)", m.get("8_readers"),
              m.get("1_readers"), 1.2, "<= 1.2x")
        if m.get("8_readers_fetched_x") and m.get("1_readers_fetched_x"):
            # One download per node: 8 readers fetch what one reader fetches.  Both
            # include the next file's first chunks, fetched ahead for a reader that
            # reached the file's end (decision 0015), hence "/ file size" above 1.
            value = m["8_readers_fetched_x"] / m["1_readers_fetched_x"]
            line(f"{label}: 8 readers: bytes fetched / one reader's", value, "1.00x",
                 abs(value - 1.0) < 0.005)
            line(f"{label}: 8 readers: bytes fetched / file size", m["8_readers_fetched_x"],
                 "-", None)
        cpu_lines(line, label, m)
        for metric in ("cpu_s_per_gib_write", "cpu_s_per_gib_cold_read"):
            ratio(f"{label}: daemon CPU {metric.removeprefix('cpu_s_per_gib_')} / passthrough",
                  m.get(metric), passthrough.get(metric), None, "-")
        boto3_cpu_lines(ratio, label, m, boto)
        for metric in ("peak_rss_mib", "reader_peak_rss_mib"):
            if m.get(metric) is not None:
                line(f"{label}: daemon {metric.replace('_', ' ')}", m[metric], "<= 300 MiB",
                     m[metric] <= 300)
        if m.get("warm_read") and local.get("warm_read"):
            line(f"{label}: warm read throughput / local disk",
                 local["warm_read"] / m["warm_read"], ">= 0.8x",
                 local["warm_read"] / m["warm_read"] >= 0.8)
    return lines + small_file_ratios(med) + floors(local, passthrough)


def small_file_ratios(med: dict) -> list[str]:
    """Issue 25: a tree of small files copied (``cp -a``) and unpacked (``tar x``) into
    ckptfs, against the bare passthrough (target: async <= 2x) and local disk."""
    lines: list[str] = []
    _, ratio = _liners(lines)
    local = med.get("local", {})
    passthrough = med.get("passthrough", {})
    for mode in ("async", "sync"):
        m = med.get(f"ckptfs-{mode}", {})
        for metric, label in (("small_cp_a", "cp -a"), ("small_tar_x", "tar x")):
            ratio(f"{mode}: small files {label} / passthrough", m.get(metric),
                  passthrough.get(metric), 2.0 if mode == "async" else None,
                  "<= 2.0x" if mode == "async" else "-")
            ratio(f"{mode}: small files {label} / local disk", m.get(metric),
                  local.get(metric), None, "-")
    return lines


def cpu_lines(line, label: str, m: dict) -> None:
    """Daemon CPU per GiB (issue 23: <= 1.0 written), the write's split by where it went."""
    for metric, limit in (("cpu_s_per_gib_write", 1.0), ("cpu_s_per_gib_cold_read", 1.0)):
        if m.get(metric) is not None:
            line(f"{label}: daemon CPU s/GiB {metric.removeprefix('cpu_s_per_gib_')}",
                 m[metric], f"<= {limit}", m[metric] <= limit)
    for part in ("hash", "put", "head", "rest"):
        line(f"{label}:   of which {CPU_PARTS[part]}", m.get(f"cpu_s_per_gib_write_{part}"),
             "-", None)


CPU_PARTS = {"hash": "naming chunks (hash)", "put": "PUT (transfer checksum, send)",
             "head": "HEAD (does the store have the chunk)",
             "rest": "FUSE loop, reading staging, metadata, other requests"}


def _ranks(summary: dict) -> str:
    return str(summary.get("ranks", 8))


def boto3_cpu_lines(ratio, label: str, m: dict, boto: dict) -> None:
    """The same bytes moved by boto3 in the bench's process: the CPU a Python S3 client
    spends on the upload (beside a write) and the download (beside a cold read) alone."""
    ratio(f"{label}: daemon CPU write / boto3 upload CPU", m.get("cpu_s_per_gib_write"),
          boto.get("cpu_s_per_gib_upload"), None, "-")
    ratio(f"{label}: daemon CPU cold read / boto3 download CPU",
          m.get("cpu_s_per_gib_cold_read"), boto.get("cpu_s_per_gib_download"), None, "-")


def _liners(lines: list[str]):
    """``line(label, value, target, met)`` and ``ratio(label, a, b, limit, target)``,
    appending formatted rows to ``lines``."""
    def line(label: str, value: float | None, target: str, met: bool | None) -> None:
        if value is None:
            return
        verdict = "" if met is None else ("  ok" if met else "  MISSED")
        lines.append(f"  {label:<58} {value:8.2f}   (target {target}){verdict}")

    def ratio(label: str, a, b, limit: float | None, target: str) -> None:
        if a is None or not b:
            return
        value = a / b
        line(label, value, target, None if limit is None else value <= limit)
    return line, ratio


def floors(local: dict, passthrough: dict) -> list[str]:
    """What this machine allows at all: the same measures with no ckptfs in the way."""
    lines: list[str] = []
    line, ratio = _liners(lines)
    ratio("floor: 8 readers / 1 reader of a local file (page cache)", local.get("8_readers"),
          local.get("1_readers"), None, "-")
    if passthrough.get("warm_read") and local.get("warm_read"):
        line("floor: passthrough warm read throughput / local disk",
             local["warm_read"] / passthrough["warm_read"], "-", None)
    return lines


def print_table(summary: dict) -> None:
    total = summary["workload"]["bytes"]
    print(f"workload: {summary['workload']['files']} files, {total / MiB:.0f} MiB; medians "
          f"of {summary['rounds']} round(s)")
    metrics = sorted({m for ms in summary["medians"].values() for m in ms})
    systems = list(summary["medians"])
    print(f"{'metric':<28}" + "".join(f"{s:>16}" for s in systems))
    for metric in metrics:
        row = f"{metric:<28}"
        for s in systems:
            v = summary["medians"][s].get(metric)
            row += f"{'-':>16}" if v is None else f"{v:>16.3f}"
        print(row)
    print("throughput (MiB/s, from the medians):")
    for s in systems:
        parts = []
        for metric in ("blocked", "durable", "cold_read", "warm_read"):
            v = summary["medians"][s].get(metric)
            if v:
                parts.append(f"{metric} {total / MiB / v:8.1f}")
        print(f"  {s:<16} " + "  ".join(parts))
    print("ratios:")
    for line in ratios(summary):
        print(line)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="store URL (default: start a private SeaweedFS)")
    p.add_argument("--endpoint-url")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", nargs="+",
                   default=["local", "passthrough", "boto3", "ckptfs-sync", "ckptfs-async"])
    p.add_argument("--big-files", type=int, default=4)
    p.add_argument("--big-size", type=lambda s: int(float(s) * MiB), default=256 * MiB,
                   help="size of each big file in MiB")
    p.add_argument("--small-files", type=int, default=20)
    p.add_argument("--small-tree", type=int, default=1000, metavar="FILES",
                   help="files of 4 KiB in the tree `cp -a` and `tar x` copy into each "
                   "system every round (0: skip)")
    p.add_argument("--ranks", type=int, default=8,
                   help="processes saving at once in the multi-rank save (0: skip it)")
    p.add_argument("--rank-size", type=lambda s: int(float(s) * MiB), default=128 * MiB,
                   help="bytes each rank saves, in MiB (default 128)")
    p.add_argument("--work-dir", help="scratch directory (default: a new temp dir)")
    p.add_argument("--quick", action="store_true", help="skip re-save and 8-reader runs")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--progress-json", metavar="FILE",
                   help="write the summary of the rounds so far to FILE after each round")
    p.add_argument("--no-prime", dest="prime", action="store_false",
                   help="do not write and delete a scratch file before each timed step "
                   "(on a VM that returns freed memory to its host, times then depend on "
                   "what ran before)")
    p.add_argument("--variant", action="append", metavar="NAME=ARGS",
                   help="mount arguments of the ckptfs rows named ckptfs-<mode>+NAME in "
                   "--systems (repeatable), e.g. --variant 'sha256=--chunk-hash sha256' "
                   "--systems local ckptfs-sync ckptfs-sync+sha256: one row per data "
                   "path or setting, measured in the same rounds")
    p.add_argument("--mount-arg", action="append", metavar="ARG",
                   help="extra argument for `ckptfs mount` (repeatable), e.g. "
                   "--mount-arg=--writeback-cache")


def main(args: argparse.Namespace) -> int:
    if not (args.big_files or args.small_files or args.small_tree):
        raise SystemExit("ckptfs: bench: nothing to measure: --big-files, --small-files "
                         "and --small-tree are all 0")
    summary = Bench(args).run()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    return 0
