"""Support for the model-based test (test_model.py): file contents that name their
version, reading a mount's whole tree, writer processes held open across steps, and the
pure model of the namespace that every mount must converge to.

Knows nothing of ckptfs internals: everything goes through mount points and the
``ckptfs`` command, as a user's program would.
"""

from __future__ import annotations

import errno
import hashlib
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Any
from pathlib import Path

PIECE = 16 * 1024          # writers write in pieces of this size; kill points fall between
DIR = "dir"
HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- contents


def version_bytes(vid: int, size: int) -> bytes:
    """Content of version ``vid``: a header naming it, then bytes only it produces, so a
    read can be attributed to one version and a mix or a torn prefix is detectable."""
    header = b"ckptfs-model version %08d size %08d\n" % (vid, size)
    body = hashlib.shake_256(b"ckptfs-model %d" % vid).digest(max(1, size - len(header)))
    return (header + body)[:size]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def describe(data: bytes, known: dict[str, str]) -> str:
    """Say what a content is: a known version, a torn prefix, a mix..."""
    d = digest(data)
    if d in known:
        return f"{len(data)} bytes = {known[d]}"
    if not data:
        return "0 bytes (empty), not a closed version"
    head = data[:64].split(b"\n")[0]
    try:
        parts = head.split()
        vid, size = int(parts[2]), int(parts[4])
    except (IndexError, ValueError):
        return f"{len(data)} bytes, no version header: {head[:24]!r}..."
    full = version_bytes(vid, size)
    if data == full[:len(data)]:
        return f"{len(data)} bytes = a torn prefix of version {vid} ({size} bytes)"
    first_bad = next(i for i in range(min(len(data), len(full)) + 1)
                     if i >= len(data) or i >= len(full) or data[i] != full[i])
    return (f"{len(data)} bytes with the header of version {vid} ({size} bytes) but other "
            f"bytes from offset {first_bad} (a mix of versions or corrupt)")


# --------------------------------------------------------------------------- observing


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Every file the test creates is opened with this mode (write_file, BgWriter, save):
# what it gets is that less the umask, on every node.
CREATE_MODE = 0o644
NEW_FILE_MODE = CREATE_MODE & ~umask()
# ... and is owned by the test's user and group, with no extended attributes.
NEW_FILE_OWNER = (os.getuid(), os.getgid())


def user_xattrs(path: Path) -> tuple:
    """A file's ``user.*`` extended attributes, sorted: ((name, value), ...)."""
    return tuple(sorted((name, os.getxattr(path, name, follow_symlinks=False))
                        for name in os.listxattr(path, follow_symlinks=False)
                        if name.startswith("user.")))


def save(path: Path, content: bytes) -> None:
    """Create or overwrite (O_TRUNC) ``path`` with ``content`` and close it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CREATE_MODE)
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


@dataclass
class Observation:
    """One mount's tree: path -> ("dir",) | ("file", bytes, mode, mtime_ns, (uid, gid),
    user xattrs) | ("error", errno name); mode is ``st_mode & 0o7777``, the extended
    attributes ``user_xattrs``'s."""

    tree: dict[str, tuple]
    unstable: str = ""      # a name vanished while walking: look again


def observe(root: Path) -> Observation:
    tree: dict[str, tuple] = {}

    def walk(rel: str) -> str:
        path = root / rel if rel else root
        try:
            names = sorted(os.listdir(path))
        except FileNotFoundError:
            return f"{rel or '/'} vanished while listing"
        except OSError as exc:
            tree[rel] = ("error", errno.errorcode.get(exc.errno, str(exc.errno)))
            return ""
        for name in names:
            child = f"{rel}/{name}" if rel else name
            try:
                st = os.lstat(root / child)
            except FileNotFoundError:
                return f"{child} vanished after listing"
            except OSError as exc:
                tree[child] = ("error", errno.errorcode.get(exc.errno, str(exc.errno)))
                continue
            if os.path.stat.S_ISDIR(st.st_mode):
                tree[child] = (DIR,)
                why = walk(child)
                if why:
                    return why
            else:
                try:
                    with open(root / child, "rb") as f:
                        tree[child] = ("file", f.read(), st.st_mode & 0o7777,
                                       st.st_mtime_ns, (st.st_uid, st.st_gid),
                                       user_xattrs(root / child))
                except FileNotFoundError:
                    return f"{child} vanished before reading"
                except OSError as exc:
                    tree[child] = ("error", errno.errorcode.get(exc.errno, str(exc.errno)))
        return ""

    why = walk("")
    return Observation(tree, why)


