"""A pytest plugin for users' integration tests: real ckptfs mounts over a temporary local
store, started and stopped as a user would (``ckptfs mount`` / ``ckptfs umount``).

Registered through the ``pytest11`` entry point when ckptfs is installed (or with
``-p ckptfs.testing``).  Fixtures::

    def test_save_and_load(ckptfs_mount):               # a pathlib.Path, mounted
        (ckptfs_mount / "model.bin").write_bytes(b"weights")
        assert (ckptfs_mount / "model.bin").read_bytes() == b"weights"

    @pytest.mark.ckptfs(durability="async")             # settings for this test's mounts
    def test_two_nodes(ckptfs_mount, ckptfs_mount_factory):
        other = ckptfs_mount_factory()                  # a second node, same store
        ...

``ckptfs_mount_factory(durability=None, **settings)`` mounts one more node over the
test's store (``ckptfs_store``, a ``file://`` URL in ``tmp_path``) and returns its mount
point; ``ckptfs_mount`` is the first such node.  Settings are the ``ckptfs mount``
settings by name (``chunk_size="1M"``, ``single_writer=True``, ...); the marker's are
the defaults, a factory call's win.  The mounts are hermetic: no /etc/ckptfs config file,
no ``CKPTFS_*`` variables of the caller, ``metadata_ttl`` 0 unless given (a node sees
the other's published files at once).  Afterwards each mount is unmounted (``ckptfs
umount`` with a timeout; a daemon that does not stop is killed and its mount lazily
detached), so that no mount outlives its test.

Where FUSE cannot be used — no /dev/fuse, no permission on it, no ``fusermount3`` for
an ordinary user, root without CAP_SYS_ADMIN — the tests that ask for a mount are
skipped with the reason (the daemon's own preflight checks); ``--ckptfs-require-fuse``
makes that an error instead (for CI, where a skip would hide a broken runner).

Knows the ``ckptfs`` command line and the preflight checks; nothing of the daemon's
insides.  Imports nothing of ckptfs when pytest loads it (the project's own coverage
measurement starts later).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

MARKER = "ckptfs"
MOUNT_TIMEOUT = 60.0          # s for ``ckptfs mount`` to report mounted or failed
UMOUNT_TIMEOUT = 60.0         # s for ``ckptfs umount`` (pending uploads included)
TEST_DEFAULTS: dict[str, object] = {"metadata_ttl": "0"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckptfs")
    group.addoption("--ckptfs-require-fuse", action="store_true", default=False,
                    help="fail, not skip, tests that need a ckptfs mount where FUSE "
                         "cannot be used")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(durability='sync', **settings): settings of the test's "
        "ckptfs mounts (ckptfs_mount, ckptfs_mount_factory)")


def fuse_unusable() -> str | None:
    """Why this process cannot mount FUSE here (one line), or None."""
    from ckptfs.errors import MountError
    from ckptfs.node.preflight import check_fuse_device, check_may_mount
    try:
        check_fuse_device()
        check_may_mount()
    except MountError as exc:
        return str(exc)
    return None


def _flags(settings: dict[str, object]) -> list[str]:
    """``ckptfs mount`` flags for settings by name (True: a switch; False/None: unset)."""
    from ckptfs.node.config import BY_NAME
    out: list[str] = []
    for name, value in settings.items():
        if name not in BY_NAME or name in ("store", "state_dir"):
            raise pytest.UsageError(f"ckptfs mount setting {name!r} is not one this "
                                    f"fixture can set")
        flag = BY_NAME[name].flag
        if value is True and BY_NAME[name].kind == "switch":
            out.append(flag)
        elif isinstance(value, (list, tuple)):          # checkpoint_formats=("npy",)
            out += [flag, ",".join(map(str, value))]
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CKPTFS_")}


@dataclass
class Node:
    """One mounted node: its mount point, state dir and daemon log."""
    path: Path
    state_dir: Path

    @property
    def log(self) -> Path:
        return self.state_dir / "ckptfs.log"

    def daemon_pid(self) -> int | None:
        try:
            return int(json.loads((self.state_dir / "daemon.lock").read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass
class Mounts:
    """Mounts of one test over one store; ``unmount_all`` leaves none behind."""
    base: Path
    store_url: str
    defaults: dict[str, object]
    nodes: list[Node] = field(default_factory=list)

    def mount(self, durability: str | None = None, **settings: object) -> Path:
        index = len(self.nodes)
        node = Node(self.base / f"node{index}", self.base / f"node{index}-state")
        node.path.mkdir(parents=True)
        config = self.base / "empty.toml"          # not /etc/ckptfs/ckptfs.toml
        config.touch()
        merged = {**TEST_DEFAULTS, **self.defaults, **settings}
        if durability is not None:
            merged["durability"] = durability
        argv = [sys.executable, "-m", "ckptfs", "mount", str(node.path), "--store",
                self.store_url, "--state-dir", str(node.state_dir), "--config", str(config),
                *_flags(merged)]
        proc = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True,
                              timeout=MOUNT_TIMEOUT, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
            raise RuntimeError(f"ckptfs mount of node {index} failed: {lines[-1]} "
                               f"(log {node.log})")
        self.nodes.append(node)
        return node.path

    def unmount_all(self) -> list[str]:
        """Unmount every node (newest first); the problems met, one line each."""
        problems = []
        for node in reversed(self.nodes):
            problem = _unmount(node)
            if problem:
                problems.append(problem)
        self.nodes.clear()
        return problems


def _unmount(node: Node) -> str | None:
    if not os.path.ismount(node.path):
        return None
    pid = node.daemon_pid()
    problem = None
    try:
        proc = subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(node.path),
                               "--timeout", str(UMOUNT_TIMEOUT / 2)],
                              env=_clean_env(), capture_output=True, text=True,
                              timeout=UMOUNT_TIMEOUT, stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or os.path.ismount(node.path):
            problem = (f"ckptfs umount {node.path} failed: "
                       f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    except subprocess.TimeoutExpired:
        problem = f"ckptfs umount {node.path} did not finish in {UMOUNT_TIMEOUT:g} s"
    if problem is not None:
        _force_unmount(node, pid)
    elif pid is not None:
        _wait_gone(pid, 10.0)
    return problem


def _force_unmount(node: Node, pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _wait_gone(pid, 10.0)
    for cmd in (["fusermount3", "-u", "-z", str(node.path)], ["umount", "-l", str(node.path)]):
        if not os.path.ismount(node.path):
            break
        try:
            subprocess.run(cmd, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.05)


@pytest.fixture
def ckptfs_store(tmp_path: Path) -> str:
    """The test's store: a ``file://`` URL of an empty directory in ``tmp_path``."""
    root = tmp_path / "ckptfs-store"
    root.mkdir()
    return f"file://{root}"


