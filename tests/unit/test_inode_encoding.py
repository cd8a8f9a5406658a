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
