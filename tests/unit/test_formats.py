"""The structural-completeness checker against files written by the real libraries:
complete files pass, every truncation and every interrupted save is caught."""

import io
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from ckptfs.format import checkpoints as formats
from ckptfs.format.checkpoints import FORMATS, check_complete, parse_formats


def check(path, size=None, fmts=FORMATS):
    fd = os.open(path, os.O_RDONLY)
    try:
        return check_complete(fd, os.fstat(fd).st_size if size is None else size, fmts)
    finally:
        os.close(fd)


def cut_points(size, first, rng=random.Random(7)):
    """Every byte for small files, else every KiB, the last 300 bytes, and random points."""
    if size <= 40_000:
        return list(range(first, size))
    points = set(range(first, size, 1024)) | set(range(size - 300, size))
    return sorted(points | {rng.randrange(first, size) for _ in range(200)})


def assert_every_cut_rejected(path, first, except_at=()):
    size = os.path.getsize(path)
    missed = [n for n in cut_points(size, first) if n not in except_at and check(path, n) is None]
    assert missed == [], f"truncations judged complete: {missed[:10]}"


def rich_state():
    base = torch.randn(64, 33)
    return {
        "model": {"w": base, "w_t": base.t(), "row": base[3], "b": torch.zeros(33)},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 33), "step": torch.tensor(5)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "dtypes": {str(dt): torch.ones(5, dtype=dt) for dt in (
            torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.uint8,
            torch.complex64, torch.float8_e4m3fn, torch.uint16)},
        "empty": torch.zeros(0), "untyped": torch.UntypedStorage(11),
        "q": torch.quantize_per_tensor(torch.randn(6), 0.1, 0, torch.qint8),
        "step": 12, "note": "hello",
    }


# --- torch zip archives -----------------------------------------------------------

def test_torch_save_complete(tmp_path):
    p = tmp_path / "ckpt.pt"
    torch.save(rich_state(), p, _use_new_zipfile_serialization=True)
    assert check(p) is None
    assert torch.load(p, weights_only=False)["step"] == 12  # the file really is whole


def test_torch_save_truncated_anywhere(tmp_path):
    p = tmp_path / "ckpt.pt"
    torch.save(rich_state(), p)
    assert check(p) is None
    assert_every_cut_rejected(p, first=4)
    assert "end-of-central-directory" in check(p, os.path.getsize(p) - 1)


class Boom:
    def __getstate__(self):
        raise RuntimeError("boom in __getstate__")


class BoomReduce:
    def __reduce_ex__(self, protocol):
        raise RuntimeError("boom in __reduce_ex__")


@pytest.mark.parametrize("bomb", [Boom, BoomReduce])
def test_torch_save_interrupted_while_pickling(tmp_path, bomb):
    """torch writes the zip end record in a finally: the archive looks whole but has no
    data.pkl."""
    p = tmp_path / "ckpt.pt"
    state = {"a": torch.randn(100), "obj": bomb(), "c": torch.randn(300)}
    with pytest.raises(RuntimeError, match="boom"):
        with open(p, "wb") as f:
            torch.save(state, f)
    assert zipfile.ZipFile(p).testzip() is None  # a valid zip, yet torn
    with pytest.raises(Exception):
        torch.load(p)
    assert check(p) == "torch archive: no data.pkl (torch.save was interrupted)"


def test_torch_save_interrupted_by_sigterm_between_storages(tmp_path, monkeypatch):
    """A SIGTERM handler calling sys.exit(1) fires between two storage records: data.pkl
    and the end record are written, later storages are not."""
    real_tls = torch.serialization._serialization_tls
    state = {"a": torch.randn(100), "b": torch.randn(200), "c": torch.randn(300)}

    class Tls:  # torch reads skip_data while pickling and once before each storage record
        reads, fire_at = 0, None

        def __getattr__(self, name):
            if name == "skip_data":
                Tls.reads += 1
                if Tls.reads == Tls.fire_at:
                    signal.raise_signal(signal.SIGTERM)
            return getattr(real_tls, name)

    monkeypatch.setattr(torch.serialization, "_serialization_tls", Tls())
    torch.save(state, tmp_path / "dry.pt")
    Tls.reads, Tls.fire_at = 0, Tls.reads - 1  # just before the second of three storages
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    p = tmp_path / "ckpt.pt"
    try:
        with pytest.raises(SystemExit):
            with open(p, "wb") as f:
                torch.save(state, f)
    finally:
        signal.signal(signal.SIGTERM, old)
    names = zipfile.ZipFile(p).namelist()
    assert "archive/data.pkl" in names and "archive/data/0" in names
    assert "archive/data/1" not in names
    assert check(p) == "torch archive: storage data/1 referenced by data.pkl is missing"


