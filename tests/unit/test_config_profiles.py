"""Settings precedence and checkpoint profiles."""

import pytest

from ckptfs.config import ConfigError, load
from ckptfs.profiles import Profiles


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