def same(want: tuple | None, seen: tuple | None) -> bool:
    """Whether what a mount shows of a path is what the model wants there: a file's
    mtime is checked only where the model knows it (set by utime, not written since)."""
    if want is None or seen is None or want[0] != "file" or want[3] is not None:
        return want == seen
    return seen[0] == "file" and seen[:3] == want[:3] and seen[4:] == want[4:]


def matches(seen: dict[str, tuple], want: dict[str, tuple]) -> bool:
    return seen.keys() == want.keys() and all(same(want[p], seen[p]) for p in want)


# --------------------------------------------------------------------------- writers

WRITER_SCRIPT = r"""
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from model_support import CREATE_MODE, PIECE, version_bytes
path, vid, size = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = version_bytes(vid, size)
pos = 0
def say(*words):
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CREATE_MODE)
except OSError as exc:
    say("err", exc.errno)
    sys.exit(1)
say("ok")
for line in sys.stdin:
    cmd = line.split()
    try:
        if cmd[0] == "write":
            end = min(size, pos + int(cmd[1]) * PIECE)
            while pos < end:
                pos += os.write(fd, data[pos:end])
        elif cmd[0] == "fsync":
            os.fsync(fd)
        elif cmd[0] == "sub":
            subprocess.run(["true"], check=True)
        elif cmd[0] == "close":
            while pos < size:
                pos += os.write(fd, data[pos:])
            os.close(fd)
            say("ok")
            break
        say("ok")
    except OSError as exc:
        say("err", exc.errno)
"""


class WriterError(AssertionError):
    pass