class FailingWrites(io.RawIOBase):
    """A real file whose write raises once at byte `at` (a handler raising mid-write)."""

    def __init__(self, f, at):
        self.f, self.n, self.at = f, 0, at

    def writable(self):
        return True

    def write(self, b):
        if self.n <= self.at < self.n + len(b):
            self.at = -1
            raise KeyboardInterrupt
        self.n += len(b)
        return self.f.write(b)


def test_torch_save_interrupted_mid_write(tmp_path):
    state = {"a": torch.randn(1000), "b": {"c": torch.randn(2000), "d": torch.arange(500)}}
    torch.save(state, tmp_path / "ref.pt")
    full = os.path.getsize(tmp_path / "ref.pt")
    p = tmp_path / "ckpt.pt"
    for at in [10, 100, 500, 3000, 9000, full - 200, full - 30]:
        with pytest.raises((KeyboardInterrupt, RuntimeError)):  # torch may chain its own
            with open(p, "wb") as f:
                torch.save(state, FailingWrites(f, at))
        assert check(p) is not None, at


def rebuild_zip(src, dst, drop=(), shrink=()):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if info.filename in drop:
                continue
            data = zin.read(info)
            zout.writestr(info.filename, data[:-4] if info.filename in shrink else data)


def test_torch_archive_missing_or_short_storage(tmp_path):
    p = tmp_path / "m.pt"
    torch.save({"x": torch.randn(10), "y": torch.randn(20)}, p)
    rebuild_zip(p, tmp_path / "same.pt")
    assert check(tmp_path / "same.pt") is None
    rebuild_zip(p, tmp_path / "drop.pt", drop={"m/data/1"})
    assert check(tmp_path / "drop.pt") == "torch archive: storage data/1 referenced by data.pkl is missing"
    rebuild_zip(p, tmp_path / "short.pt", shrink={"m/data/0"})
    assert check(tmp_path / "short.pt") == "torch archive: storage data/0 has 36 bytes, data.pkl needs 40"


def test_torch_large_tensor_uses_zip64_end_record(tmp_path):
    p = tmp_path / "big.pt"
    torch.save({"big": torch.randn(10 * 2**20), "small": torch.ones(3)}, p)  # 40 MiB
    with open(p, "rb") as f:
        f.seek(-98, os.SEEK_END)
        assert f.read(4) == b"PK\x06\x06"  # zip64 end record before locator and end record
    assert check(p) is None
    assert_every_cut_rejected(p, first=4)


def test_check_reads_only_head_tail_and_directory(tmp_path, monkeypatch):
    p = tmp_path / "big.pt"
    torch.save({f"layer{i}": torch.randn(2 * 2**20) for i in range(8)}, p)  # 64 MiB
    size = os.path.getsize(p)
    assert size > 64 * 2**20
    read = []
    real_pread = os.pread
    monkeypatch.setattr(formats.os, "pread", lambda fd, n, off: read.append(n) or real_pread(fd, n, off))
    assert check(p) is None
    assert 0 < sum(read) < 256 * 1024, sum(read)
    read.clear()
    assert check(p, size - 10_000_000) is not None
    assert sum(read) < 256 * 1024


def test_other_torch_zip_formats_pass(tmp_path):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x) + torch.tensor([1.0, 2.0])

    torch.jit.save(torch.jit.script(M()), tmp_path / "m.jit")
    torch.export.save(torch.export.export(M(), (torch.randn(1, 3),)), tmp_path / "m.pt2")
    for name in ("m.jit", "m.pt2"):
        assert check(tmp_path / name) is None, name
        assert check(tmp_path / name, os.path.getsize(tmp_path / name) - 5) is not None


def test_dcp_shard_of_concatenated_archives(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(100), "x": torch.randn(50), "extra": {"step": 3}},
             checkpoint_id=tmp_path / "ckpt")
    shards = [p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".distcp"]
    assert shards
    for shard in shards:
        data = shard.read_bytes()
        ends = [i + 22 for i in range(len(data)) if data.startswith(b"PK\x05\x06", i)]
        assert len(ends) > 1  # several zips back to back
        assert check(shard) is None
        # cut exactly where an inner archive ends, a shard looks like one with fewer items
        assert_every_cut_rejected(shard, first=4, except_at=ends)
    assert check(tmp_path / "ckpt" / ".metadata") is None


