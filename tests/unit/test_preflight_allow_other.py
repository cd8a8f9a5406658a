"""allow_other (issue 25): fusermount3's reading of /etc/fuse.conf, the setting's
spellings, and FUSE's bare ``allow_other`` in fstab."""

from __future__ import annotations

import pytest

from ckptfs.cli.commands import build_parser
from ckptfs.node.config import SETTINGS, ConfigError, load
from ckptfs.node.fstab import mount_argv
from ckptfs.node.preflight import resolve_allow_other, user_allow_other


@pytest.mark.parametrize("text, allowed", [
    ("user_allow_other\n", True), ("  user_allow_other  # users may\n", True),
    ("#user_allow_other\n", False), ("mount_max = 1000\n", False),
    ("user_allow_other_not\n", False), ("", False)])
def test_user_allow_other_is_read_as_fusermount3_reads_it(tmp_path, text, allowed):
    conf = tmp_path / "fuse.conf"
    conf.write_text(text)
    assert user_allow_other(str(conf)) is allowed


def test_no_fuse_conf_is_no_user_allow_other(tmp_path):
    assert user_allow_other(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("ON", "on"), ("off", "off"),
                                         ("true", "on"), ("0", "off")])
def test_allow_other_spellings(text, value):
    assert load(None, {"CKPTFS_ALLOW_OTHER": text}, {}).allow_other == value


def test_allow_other_bad_value_is_one_line():
    with pytest.raises(ConfigError, match="allow_other must be 'auto', 'on' or 'off'"):
        load(None, {"CKPTFS_ALLOW_OTHER": "sometimes"}, {})


def test_off_is_off_even_for_root(tmp_path):
    allowed, line = resolve_allow_other("off", str(tmp_path / "fuse.conf"))
    assert not allowed and line.startswith("allow_other off: only uid")


@pytest.mark.parametrize("option, value", [("allow_other", "on"),
                                           ("allow_other=off", "off"),
                                           ("allow-other=auto", "auto")])
def test_fstab_allow_other(option, value):
    argv = mount_argv(["file:///s", "/mnt", "-o", f"_netdev,default_permissions,{option}"])
    args = build_parser().parse_args(argv)
    flags = {s.name: getattr(args, s.name) for s in SETTINGS}
    assert load(None, {}, flags).allow_other == value
