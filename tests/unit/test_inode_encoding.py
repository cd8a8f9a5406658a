"""An inode's LMDB record (``Inode.encode``/``decode``, decision 0030): written by
orjson, read back whole -- names that are not UTF-8 included, which orjson refuses (they
go through the json module) -- and records an older daemon wrote with the json module
read the same."""

from __future__ import annotations

import json

import pytest

from ckptfs.meta.namespace import ROOT_INO, Inode, Namespace

NAMES = [b"f00001.bin", "é名.safetensors".encode(), b"\xffnot-utf8", b"a\\b\"c\n"]


def inode_named(name: bytes) -> Inode:
    return Inode(ino=12, type="file", mode=0o644, uid=1000, gid=1000, size=4096,
                 mtime_ns=1_700_000_000_123_456_789, parent=ROOT_INO, name=name,
                 chunks=[("ab" * 32, 4096)], published=True, ver=3, max_ver=4,
                 xattrs={b"user.k": b"\x00\xff", "user.é".encode(): b"v"},
                 aliases=[(7, name + b".alias")], listed_at=1.5, sealed_at=None,
                 held=[["root", name.hex(), "{}", "{}"]])


@pytest.mark.parametrize("name", NAMES)
def test_an_inode_record_reads_back_whole(name):
    inode = inode_named(name)
    assert Inode.decode(inode.encode()) == inode


@pytest.mark.parametrize("name", NAMES)
def test_a_record_the_json_module_wrote_reads_the_same(name):
    inode = inode_named(name)
    old = json.dumps(json.loads(inode.encode()), separators=(",", ":")).encode()
    assert Inode.decode(old) == inode


def test_names_that_are_not_utf8_survive_the_namespace(tmp_path):
    ns = Namespace(tmp_path / "meta")
    root = ns.get(ROOT_INO)
    for name in NAMES:
        inode = ns.reserve_inode("file", 0o644, 0, 0)
        ns.attach(inode, root, name)
    ns.close()
    ns = Namespace(tmp_path / "meta")           # read from disk, not the cache
    assert sorted(name for name, _ in ns.children(ROOT_INO)) == sorted(NAMES)
    for name in NAMES:
        ino = ns.lookup(ROOT_INO, name)
        assert ino is not None and ns.get(ino).name == name
    ns.close()


def test_times_and_sizes_over_64_bits_read_back_exactly(tmp_path):
    """``touch -d 2600-01-01`` gives an mtime over 2**64 ns: orjson refuses to write it
    and would read it as a float (rounded, and refused by other nodes once published);
    such a record is written and read by the json module, exactly."""
    big = 19_880_899_200_123_456_789
    inode = inode_named(b"f")
    inode.mtime_ns, inode.size = big, 2 ** 70
    back = Inode.decode(inode.encode())
    assert (back.mtime_ns, back.size) == (big, 2 ** 70)
    assert type(back.mtime_ns) is int and type(back.size) is int
    ns = Namespace(tmp_path / "meta")
    saved = ns.reserve_inode("file", 0o644, 0, 0, mtime_ns=big)
    ns.close()
    ns = Namespace(tmp_path / "meta")
    assert ns.get(saved.ino).mtime_ns == big
    ns.close()


def test_an_infinite_seal_time_is_not_written_as_null():
    """orjson writes infinity as null: such a record goes through the json module (and
    a store entry's infinite ``sealed_at`` is not taken: the test below)."""
    inode = inode_named(b"f")
    inode.sealed_at = float("inf")
    assert Inode.decode(inode.encode()).sealed_at == float("inf")


def test_an_entry_with_an_infinite_seal_time_reads_as_unsealed():
    from ckptfs.format.remote import Entry
    template = Entry(type="dir", mode=0o755, id="0" * 32, sealed_at=5.0).to_json()
    assert Entry.from_json(template).sealed_at == 5.0
    hostile = template.replace(b'"sealed_at":5.0', b'"sealed_at":1e999')
    assert Entry.from_json(hostile).sealed_at is None