def test_generic_zips_npz_and_zip64_extra(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.arange(100), y=np.ones((3, 4)))
    np.savez_compressed(tmp_path / "b.npz", x=np.arange(1000))
    with zipfile.ZipFile(tmp_path / "c.zip", "w") as z:
        for i in range(3):
            with z.open(f"f{i}", "w", force_zip64=True) as f:  # zip64 extra fields
                f.write(bytes(range(256)) * (i + 1))
    for name in ("a.npz", "b.npz", "c.zip"):
        assert check(tmp_path / name) is None, name
        assert_every_cut_rejected(tmp_path / name, first=4)


def test_legacy_torch_format(tmp_path):
    p = tmp_path / "old.pt"
    torch.save(rich_state(), p, _use_new_zipfile_serialization=False)
    assert check(p) is None
    small = tmp_path / "small.pt"
    torch.save({"a": torch.randn(40), "b": [torch.ones(3, dtype=torch.int16)] * 2}, small,
               _use_new_zipfile_serialization=False)
    assert_every_cut_rejected(small, first=2)
    assert check(p, fmts=("pickle",)) is None  # raw bytes after the pickles: not a plain pickle
    with open(p, "ab") as f:
        f.write(b"\0" * 8)
    assert check(p) == f"legacy torch file: storages need {os.path.getsize(p) - 8} bytes, " \
                       f"file has {os.path.getsize(p)}"


# --- safetensors ------------------------------------------------------------------

def test_safetensors(tmp_path):
    p = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"a": torch.randn(30, 30), "b": torch.arange(77), "e": torch.zeros(0)},
                                p, metadata={"format": "pt"})
    assert check(p) is None
    assert_every_cut_rejected(p, first=9)
    with open(p, "ab") as f:
        f.write(b"x")
    assert check(p).startswith("safetensors: size")
    q = tmp_path / "np.safetensors"
    safetensors.numpy.save_file({"z": np.ones((5, 5), np.float64)}, q)
    assert check(q) is None
    assert check(q, os.path.getsize(q) - 1).startswith("safetensors: size")


def test_safetensors_without_tensors(tmp_path):
    p = tmp_path / "empty.safetensors"
    safetensors.torch.save_file({}, p, metadata={"k": "v"})
    assert check(p) is None


def test_safetensors_bad_header(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b'{"a": [1, ' + b"\0" * 10)
    assert check(p).startswith("safetensors: header does not parse")


# --- numpy .npy -------------------------------------------------------------------

@pytest.mark.parametrize("arr", [
    np.random.rand(7, 9, 3).astype(np.float32),
    np.asfortranarray(np.arange(60, dtype=np.int64).reshape(6, 10)),
    np.array(["ab", "cdef"]),
    np.zeros(4, dtype=[("x", "<f8"), ("y", "<i2", (3,))]),
    np.arange(5000, dtype=np.uint8),
    np.array(3.5),
])
def test_npy(tmp_path, arr):
    p = tmp_path / "a.npy"
    np.save(p, arr)
    assert check(p) is None
    assert_every_cut_rejected(p, first=6)
    with open(p, "ab") as f:
        f.write(b"\x93NUMPY\x01")  # the start of a second array
    assert check(p).startswith("npy: header of array 1 cut short")


def test_npy_several_arrays_in_one_file(tmp_path):
    """np.save twice into one open file (numpy's documented pattern) is complete."""
    p = tmp_path / "two.npy"
    with open(p, "wb") as f:
        np.save(f, np.arange(300, dtype=np.int32))
        boundary = f.tell()
        np.save(f, np.ones((4, 5)))
    assert check(p) is None
    assert_every_cut_rejected(p, first=6, except_at={boundary})  # a cut there leaves one whole array
    assert check(p, os.path.getsize(p) - 1) == f"npy: array 1 needs {os.path.getsize(p)} bytes, " \
                                               f"file has {os.path.getsize(p) - 1}"
    with open(p, "ab") as f:
        f.write(b"trailing bytes of another kind")
    assert check(p) is None  # not ours to judge


