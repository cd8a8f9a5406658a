"""One settings table: every row is a TOML key, a CKPTFS_* variable and a `ckptfs mount`
flag, with one parser and one default; the core's Config keeps the table's defaults."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from ckptfs.cli.commands import build_parser
from ckptfs.cluster.retention import Rule
from ckptfs.node.config import SETTINGS, Settings, load
from ckptfs.core import Config
from ckptfs.node.fstab import mount_argv

# A valid text for each setting (what a user would type), and what it becomes.
EXAMPLES = {
    "store": ("file:///s", "file:///s"), "endpoint_url": ("http://e", "http://e"),
    "state_dir": ("/var/x", "/var/x"), "durability": ("async", "async"),
    "single_writer": ("true", True), "chunk_size": ("1M", 1 << 20),
    "cache_size": ("16M", 16 << 20), "metadata_ttl": ("2.5", 2.5),
    "upload_concurrency": ("3", 3), "fetch_concurrency": ("5", 5),
    "gc_grace": ("7", 7.0), "gc_settle": ("9", 9.0), "writeback_cache": ("1", True),
    "checkpoint_formats": ("npy", ("npy",)), "lease_ttl": ("12", 12.0),
    "stale_staged_after": ("33", 33.0), "store_timeout": ("5", 5.0),
    "stop_timeout": ("0", 0.0), "max_staged": ("16M", 16 << 20),
    "metrics_address": ("127.0.0.1:9464", "127.0.0.1:9464"),
    "s3_client": ("boto3", "boto3"), "upload_hold": ("2.5", 2.5),
    "allow_other": ("off", "off"),
    "passthrough": ("off", "off"),
    "peer_listen": ("10.0.0.5:7601", "10.0.0.5:7601"),
    "peer_advertise": ("node5:7601", "node5:7601"), "peer_timeout": ("3", 3.0),
    "peer_fanout": ("2", 2),
    "chunk_hash": ("sha256", "sha256"),
}


def test_every_setting_has_an_example():
    assert set(EXAMPLES) == {s.name for s in SETTINGS}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_each_setting_comes_from_file_variable_and_flag(tmp_path, setting):
    text, value = EXAMPLES[setting.name]
    f = tmp_path / "c.toml"
    f.write_text(f"{setting.toml_key} = {text!r}\n".replace("'", '"'))
    assert getattr(load(f, {}, {}), setting.name) == value
    assert getattr(load(None, {setting.env: text}, {}), setting.name) == value
    argv = ["mount", "/mnt"] + ([setting.flag] if setting.kind == "switch"
                                else [setting.flag, text])
    args = build_parser().parse_args(argv)
    flags = {s.name: getattr(args, s.name) for s in SETTINGS}
    assert getattr(load(None, {}, flags), setting.name) == value
    assert getattr(load(None, {}, {}), setting.name) == setting.default


def test_the_mount_flags_are_the_table_and_a_few_of_the_command_s_own():
    mount = next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
                 if a[0] == "mount")[1]
    flags = {o for a in mount._actions for o in a.option_strings if o.startswith("--")}
    own = {"--help", "--config", "--foreground", "--log-file", "--ready-fd"}
    assert flags - own == {s.flag for s in SETTINGS}


def test_settings_fields_are_the_table_plus_profiles_and_retention():
    assert [f.name for f in dataclasses.fields(Settings)] == \
        [s.name for s in SETTINGS] + ["profiles", "retention"]


def test_settings_fields_have_the_table_s_types_and_defaults():
    # Settings is written out for the type checker (issue 22): its fields must not drift
    # from the rows.
    hints = typing.get_type_hints(Settings, localns={"Rule": Rule})
    defaults = Settings()
    for s in SETTINGS:
        assert hints[s.name] == s.type, s.name
        assert getattr(defaults, s.name) == s.default, s.name


def test_the_core_config_keeps_the_table_s_defaults():
    shared = [f for f in dataclasses.fields(Config) if f.name in {s.name for s in SETTINGS}]
    assert len(shared) >= 14
    defaults = Config()
    for f in shared:
        assert getattr(defaults, f.name) == next(s.default for s in SETTINGS
                                                 if s.name == f.name), f.name


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_each_setting_is_also_an_fstab_option(setting):
    # `max_staged` was missing from the fstab options until upload_hold came (issue 13).
    text, value = EXAMPLES[setting.name]
    option = setting.name if setting.kind == "switch" else f"{setting.name}={text}"
    argv = mount_argv(["s3://bucket/prefix", "/mnt", "-o", f"_netdev,{option}"])
    args = build_parser().parse_args(argv)
    flags = {s.name: getattr(args, s.name) for s in SETTINGS}
    assert getattr(load(None, {}, flags), setting.name) == value
