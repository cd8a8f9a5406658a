"""fstab (issue 12 part 6): ``mount -t fuse.ckptfs STORE_URL MOUNTPOINT -o ...`` works
through the real mount(8) and mount.fuse3, which run ``ckptfs URL MOUNTPOINT -o ...``."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from support.mounts import Mount, run_ckptfs

pytestmark = pytest.mark.skipif(shutil.which("mount.fuse3") is None or os.geteuid() != 0,
                                reason="needs root and mount.fuse3 (fuse3)")


# mount(8) hands helpers a clean PATH: mount.fuse3 finds `ckptfs` where tools/setup.sh
# links it (/usr/local/sbin).  It runs this checkout: PYTHONPATH is passed on.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture
def helper_path():
    assert shutil.which("ckptfs", path=SAFE_PATH), "run tools/setup.sh: it links ckptfs " \
        "into /usr/local/sbin for mount.fuse3"
    return SAFE_PATH


def test_mount_t_fuse_ckptfs(local_store, tmp_path, helper_path):
    mnt = Mount(tmp_path, local_store, name="fstab")
    env = dict(os.environ, PATH=helper_path)
    options = (f"_netdev,rw,state_dir={mnt.state_dir},durability=async,"
               f"metadata-ttl=5,x-systemd.requires=network-online.target")
    try:
        proc = subprocess.run(["mount", "-t", "fuse.ckptfs", local_store.url, str(mnt.path),
                               "-o", options], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert os.path.ismount(mnt.path)
        status = mnt.status()
        mnt.pid = status["pid"]
        assert status["durability"] == "async" and status["store"] == local_store.url
        assert (mnt.state_dir / "meta.lmdb").exists()
        (mnt.path / "f").write_bytes(b"via fstab")
        run_ckptfs("wait", str(mnt.path), check=True)
        mnt.stop()
        assert not os.path.ismount(mnt.path)
        assert b"via fstab" in b"".join(p.read_bytes() for p in local_store.root.rglob("*")
                                         if p.is_file() and "chunks" in p.parts)
    finally:
        mnt.cleanup()


def test_unknown_option_is_one_line(local_store, tmp_path, helper_path):
    mnt = tmp_path / "m"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "fuse.ckptfs", local_store.url, str(mnt),
                           "-o", "durabilty=async"], env=dict(os.environ, PATH=helper_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "ckptfs: unknown mount option 'durabilty=async'" in proc.stderr, proc.stderr
    assert not os.path.ismount(mnt)
