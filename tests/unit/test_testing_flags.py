"""The pytest plugin (ckptfs.testing) passes a test's settings to ``ckptfs mount`` as the
table's flags; a name that is not a setting is a usage error naming it."""

from __future__ import annotations

import pytest

from ckptfs.testing import _flags


def test_settings_become_mount_flags():
    assert _flags({"durability": "async", "single_writer": True, "writeback_cache": False,
                   "checkpoint_formats": ("npy", "torch"), "max_staged": None}) == \
        ["--durability", "async", "--single-writer", "--checkpoint-formats", "npy,torch"]


@pytest.mark.parametrize("name", ["durabilty", "store", "state_dir"])
def test_a_name_the_fixture_cannot_set_is_a_usage_error(name):
    with pytest.raises(pytest.UsageError, match=repr(name)):
        _flags({name: "x"})