@pytest.fixture
def ckptfs_mount_factory(request: pytest.FixtureRequest, tmp_path: Path,
                         ckptfs_store: str) -> Iterator[Callable[..., Path]]:
    """``factory(durability=None, **settings) -> Path``: one more node over the test's
    store, mounted; all unmounted after the test.  Skips where FUSE cannot be used."""
    reason = fuse_unusable()
    if reason is not None:
        if request.config.getoption("--ckptfs-require-fuse"):
            pytest.fail(f"ckptfs: FUSE cannot be used here: {reason}", pytrace=False)
        pytest.skip(f"ckptfs: FUSE cannot be used here: {reason}")
    marker = request.node.get_closest_marker(MARKER)
    defaults: dict[str, Any] = {}
    if marker is not None:
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{MARKER} takes settings by name "
                                    f"(durability='async', ...), not {marker.args!r}")
        defaults = dict(marker.kwargs)
    mounts = Mounts(tmp_path / "ckptfs", ckptfs_store, defaults)
    try:
        yield mounts.mount
    finally:
        problems = mounts.unmount_all()
    if problems:
        pytest.fail("ckptfs: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def ckptfs_mount(ckptfs_mount_factory: Callable[..., Path]) -> Path:
    """A mounted ckptfs directory over the test's temporary store (the first node)."""
    return ckptfs_mount_factory()
