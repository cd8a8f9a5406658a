"""Real ckptfs mounts started through the CLI exactly as a user would, the stores they
use, and waiting for another mount to catch up.

Knows ckptfs only through its command line, its status document (over the control
socket, with ckptfs's client API) and its stats xattr.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ckptfs.bench.seaweed import SeaweedServer
from ckptfs.cli.api import request

from support.proxy import FaultProxy

BUCKET = "ckptfs-test"

T = TypeVar("T")


def eventually(predicate: Callable[[], T], timeout: float = 15.0) -> T:
    """Poll for a state another mount must reach within its metadata TTL: a correctness
    wait with a generous deadline, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def run_ckptfs(*args: str, env: dict | None = None, timeout: float = 120,
               check: bool = False, preexec_fn: Callable[[], Any] | None = None
               ) -> subprocess.CompletedProcess:
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


def one_line_failure(proc: subprocess.CompletedProcess, prefix: str = "") -> str:
    """The one line a failed ``ckptfs`` command printed (no traceback), which starts
    with ``prefix``."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


@dataclass
class StoreSpec:
    kind: str
    url: str
    env: dict = field(default_factory=dict)
    root: Path | None = None     # LocalStore directory
    seaweed: SeaweedServer | None = None
    proxy: FaultProxy | None = None   # the fault proxy its endpoint goes through


class Mount:
    """One ckptfs daemon: its mount point and its own node-local state."""

    def __init__(self, base: Path, store: StoreSpec, name: str = "node") -> None:
        self.store = store
        self.path = base / f"{name}-mnt"
        self.state_dir = base / f"{name}-state"
        self.path.mkdir(parents=True, exist_ok=True)
        self.pid: int | None = None

    def start(self, *extra: str, durability: str = "sync", faults: dict | None = None,
              env: dict | None = None, preexec_fn: Callable[[], Any] | None = None) -> None:
        full_env = dict(self.store.env)
        full_env.update(env or {})
        if faults is not None:
            full_env["CKPTFS_FAULTS"] = json.dumps(faults)
        proc = run_ckptfs("mount", str(self.path), "--store", self.store.url, "--state-dir",
                          str(self.state_dir), "--durability", durability, *extra,
                          env=full_env, check=True, preexec_fn=preexec_fn)
        # "ckptfs: mounted URL on PATH (pid N, log FILE)": no `ckptfs status` process to
        # start (test_status checks that status names the same pid).
        found = re.search(r"\(pid (\d+), log ", proc.stdout)
        assert found, f"ckptfs mount did not name the daemon's pid: {proc.stdout!r}"
        self.pid = int(found.group(1))

    def status(self) -> dict:
        """The daemon's status document: what ``ckptfs status --json`` prints, asked over
        the control socket from this process (polled often: a ``ckptfs`` process per
        call cost a second or more on a loaded machine; test_status runs the command)."""
        replies = list(request(self.path, {"cmd": "status"}, timeout=60))
        assert len(replies) == 1 and not replies[0].get("error"), replies
        return replies[0]

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


def fresh(make_mount: Callable[..., Mount], store: StoreSpec, name: str | None = None,
          **start_kwargs: Any) -> Mount:
    """Another node: a mount of its own (new node-local state) on the same store."""
    return make_mount(store, name=name or f"fresh{os.urandom(3).hex()}", **start_kwargs)