@pytest.mark.parametrize("version", [(2, 0), (3, 0)])
def test_npy_header_versions(tmp_path, version):
    p = tmp_path / "a.npy"
    with open(p, "wb") as f:
        np.lib.format.write_array(f, np.zeros(100, dtype=[("é", "<f4")]), version=version)
    assert check(p) is None
    assert_every_cut_rejected(p, first=6)


def test_npy_object_dtype_cannot_be_judged(tmp_path):
    p = tmp_path / "o.npy"
    np.save(p, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    assert check(p) is None
    assert check(p, os.path.getsize(p) - 3) is None


# --- pickle -----------------------------------------------------------------------

@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle(tmp_path, protocol):
    obj = {"ints": [i for i in range(300) if 46 not in (i % 256, i // 256)], "s": "x" * 100}
    data = pickle.dumps(obj, protocol=protocol)
    assert b"." not in data[:-1]  # so every cut ends in a byte other than STOP
    p = tmp_path / "a.pkl"
    p.write_bytes(data)
    assert check(p) is None
    assert_every_cut_rejected(p, first=2)
    assert check(p, len(data) - 1) == f"pickle (protocol {protocol}): does not end with STOP"


def test_old_pickle_protocols_are_unknown(tmp_path):
    p = tmp_path / "a.pkl"
    for protocol in (0, 1):
        p.write_bytes(pickle.dumps([1, 2, 3], protocol=protocol)[:-1])
        assert check(p) is None


# --- unknown files, settings ------------------------------------------------------

@pytest.mark.parametrize("content", [
    b"", b"P", b"PK", b"\x80", b"hello world\n" * 100, os.urandom(5000),
    b"\x1f\x8b\x08\x00" + os.urandom(100), b"\x80\x02\xff\x00",  # 0xff is no pickle opcode
    struct.pack("<Q", 2**40) + b"{" + b"\0" * 50,  # absurd safetensors length: not one
])
def test_unknown_leading_bytes(tmp_path, content):
    p = tmp_path / "f"
    p.write_bytes(content)
    assert check(p) is None


def test_formats_select_checks(tmp_path):
    p = tmp_path / "ckpt.pt"
    torch.save({"a": torch.randn(100)}, p)
    cut = os.path.getsize(p) - 1
    assert check(p, cut, ("npy", "pickle")) is None
    assert check(p, cut, ()) is None
    assert check(p, cut, ("torch",)) is not None
    with pytest.raises(ValueError, match="unknown checkpoint format 'zip'"):
        check(p, fmts=("torch", "zip"))


def test_parse_formats():
    assert parse_formats("torch, NPY,torch ,") == ("torch", "npy")
    assert parse_formats("") == ()
    assert parse_formats(",".join(FORMATS)) == FORMATS
    with pytest.raises(ValueError, match="unknown checkpoint format 'h5'"):
        parse_formats("torch,h5")


def test_damaged_files_give_an_answer_not_an_exception(tmp_path):
    """Random damage to each format yields None or a reason; the checker never raises."""
    rng = random.Random(3)
    samples = {}
    torch.save({"a": torch.randn(50), "b": [torch.ones(2)] * 2}, tmp_path / "t.pt")
    torch.save({"a": torch.randn(50)}, tmp_path / "l.pt", _use_new_zipfile_serialization=False)
    safetensors.torch.save_file({"a": torch.randn(50)}, tmp_path / "s.safetensors")
    np.save(tmp_path / "n.npy", np.arange(50))
    (tmp_path / "p.pkl").write_bytes(pickle.dumps({"a": list(range(50))}, protocol=4))
    for name in ("t.pt", "l.pt", "s.safetensors", "n.npy", "p.pkl"):
        samples[name] = (tmp_path / name).read_bytes()
    p = tmp_path / "damaged"
    answers = set()
    for name, good in samples.items():
        for _ in range(300):
            bad = bytearray(good)
            at = rng.randrange(4, len(bad))
            bad[at:at + rng.choice((1, 2, 4, 8))] = rng.randbytes(rng.choice((1, 2, 4, 8)))
            p.write_bytes(bytes(bad[:rng.choice((len(bad), rng.randrange(len(bad))))]))
            result = check(p)
            assert result is None or (isinstance(result, str) and "\n" not in result)
            answers.add(result is None)
    assert answers == {True, False}


def test_a_member_name_from_a_damaged_archive_is_shown_on_one_line(tmp_path):
    # A damaged name length in the central directory made the name swallow the next
    # header's bytes, newline and all, and the reason (logged, and given as the cause of
    # EIO) came out over several lines of binary (found by the random-damage test).
    torch.save({"a": torch.randn(50)}, tmp_path / "t.pt")
    data = bytearray((tmp_path / "t.pt").read_bytes())
    at = data.index(b"PK\x01\x02")
    name_len = struct.unpack_from("<H", data, at + 28)[0]
    struct.pack_into("<H", data, at + 28, name_len + 40)
    data[at + 46 + name_len + 5] = ord("\n")
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    reason = check(tmp_path / "bad.pt")
    assert reason is not None and reason.startswith("zip archive:")
    assert reason.isprintable(), reason


# --- valid zips CPython's test_zipfile writes: published, not refused ----------------
# (test_zipfile on a mount got EIO at close for these three; zipfile reads them all)

def stored_zip(path, comment=b""):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.comment = comment
        z.writestr("member.txt", b"some text\n" * 50)


def test_zip_with_a_newline_after_the_end_record(tmp_path):
    """StoredTestsWithSourceFile.test_ignores_newline_at_end."""
    p = tmp_path / "a.zip"
    stored_zip(p)
    with open(p, "a", encoding="utf-8") as f:
        f.write("\r\n\00\00\00")
    assert zipfile.ZipFile(p).read("member.txt") == b"some text\n" * 50
    assert check(p) is None


def test_zip_with_bytes_appended_past_its_comment(tmp_path):
    """StoredTestsWithSourceFile.test_ignores_stuff_appended_past_comments."""
    p = tmp_path / "a.zip"
    stored_zip(p, comment=b"this is a comment")
    with open(p, "a", encoding="utf-8") as f:
        f.write("abcdef\r\n")
    assert zipfile.ZipFile(p).comment == b"this is a comment"
    assert check(p) is None


def test_zip_appended_to_whose_local_names_differ_from_the_directory(tmp_path):
    """EncodedMetadataTests.test_read_after_append: Shift JIS names hacked into a zip
    without the UTF-8 flag; mode "a" rewrites the central directory with the names as
    UTF-8, so the local headers' name bytes no longer equal the directory's."""
    p = tmp_path / "a.zip"
    placeholders, names = ["n1", "n2", "\u4e09"], ["\u4e00", "\u4e8c"]
    with zipfile.ZipFile(p, "w") as z:
        for temp, content in zip(placeholders, [b"ascii\n", "\u3053\n".encode(), b"sjis\n"]):
            z.writestr(temp, content, zipfile.ZIP_STORED)
    data = p.read_bytes()
    for name, temp in zip(names, placeholders):
        data = data.replace(temp.encode("ascii"), name.encode("shift_jis"))
    p.write_bytes(data)
    assert check(p) is None
    with zipfile.ZipFile(p, "a") as z:
        z.writestr("\u56db", "newcontent")
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None  # zipfile reads every member
    assert check(p) is None


def test_zip_whose_end_record_counts_differ_from_its_directory(tmp_path):
    """zipfile walks the central directory by its size, not by the end record's count."""
    p = tmp_path / "a.zip"
    stored_zip(p)
    data = bytearray(p.read_bytes())
    struct.pack_into("<HH", data, len(data) - 22 + 8, 7, 7)
    p.write_bytes(bytes(data))
    assert zipfile.ZipFile(p).testzip() is None
    assert check(p) is None


def test_dcp_shard_cut_inside_a_following_archive_is_still_refused(tmp_path):
    """Bytes after a complete archive that begin another one are a cut archive."""
    p = tmp_path / "two.pt"
    torch.save({"a": torch.randn(10)}, tmp_path / "one.pt")
    one = (tmp_path / "one.pt").read_bytes()
    for tail in (b"P", b"PK", b"PK\x03", one[:40], one[:-30]):
        p.write_bytes(one + tail)
        assert check(p) is not None, tail[:8]
    p.write_bytes(one + b"\r\n")
    assert check(p) is None


# Pickles of a few bytes whose numbers ask for memory: memo indexes (the C unpickler
# sized its memo from them and zeroed it -- 16 GiB for LONG_BINPUT 0x40000000: the OOM
# killer took a test worker, and would take the daemon, which checks every .pt closed in
# the mount) and a BYTEARRAY8 length.  The numbers here ask for ~0.5 GiB, so that a
# checker that obeys them shows it in its peak memory without endangering the machine.
HOSTILE_PICKLES = {
    "long_binput": b"\x80\x02N" + b"r" + struct.pack("<I", 0x02000000) + b".",
    "put": b"\x80\x02N" + b"p" + b"33554432\n" + b".",
    "bytearray8": b"\x80\x05" + b"\x96" + struct.pack("<Q", 1 << 29) + b"x" * 16 + b".",
}
CHECK_AND_MEASURE = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))     # the machine stays safe
from ckptfs.format.checkpoints import check_complete
fd = os.open(sys.argv[1], os.O_RDONLY)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
answer = check_complete(fd, os.fstat(fd).st_size)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(repr((answer, grew)))
"""


@pytest.mark.parametrize("container", ["legacy", "archive"])
@pytest.mark.parametrize("name", sorted(HOSTILE_PICKLES))
def test_a_hostile_pickle_gets_an_answer_in_little_memory(tmp_path, name, container):
    hostile = HOSTILE_PICKLES[name]
    path = tmp_path / "hostile.pt"
    if container == "legacy":
        path.write_bytes(formats._LEGACY_TORCH + hostile)
    else:
        with zipfile.ZipFile(path, "w") as archive:       # stored, as torch.save does
            archive.writestr("hostile/data.pkl", hostile)
            archive.writestr("hostile/version", "3\n")
    proc = subprocess.run([sys.executable, "-c", CHECK_AND_MEASURE, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer, grew_kib = eval(proc.stdout)
    assert answer is None or (isinstance(answer, str) and "\n" not in answer)
    assert grew_kib < 64 << 10, f"checking a {path.stat().st_size}-byte file took " \
        f"{grew_kib >> 10} MiB"


def _sparse(path, head: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def test_an_npy_header_length_as_large_as_the_file_is_not_read_whole(tmp_path):
    # An npy header length (4 bytes in format 2 and 3) was bounded only by the file's
    # size: a 400 MB file claiming a 400 MB header made the check read it all, decode
    # it and hand it to ast (800 MiB; numpy itself refuses over 10 000 bytes).  A
    # safetensors header is recognised only up to MAX_HEADER (100 MB, the library's own
    # limit).
    size = 400 << 20
    path = tmp_path / "big.npy"
    _sparse(path, b"\x93NUMPY\x02\x00" + struct.pack("<L", size - 12) + b"{", size)
    proc = subprocess.run([sys.executable, "-c", CHECK_AND_MEASURE, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer, grew_kib = eval(proc.stdout)
    assert answer is None or (isinstance(answer, str) and "\n" not in answer)
    assert grew_kib < 64 << 10, f"checking it took {grew_kib >> 10} MiB"


def test_an_npy_header_nested_past_the_parser_gets_an_answer(tmp_path):
    # ast.literal_eval of 500 000 unary minuses raises MemoryError (parser stack),
    # which went out of the checker as an exception instead of an answer.
    header = b"-" * 500_000 + b"1"
    path = tmp_path / "deep.npy"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<L", len(header)) + header)
    answer = check(path)
    assert answer is not None and "does not parse" in answer and "\n" not in answer


# Found by CI (stop 32): a file of os.urandom bytes that began with 0x80, 0x02 and a byte
# that is a pickle opcode (about 1 in 61 000 random files) was taken for a pickle cut
# short and its close refused with EIO.  A plain pickle is only checked under the names
# pickle writers use; files without a name (direct calls) are checked as before.
def test_bytes_that_merely_begin_like_a_pickle_are_checked_only_under_a_pickle_name(tmp_path):
    p = tmp_path / "g"
    p.write_bytes(b"\x80\x02}" + bytes(range(1, 200)) * 20 + b"\x01")
    with open(p, "rb") as f:
        fd, size = f.fileno(), os.path.getsize(p)
        assert check_complete(fd, size, name=b"g") is None
        assert check_complete(fd, size, name=b"data.bin") is None
        for name in (b"state.pkl", b"OPT.PT", b"model.pth", b"x.pickle", b"last.ckpt"):
            assert check_complete(fd, size, name=name) == \
                "pickle (protocol 2): does not end with STOP", name
        assert check_complete(fd, size) is not None          # no name: checked as before
    z = tmp_path / "z"
    torch.save({"a": torch.randn(100)}, z)                   # a zip: its magic is enough
    with open(z, "rb") as f:
        assert check_complete(f.fileno(), os.path.getsize(z) - 1, name=b"z") is not None
