"""The remote format: names round-trip, hostile entries are refused."""

import json

import pytest

from ckptfs.format.remote import (COUNTED_KEPT, ROOT_DIR_ID, BadEntry, Entry, RemovalMark,
                                  decode_name, encode_name, entry_key)

SHA = "a" * 64


@pytest.mark.parametrize("name", [b"plain", b"with space", b"100%", "ünï".encode(), b"\xff\xfe",
                                  b"a\tb\nc", b"x" * 255, b"%41"])
def test_names_round_trip(name):
    encoded = encode_name(name)
    assert "/" not in encoded
    assert decode_name(encoded) == name


def test_ascii_names_keep_their_length():
    assert len(encode_name(b"y" * 255)) == 255


@pytest.mark.parametrize("component", ["..", ".", "", "a%2Fb", "%00", "%zz", "%2E%2E"])
def test_hostile_names_refused(component):
    with pytest.raises(BadEntry):
        decode_name(component)


def entry(**over):
    doc = {"v": 1, "type": "file", "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 1,
           "size": 10, "chunks": [[SHA, 10]]}
    doc.update(over)
    return json.dumps(doc).encode()


def test_valid_entry_parses():
    e = Entry.from_json(entry(), max_chunk=8 << 20)
    assert (e.type, e.size, e.chunks) == ("file", 10, [(SHA, 10)])
    again = Entry.from_json(e.to_json(), max_chunk=8 << 20)
    assert again == e


@pytest.mark.parametrize("body", [
    b"not json", b"[]", entry(type="socket"), entry(size=11), entry(chunks=[["zz", 10]]),
    entry(chunks=[[SHA, -1]]), entry(mode=-1), entry(uid="root"), entry(chunks="x"),
    entry(type="dir", id="../etc"), entry(type="dir", id="root"),
    entry(type="symlink", target=""), entry(chunks=[[SHA, 9 << 20]], size=9 << 20),
])
def test_bad_entries_refused(body):
    with pytest.raises(BadEntry):
        Entry.from_json(body, max_chunk=8 << 20)


def test_mode_keeps_permission_bits_only():
    e = Entry.from_json(entry(mode=0o170777), max_chunk=8 << 20)
    assert e.mode == 0o7777 & 0o170777


def test_entries_with_any_allowed_chunk_size_parse_whatever_this_node_writes():
    """A node with --chunk-size 16M (or 64M) writes entries every node must read."""
    from ckptfs.format.remote import MAX_CHUNK_SIZE
    for n in (16 << 20, MAX_CHUNK_SIZE):
        e = Entry.from_json(entry(chunks=[[SHA, n], [SHA, 5]], size=n + 5))
        assert e.chunks == [(SHA, n), (SHA, 5)]
    with pytest.raises(BadEntry):
        Entry.from_json(entry(chunks=[[SHA, MAX_CHUNK_SIZE + 1]], size=MAX_CHUNK_SIZE + 1))


def test_unknown_entry_fields_are_ignored():
    e = Entry.from_json(entry(rev="0f" * 8, future={"x": 1}))
    assert e.size == 10


def test_check_key_fits_counts_escapes():
    from ckptfs.format.remote import MAX_KEY_COMPONENT, KeyTooLong, check_key_fits
    check_key_fits("root", b"x" * 255)
    check_key_fits("0" * 32, b"%" * 85)                 # 255 bytes once escaped
    check_key_fits("0" * 32, "é".encode() * 127)        # UTF-8 kept as is: 254 bytes
    for name in (b"%" * 86, b"%" * 240, b"\x01" * 100, b"\xff" * 90):
        with pytest.raises(KeyTooLong, match=f"limit {MAX_KEY_COMPONENT}"):
            check_key_fits("0" * 32, name)


