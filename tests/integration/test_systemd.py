"""The systemd unit (issue 12 part 7): it passes ``systemd-analyze verify``, and the
daemon keeps the ``Type=notify`` contract: ``READY=1`` once mounted, ``STOPPING=1`` on
SIGTERM, exit well within ``TimeoutStopSec`` — checked under a fake ``NOTIFY_SOCKET``
(a datagram socket this test binds)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "ckptfs@.service"


def stop_timeout_of_unit() -> float:
    value = re.search(r"^TimeoutStopSec=(\d+)(min|s)?$", UNIT.read_text(), re.M)
    assert value, "the unit sets TimeoutStopSec"
    return int(value.group(1)) * (60 if value.group(2) == "min" else 1)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # An instance of the template, with ExecStart pointing at the ckptfs installed here
    # (the unit names /opt/ckptfs, the documented install path); the rest verbatim.
    installed = Path(sys.executable).parent / "ckptfs"
    assert installed.exists()
    text = UNIT.read_text().replace("/opt/ckptfs/.venv/bin/ckptfs", str(installed))
    unit = tmp_path / "ckptfs@mnt-ckpt.service"
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ckptfs@mnt-ckpt.service" not in proc.stderr, proc.stderr


def receive(sock: socket.socket, want: str, timeout: float = 60) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            got += sock.recv(4096).decode().splitlines()
        except TimeoutError:
            break
        if want in got:
            break
    return got


def test_notify_ready_stopping_and_stop_in_time(local_store, tmp_path):
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    env = dict(os.environ, NOTIFY_SOCKET=str(notify))
    log = open(tmp_path / "daemon.out", "wb")
    # As the unit runs it: the main process, in the foreground.
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount", str(mnt), "--store",
                             local_store.url, "--state-dir", str(state), "--foreground",
                             "--durability", "async"], env=env, stdout=log, stderr=log)
    try:
        got = receive(sock, "READY=1")
        assert "READY=1" in got, (got, (tmp_path / "daemon.out").read_text())
        assert os.path.ismount(mnt)                 # ready means mounted
        (mnt / "f").write_bytes(b"x" * 100_000)     # a pending upload to finish on stop
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        got = receive(sock, "STOPPING=1")
        assert "STOPPING=1" in got, got
        proc.wait(timeout=stop_timeout_of_unit())
        elapsed = time.monotonic() - started
        print(f"SIGTERM to exit: {elapsed:.1f} s (TimeoutStopSec {stop_timeout_of_unit()} s)")
        assert proc.returncode == 0, (tmp_path / "daemon.out").read_text()
        assert not os.path.ismount(mnt)
        text = (tmp_path / "daemon.out").read_text()
        assert "unmounted" in text and "Traceback" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        sock.close()
        log.close()
