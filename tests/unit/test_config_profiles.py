"""Settings precedence and checkpoint profiles."""

import json

import pytest

from ckptfs.node.config import ConfigError, load
from ckptfs.format.profiles import Profiles


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('store = "file:///s"\ndurability = "async"\nchunk_size = "4M"\n'
                 'metadata_ttl = 3\n')
    s = load(f, {"CKPTFS_METADATA_TTL": "2"}, {"chunk_size": "16M", "durability": None})
    assert (s.store, s.durability, s.chunk_size, s.metadata_ttl) == \
        ("file:///s", "async", 16 << 20, 2.0)


@pytest.mark.parametrize("text,message", [
    ("bogus = 1", "unknown key"), ('durability = "fast"', "durability"),
    ('chunk_size = "lots"', "not a size"), ("[[profiles]]\nmarks = []", "pattern"),
    ("store = ", "config file"), ('chunk_size = "65M"', "at most 64 MiB"),
    ('gc_settle = -1', "non-negative"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, message):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(f, {}, {})


def test_unknown_env_variable_refused(tmp_path):
    with pytest.raises(ConfigError, match="CKPTFS_NOPE"):
        load(None, {"CKPTFS_NOPE": "1"}, {})


def test_default_profiles():
    p = Profiles()
    for staged in (b"checkpoint-10", b"checkpoint_3", b"global_step100", b"iter_0000100",
                   b"x.orbax-checkpoint-tmp"):
        assert p.staged_on_create(staged)
    for plain in (b"tmp-checkpoint-10", b"output", b"iter_100", b"logs"):
        assert not p.staged_on_create(plain)
    assert p.is_mark_for(b"checkpoint-10", b"trainer_state.json")
    assert not p.is_mark_for(b"checkpoint-10", b"model.safetensors")
    assert p.is_mark_for(b"x.orbax-checkpoint-tmp", b"commit_success.txt")
    assert b"global_step7" in p.pointed_names(b"latest", b"global_step7\n")
    assert b"iter_0000100" in p.pointed_names(b"latest_checkpointed_iteration.txt", b"100")
    assert p.pointed_names(b"notes.txt", b"global_step7") == []
    assert p.pointed_names(b"latest", b"../etc") == []


def ray_snapshot(names: list[str], latest: str, pad_metrics: int = 0) -> bytes:
    """The shape Ray Train 2.60 writes to <run>/checkpoint_manager_snapshot.json."""
    def result(name):
        return {"version": 0, "checkpoint_dir_name": name,
                "metrics": {"epoch": 1, "notes": "x" * pad_metrics}}
    return json.dumps({"ray_version": "2.60.0",
                       "checkpoint_results": [result(n) for n in names],
                       "checkpoint_report_indices": list(range(len(names))),
                       "latest_checkpoint_result": result(latest),
                       "pending_training_results": [], "pending_validation_specs": [],
                       "current_report_index": len(names),
                       "validated_checkpoint_dir_names": [],
                       "timed_out_validation_checkpoint_dir_names": [],
                       "failed_validation_checkpoint_dir_names": []}).encode()


def test_ray_snapshot_pointer_names_every_kept_checkpoint():
    p = Profiles()
    snap = b"checkpoint_manager_snapshot.json"
    names = [f"checkpoint_2026-11-30_21-29-{s:02d}.000000" for s in range(40)]
    body = ray_snapshot(names, names[-1], pad_metrics=200)
    assert len(body) > 4096                  # many checkpoints, rich metrics: > 4 KiB
    assert p.is_pointer(snap)
    assert p.pointer_size_limit(snap) >= len(body)
    got = p.pointed_names(snap, body)
    assert sorted(set(got)) == sorted(n.encode() for n in names)
    # A name Ray was given (report(checkpoint_dir_name=...)) is named as it is.
    assert p.pointed_names(snap, ray_snapshot(["epoch_3"], "epoch_3")) == [b"epoch_3"]


@pytest.mark.parametrize("body", [
    b"", b"{not json", b"[]", b'"checkpoint_1"', b"[" * 100000 + b"]" * 100000,
    json.dumps({"checkpoint_results": [{"checkpoint_dir_name": "../escape"},
                                       {"checkpoint_dir_name": "a/b"},
                                       {"checkpoint_dir_name": 7},
                                       {"checkpoint_dir_name": ".."}]}).encode(),
])
def test_ray_snapshot_pointer_ignores_garbage(body):
    assert Profiles().pointed_names(b"checkpoint_manager_snapshot.json", body) == []


def test_text_pointers_keep_their_small_limit():
    p = Profiles()
    assert p.pointer_size_limit(b"latest") == 4096
    assert p.pointer_size_limit(b"model.pt") == 0
    assert p.pointed_names(b"latest", b"global_step7" + b" " * 5000) == []


def test_extra_profile_with_a_ray_snapshot_pointer_and_bad_kind(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[[extra_profiles]]\nname = "my-ray"\npattern = "ckpt_*"\n'
                 'pointers = ["run_state.json"]\npointer_kind = "ray-snapshot"\n')
    s = load(f, {}, {})
    assert s.profiles.staged_on_create(b"ckpt_1") and s.profiles.staged_on_create(b"checkpoint_1")
    assert s.profiles.pointed_names(b"run_state.json", ray_snapshot(["ckpt_1"], "ckpt_1")) \
        == [b"ckpt_1"]
    f.write_text('[[extra_profiles]]\npattern = "ckpt_*"\npointer_kind = "yaml"\n')
    with pytest.raises(ConfigError, match="pointer_kind"):
        load(f, {}, {})


def test_stale_staged_after_setting(tmp_path):
    assert load(None, {}, {}).stale_staged_after == 600.0
    f = tmp_path / "c.toml"
    f.write_text("stale_staged_after = 120\n")
    assert load(f, {}, {}).stale_staged_after == 120.0
    assert load(f, {"CKPTFS_STALE_STAGED_AFTER": "30"}, {}).stale_staged_after == 30.0
    assert load(f, {"CKPTFS_STALE_STAGED_AFTER": "30"},
                {"stale_staged_after": "0.5"}).stale_staged_after == 0.5
    with pytest.raises(ConfigError, match="stale_staged_after"):
        load(None, {"CKPTFS_STALE_STAGED_AFTER": "soon"}, {})


# ---------------------------------------------------------------- numbers are validated


@pytest.mark.parametrize("key,value", [
    ("metadata_ttl", "nan"), ("metadata_ttl", "inf"), ("metadata_ttl", "-1"),
    ("gc_grace", "nan"), ("gc_grace", "-inf"), ("gc_grace", "1e400"),
    ("store_timeout", "nan"), ("store_timeout", "inf"), ("store_timeout", "0"),
    ("store_timeout", "-5"), ("store_timeout", "0.1"), ("store_timeout", "1e9"),
    ("stop_timeout", "nan"), ("stop_timeout", "-1"), ("stop_timeout", "inf"),
    ("chunk_size", "1"), ("chunk_size", "3M"), ("chunk_size", "32k"), ("chunk_size", "96k"), ("chunk_size", "128M"),
    ("chunk_size", "inf"), ("chunk_size", "nan"), ("chunk_size", "-8M"), ("chunk_size", "0"),
    ("cache_size", "inf"), ("cache_size", "nan"), ("cache_size", "1"),
    ("upload_concurrency", "0"), ("upload_concurrency", "1.5"), ("upload_concurrency", "100000"),
    ("fetch_concurrency", "nan"), ("fetch_concurrency", "-3"),
])
def test_bad_numbers_refused_from_every_source(tmp_path, key, value):
    f = tmp_path / "c.toml"
    f.write_text(f'{key} = "{value}"\n')
    with pytest.raises(ConfigError, match=key):
        load(f, {}, {})
    with pytest.raises(ConfigError, match=key):
        load(None, {f"CKPTFS_{key.upper()}": value}, {})
    with pytest.raises(ConfigError, match=key):
        load(None, {}, {key: value})


def test_toml_native_floats_checked_too(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("metadata_ttl = nan\n")
    with pytest.raises(ConfigError, match="finite"):
        load(f, {}, {})
    f.write_text("store_timeout = inf\n")
    with pytest.raises(ConfigError, match="finite"):
        load(f, {}, {})
    f.write_text("chunk_size = 1\n")
    with pytest.raises(ConfigError, match="at least 64 KiB and at most 64 MiB"):
        load(f, {}, {})
    f.write_text("chunk_size = 3145728\n")
    with pytest.raises(ConfigError, match="power of two"):
        load(f, {}, {})
    f.write_text("single_writer = 3\n")
    with pytest.raises(ConfigError, match="boolean"):
        load(f, {}, {})


@pytest.mark.parametrize("key,value,expected", [
    ("chunk_size", "1M", 1 << 20), ("chunk_size", "64K", 64 << 10), ("chunk_size", "64M", 64 << 20), ("chunk_size", 8 << 20, 8 << 20),
    ("metadata_ttl", "0", 0.0), ("metadata_ttl", "0.2", 0.2),
    ("store_timeout", "5", 5.0), ("store_timeout", 60, 60.0),
    ("stop_timeout", "0", 0.0), ("stop_timeout", "600", 600.0),
    ("cache_size", "16M", 16 << 20), ("gc_grace", "0", 0.0),
])
def test_sane_numbers_accepted(key, value, expected):
    assert getattr(load(None, {}, {key: value}), key) == expected


def test_timeouts_default():
    s = load(None, {}, {})
    assert (s.store_timeout, s.stop_timeout) == (60.0, 600.0)