def special(kind, **over):
    doc = {"v": 1, "type": kind, "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 1}
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("kind", ["fifo", "chr", "blk", "sock"])
def test_special_entries_round_trip(kind):
    rdev = 0x10203 if kind in ("chr", "blk") else 0
    e = Entry.from_json(special(kind, rdev=rdev), max_chunk=8 << 20)
    assert (e.type, e.rdev, e.size, e.chunks) == (kind, rdev, 0, [])
    assert Entry.from_json(e.to_json(), max_chunk=8 << 20) == e


def test_entries_keep_user_xattrs_and_links():
    e = Entry(type="file", mode=0o600, xattrs={b"user.a": b"\x00\xff", b"user.%/x": b""})
    again = Entry.from_json(e.to_json(), max_chunk=8 << 20)
    assert again.xattrs == e.xattrs
    link = Entry.from_json(special("link", inode="b" * 32), max_chunk=8 << 20)
    assert (link.type, link.link) == ("link", "b" * 32)
    inode = Entry.from_json(entry(nlink=3), max_chunk=8 << 20)
    assert inode.nlink == 3


def test_inode_objects_keep_their_latest_count_out_ids():
    """``counted`` (the latest link count-outs made on an inode object) survives a
    round trip, keeps the latest ``COUNTED_KEPT``, and is as if absent where it is not
    a list of ids: an older or hostile writer's object still parses."""
    ids = [f"{i:032x}" for i in range(COUNTED_KEPT + 5)]
    again = Entry.from_json(Entry(type="file", mode=0o600, nlink=2, counted=ids).to_json(),
                            max_chunk=8 << 20)
    assert again.counted == ids[-COUNTED_KEPT:]
    assert Entry.from_json(entry(nlink=2), max_chunk=8 << 20).counted == []
    for hostile in (["not an id"], "a" * 32, [5], ["a" * 32] * (COUNTED_KEPT + 1)):
        assert Entry.from_json(entry(nlink=2, counted=hostile), max_chunk=8 << 20).counted \
            == []


@pytest.mark.parametrize("body", [
    special("chr", rdev=-1), special("blk", rdev=1 << 40), special("chr", rdev="1"),
    special("fifo", size=10), special("sock", chunks=[[SHA, 10]], size=10),
    special("link"), special("link", inode="../../x"), special("link", inode="B" * 32),
    entry(nlink=-1), entry(nlink=True),
    entry(xattrs=[]), entry(xattrs={"trusted.x": ""}), entry(xattrs={"user.ckptfs.state": ""}),
    entry(xattrs={"user.x": "not base64!"}), entry(xattrs={"user.x": 5}),
    entry(xattrs={"user." + "n" * 300: ""}),
    entry(xattrs={f"user.{i}": "A" * 8000 for i in range(12)}),
])
def test_bad_new_fields_refused(body):
    with pytest.raises(BadEntry):
        Entry.from_json(body, max_chunk=8 << 20)


DIR_ID = "ab" * 16


def test_removal_marks_round_trip_without_the_rename_claim():
    entry = Entry(type="dir", mode=0o750, id=DIR_ID, moving_to="dirs/root/x", moving_at=5.0)
    mark = RemovalMark(entry_key(ROOT_DIR_ID, b"d1"), entry)
    back = RemovalMark.from_json(mark.to_json(), DIR_ID)
    assert back.key == "dirs/root/d1"
    assert (back.entry.type, back.entry.id, back.entry.mode) == ("dir", DIR_ID, 0o750)
    assert back.entry.moving_to is None


@pytest.mark.parametrize("key, entry, why", [
    ("chunks/ab/x", {"type": "dir", "mode": 493, "id": "ab" * 16}, "names no entry key"),
    ("dirs/nope/d1", {"type": "dir", "mode": 493, "id": "ab" * 16}, "bad directory id"),
    ("dirs/root/a/../b", {"type": "dir", "mode": 493, "id": "ab" * 16}, "invalid name"),
    ("dirs/root/d1", {"type": "dir", "mode": 493, "id": "cd" * 16}, "no entry of that"),
    ("dirs/root/d1", {"type": "symlink", "mode": 511, "target": "x"}, "no entry of that"),
    ("dirs/root/d1", "not an entry", "not an object"),
])
def test_hostile_removal_marks_refused(key, entry, why):
    """A mark names only its own directory, under a valid entry key: a hostile one
    cannot make a node put a directory anywhere else."""
    body = json.dumps({"v": 2, "key": key, "entry": entry}).encode()
    with pytest.raises(BadEntry, match=why):
        RemovalMark.from_json(body, DIR_ID)
