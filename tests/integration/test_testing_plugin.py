"""The pytest plugin for users' integration tests (ckptfs.testing, issue 25 item 2): a
user's test file run in an inner pytest session (pytester) gets a real mount through
``ckptfs_mount``, a second node over the same store through ``ckptfs_mount_factory``,
settings from ``@pytest.mark.ckptfs``; nothing stays mounted afterwards; where FUSE
cannot be used the tests are skipped with the reason, or fail with
``--ckptfs-require-fuse``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The inner sessions load the plugin as an installed ckptfs would (the entry point is
# named like the module: with it installed, this loads it once).
PLUGIN = ("-p", "ckptfs.testing", "-p", "no:cacheprovider")

USERS_TESTS = '''
import json
import os
import subprocess
import sys

import ckptfs
import pytest


def test_save_and_load(ckptfs_mount):
    path = ckptfs_mount / "run" / "model.bin"
    path.parent.mkdir()
    path.write_bytes(b"weights" * 1000)
    ckptfs.wait(path)                       # durable in the store
    assert path.read_bytes() == b"weights" * 1000
    assert ckptfs.state(path) in ("published", "cached")
    assert os.path.ismount(ckptfs_mount)


@pytest.mark.ckptfs(durability="async", chunk_size="64K")
def test_two_nodes(ckptfs_mount, ckptfs_mount_factory):
    other = ckptfs_mount_factory()          # a second node over the same store
    assert other != ckptfs_mount and os.path.ismount(other)
    (ckptfs_mount / "a.bin").write_bytes(bytes(range(256)) * 1000)
    ckptfs.wait(ckptfs_mount / "a.bin")
    assert (other / "a.bin").read_bytes() == bytes(range(256)) * 1000
    status = subprocess.run([sys.executable, "-m", "ckptfs", "status", "--json", str(other)],
                            capture_output=True, text=True, check=True)
    assert json.loads(status.stdout)["durability"] == "async"
'''


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(str(path))]


def _inner_env() -> dict[str, str]:
    """The inner session's environment: this checkout first on the path."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_users_tests_get_mounts_and_leave_none(pytester):
    pytester.makepyfile(test_users=USERS_TESTS)
    result = pytester.runpytest(*PLUGIN, "-v")
    result.assert_outcomes(passed=2)
    assert _mounts_under(pytester.path) == []


def test_a_broken_daemon_fails_the_mount_with_its_line(pytester):
    pytester.makepyfile(test_users='''
import pytest

@pytest.mark.ckptfs(chunk_size="3M")
def test_bad_setting(ckptfs_mount):
    pass
''')
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ckptfs mount of node 0 failed: ckptfs: --chunk-size: "
                                 "chunk_size: must be a power of two*"])
    assert _mounts_under(pytester.path) == []


NO_DEV_FUSE = ("mount -t tmpfs tmpfs /dev\n"
               "mknod -m 666 /dev/null c 1 3\nmknod -m 666 /dev/urandom c 1 9\n"
               'exec "$@"')


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare (util-linux) for a private mount "
                           "namespace without /dev/fuse")
@pytest.mark.parametrize("require", [False, True], ids=["skips", "require-fuse fails"])
def test_without_dev_fuse(pytester, require):
    # A container started without the device: the inner session runs in a mount
    # namespace of its own whose /dev has no fuse (never the host's /dev).
    pytester.makepyfile(test_users=USERS_TESTS)
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-ec", NO_DEV_FUSE, "sh",
            sys.executable, "-m", "pytest", *PLUGIN, "-rs", "-q",
            *(["--ckptfs-require-fuse"] if require else [])]
    proc = subprocess.run(argv, cwd=pytester.path, env=_inner_env(), capture_output=True,
                          text=True, timeout=120)
    reason = ("ckptfs: FUSE cannot be used here: no /dev/fuse: load the fuse module on the "
              "host, or give the container the device (--device /dev/fuse)")
    if require:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "2 errors" in proc.stdout and reason in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "2 skipped" in proc.stdout, proc.stdout
        skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
        assert len(skipped) == 2 and all(line.endswith(reason) for line in skipped), \
            proc.stdout