class BgWriter:
    """A writer process holding a file open across steps; it writes ``version_bytes(vid,
    size)`` in pieces when told, and can be SIGKILLed between any two commands."""

    def __init__(self, path: Path, vid: int, size: int, timeout: float = 60.0) -> None:
        self.path, self.vid, self.size, self.timeout = path, vid, size, timeout
        self.written = 0
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(HERE), str(path),
                                      str(vid), str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self._expect_ok("open")

    def _expect_ok(self, what: str) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self.kill()
            raise WriterError(f"writer of {self.path.name} (v{self.vid}): {what} hung for "
                              f"{self.timeout:.0f} s")
        line = self.proc.stdout.readline().split()
        if line != ["ok"]:
            code = int(line[1]) if len(line) > 1 and line[0] == "err" else None
            raise WriterError(f"writer of {self.path.name} (v{self.vid}): {what} failed: "
                              f"{errno.errorcode.get(code, line) if code else line}")

    def command(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        self._expect_ok(cmd)
        if cmd.startswith("write"):
            self.written = min(self.size, self.written + int(cmd.split()[1]) * PIECE)
        if cmd == "close":
            self.written = self.size
            self.proc.wait(self.timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


# --------------------------------------------------------------------------- the model


@dataclass
class FileState:
    content: bytes | None            # last closed content; None: never closed
    wmount: int | None = None        # the mount a writer holds it open on
    pending: bytes = b""             # what that writer is writing
    written: int = 0                 # how much of it so far
    # Renamed, before its first close, over a file with a closed version: what the
    # other mounts go on showing under its name until its own closed version lands
    # (DESIGN.md promise 2: a name changes only when a closed version lands there).
    held: bytes | None = None
    mode: int = NEW_FILE_MODE        # permission bits (st_mode & 0o7777)
    mtime: int | None = None         # the closed version's mtime_ns, when set by utime
    owner: tuple = NEW_FILE_OWNER    # (uid, gid)
    xattrs: tuple = ()               # user.* extended attributes: ((name, value), ...)
    held_attrs: tuple = ()           # (mode, mtime, owner, xattrs) of the held version
    linked: bool = False             # ever hard-linked: async, its renames need the store

    def attrs(self) -> tuple:
        """(mode, mtime, owner, xattrs): what an observation shows beside the bytes."""
        return (self.mode, self.mtime, self.owner, self.xattrs)


@dataclass
class HeldReader:
    """A file a reader holds open in the test process (``reader_open``)."""
    m: int                           # the mount
    path: str                        # the name it was opened by
    file: Any                        # the open file object
    expected: bytes | None           # the version it opened (None: ``joined`` not closed)
    joined: int | None = None        # the file id of the open writer it joined


def parent_of(path: str) -> str:
    return path.rpartition("/")[0]


@dataclass
class Model:
    """What the namespace must be: path -> DIR or a file id; file id -> FileState (a
    hard-linked file's names share one id).  Operations return 0 or the errno POSIX
    gives, and change nothing on error."""

    tree: dict[str, object] = field(default_factory=dict)
    files: dict[int, FileState] = field(default_factory=dict)
    next_fid: int = 1

    def copy(self) -> "Model":
        return Model(dict(self.tree), {k: replace(v) for k, v in self.files.items()},
                     self.next_fid)

    # queries
    def is_dir(self, path: str) -> bool:
        return path == "" or self.tree.get(path) == DIR

    def dirs(self) -> list[str]:
        return sorted(p for p, v in self.tree.items() if v == DIR)

    def file_paths(self) -> list[str]:
        return sorted(p for p, v in self.tree.items() if v != DIR)

    def children(self, path: str) -> list[str]:
        return sorted(p for p in self.tree if parent_of(p) == path)

    def subtree(self, path: str) -> list[str]:
        return sorted(p for p in self.tree if p == path or p.startswith(path + "/"))

    def fid_at(self, path: str) -> int | None:
        v = self.tree.get(path)
        return None if v is None or v == DIR else v

    def path_of(self, fid: int) -> str | None:
        for p, v in self.tree.items():
            if v == fid:
                return p
        return None

    def busy(self, path: str) -> int | None:
        """The mount of a writer holding something at or under ``path`` open."""
        for p in self.subtree(path):
            fid = self.fid_at(p)
            if fid is not None and self.files[fid].wmount is not None:
                return self.files[fid].wmount
        return None

    def view(self, mount: int) -> dict[str, tuple]:
        """What ``mount`` must show once converged."""
        out: dict[str, tuple] = {}
        for path, v in self.tree.items():
            if v == DIR:
                out[path] = (DIR,)
                continue
            f = self.files[v]
            if f.wmount == mount:
                out[path] = ("file", f.pending[:f.written], f.mode, None, f.owner, f.xattrs)
            elif f.content is not None:
                out[path] = ("file", f.content, *f.attrs())
            elif f.held is not None:
                out[path] = ("file", f.held, *f.held_attrs)
        return out

    def partials(self, mount: int) -> set[bytes]:
        return {f.pending[:f.written] for f in self.files.values() if f.wmount == mount}

    # operations
    def _drop(self, fid: int) -> None:
        """A name of ``fid`` went: the file goes with its last name and last writer."""
        if self.files[fid].wmount is None and self.path_of(fid) is None:
            del self.files[fid]

    def write(self, path: str, content: bytes) -> int:
        if not self.is_dir(parent_of(path)):
            return errno.ENOENT
        v = self.tree.get(path)
        if v == DIR:
            return errno.EISDIR
        if v is None:
            self.tree[path] = self.next_fid
            self.files[self.next_fid] = FileState(content)
            self.next_fid += 1
        else:
            self.files[v].content, self.files[v].mtime = content, None
        return 0

    def write_again(self, path: str, content: bytes, attrs: tuple) -> int:
        """A save whose name another node renamed away or removed while it was open
        (O_TRUNC over the file that was there): the name is written again as the file
        the writer had open -- ``attrs``, its (mode, mtime, owner, xattrs) then, less
        the mtime, which is the save's.  The daemon never learns the mode an ``O_CREAT``
        open of an existing name asked for, and widens no permission on a guess
        (decision 0016, addendum of stop 49)."""
        result = self.write(path, content)
        if result == 0:
            f = self.files[self.tree[path]]
            f.mode, _, f.owner, f.xattrs = attrs
        return result

    def open_writer(self, path: str, mount: int, pending: bytes) -> int:
        """A writer opens ``path`` with O_CREAT|O_TRUNC; returns the file id."""
        if path not in self.tree:
            self.tree[path] = self.next_fid
            self.files[self.next_fid] = FileState(None)
            self.next_fid += 1
        fid = self.tree[path]
        f = self.files[fid]
        f.wmount, f.pending, f.written = mount, pending, 0
        return fid

    def close_writer(self, fid: int) -> None:
        f = self.files[fid]
        f.content, f.wmount, f.pending, f.written = f.pending, None, b"", 0
        f.held, f.mtime = None, None
        if self.path_of(fid) is None:
            del self.files[fid]

    def lose_writer(self, fid: int) -> None:
        """The writer died (killed, or its daemon did): what it wrote is never seen."""
        f = self.files[fid]
        f.wmount, f.pending, f.written = None, b"", 0
        path = self.path_of(fid)
        if f.content is None and f.held is not None and path is not None:
            # the name shows what it held again
            f.content, f.held = f.held, None
            f.mode, f.mtime, f.owner, f.xattrs = f.held_attrs
        elif f.content is None:
            if path is not None:
                del self.tree[path]
            del self.files[fid]
        elif path is None:
            del self.files[fid]

    def truncate(self, path: str, size: int) -> int:
        fid = self.fid_at(path)
        if fid is None:
            return errno.ENOENT
        old = self.files[fid].content or b""
        self.files[fid].content = old[:size] + b"\0" * max(0, size - len(old))
        self.files[fid].mtime = None
        return 0

    def chmod(self, path: str, mode: int) -> int:
        return self._set_attr(path, "mode", mode & 0o7777)

    def utime(self, path: str, mtime_ns: int) -> int:
        return self._set_attr(path, "mtime", mtime_ns)

    def chown(self, path: str, uid: int, gid: int) -> int:
        return self._set_attr(path, "owner", (uid, gid))

    def setxattr(self, path: str, name: str, value: bytes) -> int:
        """Set ``name`` to ``value`` (None: remove it; ENODATA if it is not there)."""
        fid = self.fid_at(path)
        if fid is None:
            return self._set_attr(path, "xattrs", ())
        have = dict(self.files[fid].xattrs)
        if value is None and have.pop(name, None) is None:
            return errno.ENODATA
        if value is not None:
            have[name] = value
        return self._set_attr(path, "xattrs", tuple(sorted(have.items())))

    def _set_attr(self, path: str, attr: str, value: object) -> int:
        """(Only a file's attributes are modelled: a directory's change and are not
        checked.)"""
        v = self.tree.get(path)
        if v is None and not self.is_dir(path):
            return errno.ENOENT
        if v is not None and v != DIR:
            setattr(self.files[v], attr, value)
        return 0

    def unlink(self, path: str) -> int:
        v = self.tree.get(path)
        if v is None:
            return errno.ENOENT
        if v == DIR:
            return errno.EISDIR
        del self.tree[path]
        self._drop(v)
        return 0

    def mkdir(self, path: str) -> int:
        if not self.is_dir(parent_of(path)):
            return errno.ENOENT
        if path in self.tree:
            return errno.EEXIST
        self.tree[path] = DIR
        return 0

    def rmdir(self, path: str) -> int:
        if path not in self.tree:
            return errno.ENOENT
        if self.tree[path] != DIR:
            return errno.ENOTDIR
        if self.children(path):
            return errno.ENOTEMPTY
        del self.tree[path]
        return 0

    def rename(self, src: str, dst: str) -> int:
        if src not in self.tree:
            return errno.ENOENT
        if not self.is_dir(parent_of(dst)):
            return errno.ENOENT
        if src == dst:
            return 0
        sv, dv = self.tree[src], self.tree.get(dst)
        if sv == dv and sv != DIR:
            return 0        # two names of one file: POSIX leaves both
        if sv == DIR:
            if dst.startswith(src + "/"):
                return errno.EINVAL
            if dv is not None and dv != DIR:
                return errno.ENOTDIR
            if dv == DIR and self.children(dst):
                return errno.ENOTEMPTY
            if dv == DIR:
                del self.tree[dst]
            for p in self.subtree(src):
                self.tree[dst + p[len(src):]] = self.tree.pop(p)
            return 0
        if dv == DIR:
            return errno.EISDIR
        moving = self.files[sv]
        moving.held = None                   # it leaves the name it held
        if dv is not None:
            replaced = self.files[dv]
            if moving.content is None:       # no closed version yet: the name holds on
                if replaced.content is not None:
                    moving.held, moving.held_attrs = replaced.content, replaced.attrs()
                else:
                    moving.held, moving.held_attrs = replaced.held, replaced.held_attrs
            del self.tree[dst]
            self._drop(dv)
        self.tree[dst] = self.tree.pop(src)
        return 0

    def link(self, src: str, dst: str) -> int:
        """A hard link ``dst`` to the file ``src``."""
        v = self.tree.get(src)
        if v is None:
            return errno.ENOENT
        if v == DIR:
            return errno.EPERM
        if not self.is_dir(parent_of(dst)):
            return errno.ENOENT
        if dst in self.tree:
            return errno.EEXIST
        self.tree[dst] = v
        self.files[v].linked = True
        return 0

    def needs_store(self, op: tuple) -> bool:
        """Whether async mode's ``op`` goes to the store at once, not through the
        metadata log: a hard link, the rename of a name of a hard-linked file or over
        one, the unlink of a name of a hard-linked file (README, "POSIX for the tools
        around training")."""
        kind, path, *args = op
        if kind == "link":
            return True
        if kind == "unlink":
            return self.fid_at(path) is not None and self.files[self.fid_at(path)].linked
        if kind != "rename":
            return False
        return any(self.fid_at(p) is not None and self.files[self.fid_at(p)].linked
                   for p in (path, args[0]))

    def holds_on_rename(self, src: str, dst: str) -> bool:
        """Whether renaming ``src`` over ``dst`` would leave ``dst`` showing its last
        closed version to other mounts (``FileState.held``)."""
        sv, dv = self.fid_at(src), self.fid_at(dst)
        return sv is not None and dv is not None and self.files[sv].content is None \
            and (self.files[dv].content is not None or self.files[dv].held is not None)

    def apply(self, op: tuple) -> int:
        kind, *args = op
        return getattr(self, kind)(*args)
