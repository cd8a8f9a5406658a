"""Shared fixtures: a real SeaweedFS S3 server on loopback, and real ckptfs mounts
started through the CLI exactly as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from ckptfs.data.cache import ChunkCache
from ckptfs.core import Config, Filesystem
from ckptfs.meta.namespace import Namespace
from ckptfs.procstat import Opener
from ckptfs.bench.seaweed import SeaweedServer
from ckptfs.data.staging import Staging
from ckptfs.store import MemoryStore
from proxy import FaultProxy

# Every integration test fails on an unexpected ERROR or Traceback in a daemon log.
pytest_plugins = ["logcheck"]

BUCKET = "ckptfs-test"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


def eventually(predicate, timeout: float = 15.0):
    """Poll for a state another mount must reach within its metadata TTL: a correctness
    wait with a generous deadline, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def run_ckptfs(*args: str, env: dict | None = None, timeout: float = 120,
               check: bool = False, preexec_fn=None) -> subprocess.CompletedProcess:
    """``preexec_fn`` runs in the child before ``ckptfs`` starts (e.g. a lower
    ``RLIMIT_NOFILE``, which the daemon ``mount`` forks inherits)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "ckptfs", *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptfs {' '.join(args)} failed ({proc.returncode}): "
                             f"{proc.stderr}")
    return proc


@dataclass
class StoreSpec:
    kind: str
    url: str
    env: dict = field(default_factory=dict)
    root: Path | None = None     # LocalStore directory
    seaweed: SeaweedServer | None = None
    proxy: FaultProxy | None = None   # the fault proxy its endpoint goes through


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> StoreSpec:
    """A fresh, empty store: a LocalStore directory or a prefix in the SeaweedFS bucket."""
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        return StoreSpec("local", f"file://{root}", root=root)
    server = request.getfixturevalue("seaweed")
    return StoreSpec("s3", f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", env=server.env(),
                     seaweed=server)


@pytest.fixture
def local_store(tmp_path) -> StoreSpec:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    return StoreSpec("local", f"file://{root}", root=root)


@pytest.fixture
def s3_store(seaweed) -> StoreSpec:
    return StoreSpec("s3", f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", env=seaweed.env(),
                     seaweed=seaweed)


@pytest.fixture
def store_proxy(s3_store):
    """The same store as ``s3_store``, reached through a fault-injecting TCP proxy:
    ``store_proxy.proxy.mode = "hang"`` (pass/refuse/hang/503/reset/slow) while a
    daemon runs.  ``s3_store`` in the same test is the direct way to the same prefix."""
    proxy = FaultProxy(s3_store.seaweed.s3_port)
    env = dict(s3_store.env)
    env["AWS_ENDPOINT_URL"] = proxy.endpoint_url
    yield StoreSpec("s3", s3_store.url, env=env, seaweed=s3_store.seaweed, proxy=proxy)
    proxy.close()


class Mount:
    """One ckptfs daemon: its mount point and its own node-local state."""

    def __init__(self, base: Path, store: StoreSpec, name: str = "node") -> None:
        self.store = store
        self.path = base / f"{name}-mnt"
        self.state_dir = base / f"{name}-state"
        self.path.mkdir(parents=True, exist_ok=True)
        self.pid: int | None = None

    def start(self, *extra: str, durability: str = "sync", faults: dict | None = None,
              env: dict | None = None, preexec_fn=None) -> None:
        full_env = dict(self.store.env)
        full_env.update(env or {})
        if faults is not None:
            full_env["CKPTFS_FAULTS"] = json.dumps(faults)
        run_ckptfs("mount", str(self.path), "--store", self.store.url, "--state-dir",
                   str(self.state_dir), "--durability", durability, *extra, env=full_env,
                   check=True, preexec_fn=preexec_fn)
        self.pid = self.status()["pid"]

    def status(self) -> dict:
        proc = run_ckptfs("status", "--json", str(self.path), check=True)
        return json.loads(proc.stdout)

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.path, "user.ckptfs.stats"))

    def store_stats(self) -> dict:
        return self.status()["store_stats"]

    def stop(self) -> None:
        run_ckptfs("umount", str(self.path), check=True)
        self._wait_exit()

    def kill(self) -> None:
        """SIGKILL the daemon, as a crash would, and clear the dead mount."""
        assert self.pid
        os.kill(self.pid, signal.SIGKILL)
        self._wait_exit()
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                       capture_output=True)

    def _wait_exit(self, timeout: float = 60) -> None:
        if not self.pid:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            # reap if it is our child's child: it is not, so poll /proc
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        self.pid = None

    def cleanup(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                           capture_output=True)
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def make_mount(tmp_path):
    mounts: list[Mount] = []

    def factory(store: StoreSpec, name: str | None = None, **start_kwargs) -> Mount:
        mount = Mount(tmp_path, store, name or f"node{len(mounts)}")
        mounts.append(mount)
        extra = start_kwargs.pop("extra", ())
        mount.start(*extra, **start_kwargs)
        return mount

    yield factory
    for mount in mounts:
        mount.cleanup()


@pytest.fixture
def mnt(store, make_mount) -> Mount:
    return make_mount(store)


# --------------------------------------------------------------------------- the core, no FUSE
# A Filesystem over the in-memory store, as a pytest-trio fixture that owns its nursery
# (background publishing and the metadata log run in it).  Here, not in tests/unit/
# conftest.py: a second conftest module would shadow this one for `from conftest import`.

@dataclass
class Core:
    fs: Filesystem
    store: MemoryStore

    @staticmethod
    def me() -> Opener:
        return Opener.from_tid(os.getpid())

    async def save(self, parent: int, name: bytes, data: bytes) -> int:
        """create, write, close: like ``open(name, "wb").write(data)``."""
        handle, inode = await self.fs.create(parent, name, 0o644,
                                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0,
                                             self.me())
        await self.fs.write(handle.fh, 0, data)
        await self.fs.flush(handle.fh)
        await self.fs.release(handle.fh)
        return inode.ino


@pytest.fixture
def core_config() -> dict:
    """Config fields for the ``core`` fixture; a test overrides it to change them."""
    return {}


@pytest.fixture
async def core(tmp_path, core_config):
    store = MemoryStore(gate_limit=30)
    ns = Namespace(tmp_path / "meta")
    staging = Staging(tmp_path / "staging", tmp_path / "abandoned")
    cache = ChunkCache(tmp_path / "cache", store, 1 << 30, trio.CapacityLimiter(4))
    try:
        async with trio.open_nursery() as nursery:
            fs = Filesystem(ns, store, staging, cache, Config(**core_config), nursery)
            await nursery.start(fs.run)
            await fs.start()
            yield Core(fs, store)
            nursery.cancel_scope.cancel()
    finally:
        staging.close_all()
        ns.close()
