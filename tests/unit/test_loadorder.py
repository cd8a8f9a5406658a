"""Load order (format/loadorder.py): the order checkpoint loaders read shards in."""

from __future__ import annotations

from ckptfs.format.loadorder import following, natural_key


def test_digit_runs_compare_as_numbers():
    names = [b"__10_0.distcp", b"__2_0.distcp", b"__9_1.distcp", b"__9_0.distcp"]
    assert sorted(names, key=natural_key) == \
        [b"__2_0.distcp", b"__9_0.distcp", b"__9_1.distcp", b"__10_0.distcp"]


def test_safetensors_shards_and_names_without_digits_keep_name_order():
    names = [b"model-00002-of-00003.safetensors", b"config.json",
             b"model-00001-of-00003.safetensors", b"model.safetensors.index.json",
             b".metadata", b"model-00003-of-00003.safetensors"]
    assert following(names, b"model-00001-of-00003.safetensors") == \
        [b"model-00002-of-00003.safetensors", b"model-00003-of-00003.safetensors",
         b"model.safetensors.index.json"]
    assert following(names, b".metadata")[0] == b"config.json"


def test_the_order_is_total():
    # Same numbers spelled differently still sort, and never compare equal.
    names = [b"a01", b"a1", b"a001"]
    assert len({natural_key(n) for n in names}) == 3
    assert following(names, b"a1") == sorted(set(names) - {b"a1"} - {
        n for n in names if natural_key(n) < natural_key(b"a1")}, key=natural_key)
