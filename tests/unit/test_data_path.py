"""The data path a mount reports (fuse/datapath.py): kernel passthrough only where the
setting, writeback cache, the pyfuse3 build, CAP_SYS_ADMIN and the kernel's grant allow,
else the daemon with the reason."""

from __future__ import annotations

from types import SimpleNamespace

from ckptfs.fuse.datapath import DataPath, has_cap_sys_admin


def _library(supported=True, granted=True, error=None):
    return SimpleNamespace(PASSTHROUGH_SUPPORTED=supported,
                           passthrough_enabled=lambda: granted,
                           passthrough_error=lambda: error)


def test_everything_allows_it():
    path = DataPath(_library(), "auto", False, True)
    assert path.wanted and path.available()
    assert path.describe() == {"path": "kernel passthrough", "reason": None}


def test_each_missing_piece_says_why_the_daemon_serves():
    cases = [
        (DataPath(_library(), "off", False, True), "passthrough = off"),
        (DataPath(_library(), "auto", True, True), "writeback_cache"),
        (DataPath(_library(), "auto", False, True, sync=True), "sync mode"),
        (DataPath(SimpleNamespace(), "auto", False, True), "built without passthrough"),
        (DataPath(_library(), "auto", False, False), "CAP_SYS_ADMIN"),
        (DataPath(_library(granted=False), "auto", False, True), "did not offer"),
        (DataPath(_library(error=OSError(1, "Operation not permitted")), "auto", False,
                  True), "registering a backing file failed"),
    ]
    for path, reason in cases:
        doc = path.describe()
        assert doc["path"] == "daemon" and reason in doc["reason"], doc
        assert not path.available()


def test_cap_sys_admin_is_read_from_the_effective_set(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000200000\n")
    assert has_cap_sys_admin(status)
    status.write_text("Name:\tx\nCapEff:\t00000000001fffff\n")
    assert not has_cap_sys_admin(status)
