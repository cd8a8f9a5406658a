"""Issue 8 §6: a model-based randomized test of the central promise.

Two mounts (A = 0, B = 1: separate daemons, own state dirs) over ONE store run random
sequences of saves, overwrites, truncates, renames of files and directories, unlinks,
hard links, mkdir/rmdir, fsync and a subprocess in the middle of a save, writers held
open across steps and SIGKILLed at a chosen point, daemon SIGKILL + restart, a fresh
node replacing one, gc, pairs of operations racing on the two nodes, one node racing
itself (renames over fresh targets and back, lstat after each), a byte rotting in a
node's chunk cache, chmod, utime (an explicit mtime), chown and user.* setxattr/
removexattr of closed files, readers held open across steps (also one that joined a
save going through the kernel, while that file is saved again), and outages of the
store both nodes share (refuse, 403, 503, hang) with steps going on during them.  Every daemon runs under
a low descriptor limit.  After every step what each mount shows (listing + content and
permission bits, owner and user.* extended attributes of every file, and its mtime
where a utime set it and nothing wrote it since) must be a state the model allows:

- safety, at every observation: every file's content is exactly ONE closed version
  (never a mix, never the torn bytes of a killed or still-open writer) -- except on the
  node of a writer that still holds the file open, which shows exactly what it wrote;
- convergence (sync durability: within the metadata TTL; async: after ``ckptfs wait``):
  every node shows the model's tree -- no closed version that was not later
  overwritten/renamed/unlinked is lost, names follow renames and unlinks -- except
  that a file renamed before its first close over one with a closed version leaves the
  name showing that version to other nodes until its own lands (DESIGN.md promise 2;
  the name's last version comes back if its writer is killed); a file's mode is the one
  it was created with (0o644 less the umask) or last chmodded to -- and its owner and
  extended attributes the last chown's and setxattr's -- kept by a save over it,
  carried by a rename;
- the node that made a step shows it at once (POSIX on one node);
- a reader held open reads the version it opened until it closes (DESIGN.md promise 2);
- after racing operations, every node converges to the result of one of their two
  serial orders;
- during a store outage an async node's steps all succeed on it, ``ckptfs wait`` does
  not say done while a file it closed is pending, status names the outage, and after it
  every node converges; a sync step may fail with EIO and then either happened or did
  not -- never half -- and after the outage every node converges to one of those states;
  during it, each node answers from its own view (its own steps at once, the other
  node's only once read from the store: ``after_fault_step``).

Knobs (environment): CKPTFS_MODEL_EXAMPLES (per durability, default 4),
CKPTFS_MODEL_STEPS (per example, default 12), CKPTFS_MODEL_SEED (default: derandomized,
so CI is reproducible), CKPTFS_MODEL_STORES (local,s3; default local),
CKPTFS_MODEL_DURABILITY (sync,async), CKPTFS_MODEL_TTL (metadata TTL, default 0.25 s),
CKPTFS_MODEL_STORE_TIMEOUT (the daemons' store_timeout, default 5 s: a step in an
outage fails after it), CKPTFS_MODEL_NOFILE (the daemons' RLIMIT_NOFILE, default 128; 0
leaves it), CKPTFS_MODEL_STATE_MIB (each state dir a tmpfs of this size so a step can
fill it; default 32 as root, 0: plain directories and no such step),
CKPTFS_MODEL_TIMEOUT (pytest-timeout of one test, default 15 s a step, doubled when
shrinking), CKPTFS_MODEL_SHRINK (0 to skip shrinking), CKPTFS_MODEL_REPORT (a JSON file to which the
run's counts are appended; tools/soak.sh uses it).
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, precondition, rule,
                                 run_state_machine_as_test)

from conftest import BUCKET, Mount, StoreSpec, run_ckptfs
from support.logcheck import bad_records, daemon_logs
from support.posix import fill_file_system
from support.proxy import FaultProxy
from model_support import (CREATE_MODE, NEW_FILE_OWNER, PIECE, BgWriter, HeldReader, Model,
                           Observation, describe, digest, matches, observe, parent_of,
                           same, save, version_bytes)

# Taken out of the environment: the daemons this test starts inherit it, and ckptfs
# refuses unknown CKPTFS_* settings.
_KNOBS = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("CKPTFS_MODEL_")}
EXAMPLES = int(_KNOBS.get("CKPTFS_MODEL_EXAMPLES", "4"))
STEPS = int(_KNOBS.get("CKPTFS_MODEL_STEPS", "12"))
SEED = _KNOBS.get("CKPTFS_MODEL_SEED")
STORES = _KNOBS.get("CKPTFS_MODEL_STORES", "local").split(",")
DURABILITIES = _KNOBS.get("CKPTFS_MODEL_DURABILITY", "sync,async").split(",")
TTL = float(_KNOBS.get("CKPTFS_MODEL_TTL", "0.25"))
SHRINK = _KNOBS.get("CKPTFS_MODEL_SHRINK", "1") != "0"
REPORT = _KNOBS.get("CKPTFS_MODEL_REPORT")
KEEP = _KNOBS.get("CKPTFS_MODEL_KEEP") == "1"
VERBOSE = _KNOBS.get("CKPTFS_MODEL_VERBOSE") == "1"
# A hunting aid, never a default: leave out moves that hit a hole already known, so
# the next one shows (e.g. "subprocess,fsync,race,restart").
SKIP = set(filter(None, _KNOBS.get("CKPTFS_MODEL_SKIP", "").split(",")))
# A save by a process that writes stdin through one of two writable descriptors of the
# file and exits without closing either.
EXIT_HOLDING_TWICE = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, int(sys.argv[2], 8))
again = os.open(sys.argv[1], os.O_RDWR)
data = memoryview(sys.stdin.buffer.read())
while data:
    data = data[os.write(fd, data):]
os._exit(0)
"""

CHUNK = "64K"                      # small chunks: multi-chunk files stay small
SIZES = [0, 100, PIECE, 40_000, 70_000, 140_000]
TRUNCATE_SIZES = [0, 10, 5_000, 65_536, 70_000, 150_000]
# What ``file_attrs`` sets: permission bits (no set-id bits: the kernel's rules for
# clearing them are not the daemon's), and mtimes to the nanosecond.
MODES = [0o400, 0o600, 0o640, 0o644, 0o664, 0o700, 0o755, 0o1755]
MTIMES = [0, 1_000_000_000_123_456_789, 1_700_000_000_000_000_001,
          2_000_000_000_999_999_999]
# Owners a chown gives (only root may give a file away: as another user, its own only).
OWNERS = [(0, 0), (1000, 1000), (1000, 0), (65534, 65534)] if os.geteuid() == 0 \
    else [(os.getuid(), os.getgid())]
# user.* extended attributes a setxattr sets (a value of None removes the name).
XATTRS = [("user.a", b"1"), ("user.a", b"two"), ("user.b", b""), ("user.a", None),
          ("user.b", b"\x00\xffbinary")]
FILE_NAMES = ["f0", "f1", "f2"]
DIR_NAMES = ["d0", "d1"]
# A mount must reach the model within this (kernel entry/attr cache + listing TTL, plus
# a slow machine); a correctness deadline, not a timing assertion.
CONVERGE = max(20.0, 40 * TTL)
# Before a step counts as converged, every mount is observed again after both TTLs have
# run out, so a torn version that appears late (a refresh after the step) is seen.
SETTLE = 2 * TTL + 0.15
# Async: chunk uploads are slowed so closed versions stay pending across steps.
ASYNC_FAULTS = {"rules": [{"op": "put", "prefix": "chunks/", "kind": "delay", "delay": 0.15}]}
# The store outages a step can start (StoreFaults) and the errors they log.
FAULT_KINDS = [k for k in ("refuse", "403", "503", "hang", "torn", "reset")
               if f"fault-{k}" not in SKIP]
OUTAGE_ERRORS = (r"store error: ", r"store timeout: ", r"failed after \d+ attempts",
                 r"store unavailable", r"access denied", r"does not exist", r"injected",
                 r"No space left on device")
# A call to a store in an outage fails after this (sync: the step's EIO).
STORE_TIMEOUT = float(_KNOBS.get("CKPTFS_MODEL_STORE_TIMEOUT", "5"))
# Every daemon runs under this RLIMIT_NOFILE (soft and hard); 0: the inherited one.
NOFILE = int(_KNOBS.get("CKPTFS_MODEL_NOFILE", "128"))
# Every node's state dir is a tmpfs of this many MiB, so a step can fill it (root
# only); 0: a plain directory, no full-state-dir steps.
STATE_MIB = int(_KNOBS.get("CKPTFS_MODEL_STATE_MIB", "32" if os.geteuid() == 0 else "0"))
# pytest-timeout for one test (pyproject's 300 s cut the soak's runs short): about 15 s
# a step, twice that when a failure is shrunk; CKPTFS_MODEL_TIMEOUT sets it.
TIMEOUT = int(_KNOBS.get("CKPTFS_MODEL_TIMEOUT",
                         max(600, 15 * EXAMPLES * STEPS * (2 if SHRINK else 1))))
# Sync: at most this many states a store fault's failed steps may have left (in the
# store, or as one node may see it).
MAX_CANDIDATES = 8


@dataclass
class Context:
    """What one pytest test gives the machines it runs: a directory, a store kind."""

    base: Path
    kind: str
    durability: str
    seaweed: object | None
    examples: int = 0
    steps: int = 0

    def new_store(self, where: Path) -> StoreSpec:
        """A fresh store; an s3 one is reached through its own fault proxy (both nodes
        go through it: they share the store, and its outages)."""
        if self.kind == "local":
            root = where / "store"
            root.mkdir()
            return StoreSpec("local", f"file://{root}", root=root)
        proxy = FaultProxy(self.seaweed.s3_port)
        env = dict(self.seaweed.env())
        env["AWS_ENDPOINT_URL"] = proxy.endpoint_url
        return StoreSpec("s3", f"s3://{BUCKET}/model-{uuid.uuid4().hex[:12]}",
                         env=env, seaweed=self.seaweed, proxy=proxy)


class StoreFaults:
    """Puts the store both nodes share into an outage and ends it: an s3 store through
    its FaultProxy (refuse, 403, 503, hang are the proxy's own modes), a local one
    through the control file of the fault-injecting store every daemon is started with
    (refuse and 503 are both transient errors there, 403 AccessDenied, hang a call that
    blocks until the fault ends; torn -- every request's head reaches the server, never
    its body -- a transient error there; reset -- every write lands and its answer is
    lost)."""

    # A local store writes by rename: no write is ever torn there, a torn connection is
    # a dropped one.  reset: the proxy forwards a request, then resets the connection
    # during the answer -- a write that landed, its answer lost (lost_reply).
    LOCAL = {"refuse": "transient", "503": "transient", "403": "denied", "hang": "hang",
             "torn": "transient", "reset": "lost_reply"}

    def __init__(self, store: StoreSpec, control: Path, base_rules: list[dict]) -> None:
        self.store, self.control, self.base_rules = store, control, base_rules
        self._write(base_rules)

    def plan(self) -> dict:
        """CKPTFS_FAULTS for every daemon: the base rules, changeable through the file."""
        return {"rules": self.base_rules, "control_file": str(self.control)}

    def _write(self, rules: list[dict]) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rules": rules}))
        os.replace(tmp, self.control)

    def start(self, kind: str) -> None:
        if self.store.proxy is not None:
            self.store.proxy.mode = kind
            self.store.proxy.count_reset()     # bytes that pass during it: evidence
        else:
            self._write([{"kind": self.LOCAL[kind]}] + self.base_rules)

    def end(self) -> None:
        if self.store.proxy is not None:
            self.store.proxy.mode = "pass"
        else:
            self._write(self.base_rules)

    def close(self) -> None:
        if self.store.proxy is not None:
            self.store.proxy.close()


def _low_nofile() -> None:
    """In the ``ckptfs mount`` child: the descriptor limit its daemon inherits."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


CHUNK_FILE = re.compile(r"[0-9a-f]{64}")


class ModelFailure(AssertionError):
    pass


class ModelMachine(RuleBasedStateMachine):
    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self.ctx = ctx
        ctx.examples += 1
        self.dir = ctx.base / f"example-{ctx.examples}"
        self.dir.mkdir()
        self.store = ctx.new_store(self.dir)
        self.faults = StoreFaults(self.store, self.dir / "faults.json",
                                  [] if self.sync else ASYNC_FAULTS["rules"])
        self.fault: str | None = None         # the store's outage now
        # node -> the files (ids) it closed during the outage
        self.fault_saved: dict[int, set[int]] = {}
        self.candidates: list[Model] = []     # sync fault: the states failed steps allow
        # ... and what each node may answer from meanwhile (its own steps at once, the
        # other node's only once it reads them from the store, which is away)
        self.node_candidates: list[list[Model]] = [[], []]
        self.model = Model()
        self.closed: dict[str, str] = {}      # digest -> which version it is
        self.closed_list: list[tuple[str, bytes]] = []
        self.writers: dict[int, tuple[int, BgWriter]] = {}   # fid -> (mount, writer)
        self.readers: list[HeldReader] = []
        self.vid = 0
        self.unsynced: set[int] = set()       # async: mounts with closes not yet waited for
        self.history: list[str] = []
        self.generation = [0, 0]
        self.mounts: list[Mount] = []
        self.started: list[Mount] = []        # every mount begun, for teardown
        self.tmpfs: list[Path] = []           # state dirs mounted as a tmpfs
        self.full_node: int | None = None     # the node whose state dir is full
        try:
            for i in (0, 1):
                self.mounts.append(self._new_mount(i))
        except BaseException:
            # Hypothesis calls teardown only on a machine it got: a node that failed
            # to start must not leave the other's daemon, mount and tmpfs behind.
            self._stop_everything()
            raise

    # ------------------------------------------------------------------ plumbing

    @property
    def sync(self) -> bool:
        return self.ctx.durability == "sync"

    def _new_mount(self, i: int) -> Mount:
        self.generation[i] += 1
        mount = Mount(self.dir, self.store, f"{'AB'[i]}{self.generation[i]}")
        self.started.append(mount)
        if STATE_MIB:
            mount.state_dir.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STATE_MIB}m", "tmpfs",
                            str(mount.state_dir)], check=True)
            self.tmpfs.append(mount.state_dir)
        self._start(mount)
        return mount

    def _drop_tmpfs(self) -> None:
        """Unmount the tmpfs state dirs (daemons gone); each log is kept beside its
        state dir (``<name>-state.log/ckptfs.log``) for the log check and for KEEP."""
        for state in self.tmpfs:
            log = state / "ckptfs.log"
            if log.exists():
                keep = state.with_name(state.name + ".log")
                keep.mkdir(exist_ok=True)
                shutil.copyfile(log, keep / "ckptfs.log")
            subprocess.run(["umount", "-l", str(state)], check=False, capture_output=True)
        self.tmpfs.clear()

    def _start(self, mount: Mount) -> None:
        # gc's settle time is tiny here (recorded in the store by the first mount): with
        # the default 600 s, a gc pass that found chunks condemned by an earlier one
        # waited 10 minutes to delete them, and the step timed out.
        # Node A writes through the kernel where it can (passthrough, async), node B
        # through the daemon: both data paths meet in every example (decision 0019).
        data_path = ("--passthrough", "off") if mount.path.name.startswith("B") else ()
        mount.start("--metadata-ttl", str(TTL), "--chunk-size", CHUNK, "--gc-settle", "0.3",
                    "--store-timeout", str(STORE_TIMEOUT), *data_path,
                    durability=self.ctx.durability,
                    faults=self.faults.plan(), preexec_fn=_low_nofile if NOFILE else None)

    def _stop_everything(self) -> None:
        """Writers, daemons (every mount ever begun, also one whose start failed or
        that a step replaced), mounts, the fault proxy and the tmpfs state dirs."""
        for _, writer in self.writers.values():
            writer.kill()
        for reader in self.readers:
            reader.file.close()
        self.readers = []
        self.faults.end()
        for mount in self.started:
            if mount.pid:
                try:
                    mount.kill()
                except ProcessLookupError:
                    pass
            mount.cleanup()
        self.faults.close()
        self._drop_tmpfs()

    def teardown(self) -> None:
        self._stop_everything()
        # The logs are checked here, before the example's directory goes: the test's
        # own log check (logcheck.py) runs after every example is gone.
        allowed = [re.compile(p) for p in OUTAGE_ERRORS]
        problems = [f"{log.relative_to(self.dir)}:\n{record}"
                    for log in daemon_logs(self.dir)
                    for record in bad_records(log.read_text(errors="replace"), allowed)]
        if not KEEP:
            shutil.rmtree(self.dir, ignore_errors=True)
        if problems:
            self.fail("unexpected ERROR/Traceback in daemon log(s):\n" +
                      "\n---\n".join(problems))

    def note(self, text: str) -> None:
        self.ctx.steps += 1
        self.history.append(text)
        if VERBOSE:
            print(f"[model {self.ctx.examples}] {text}", file=sys.stderr, flush=True)

    def fail(self, text: str) -> None:
        steps = "\n".join(f"  {n + 1}. {s}" for n, s in enumerate(self.history))
        raise ModelFailure(f"{text}\nsteps so far:\n{steps}\n{self.log_excerpt()}"
                           f"{self.keep_first_failure(text, steps)}"
                           f"(state dirs and logs under {self.dir} when CKPTFS_MODEL_KEEP=1)")

    def _logs(self) -> list[Path]:
        """Every daemon log of this example: in each state dir (a tmpfs of its own, which
        a walk of the example's directory does not enter) or kept beside it."""
        found = []
        for mount in self.started:
            for log in (mount.state_dir / "ckptfs.log",
                        mount.state_dir.with_name(mount.state_dir.name + ".log") / "ckptfs.log"):
                if log.is_file() and log not in found:
                    found.append(log)
        return found

    def keep_first_failure(self, text: str, steps: str) -> str:
        """The first failing example's daemon logs, whole, beside the examples
        (``first-failure/``): hypothesis goes on to shrink, replays seldom fail the same
        way, and the example's own directory goes (seed 1215064: "wait said done", its
        logs gone)."""
        keep = self.dir.parent / "first-failure"
        try:
            keep.mkdir()
        except FileExistsError:
            return ""
        (keep / "failure.txt").write_text(f"{text}\nsteps:\n{steps}\n")
        for log in self._logs():
            shutil.copyfile(log, keep / f"{log.parent.name.removesuffix('.log')}.log")
        return f"(the first failure's daemon logs: {keep})\n"

    def log_excerpt(self, lines: int = 30) -> str:
        """Each daemon's last warnings, errors and rename lines: a failure a soak finds
        seldom comes back when replayed, and its logs go with its example's directory
        (seed 1202002: "after rename f0 -> f2 on B, f0 is still there", no log kept)."""
        notable = re.compile(r" (WARNING|ERROR|CRITICAL) |rename|lost a race|claim")
        out = []
        for log in self._logs():
            try:
                text = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            picked = [line for line in text if notable.search(line)][-lines:]
            if picked:
                out.append(f"{log.relative_to(self.dir)}, last notable lines:\n" +
                           "\n".join("    " + line for line in picked))
        return "\n".join(out) + "\n" if out else ""

    def new_version(self, size: int) -> tuple[int, bytes]:
        self.vid += 1
        return self.vid, version_bytes(self.vid, size)

    def closed_version(self, content: bytes, label: str) -> None:
        d = digest(content)
        if d not in self.closed:
            self.closed[d] = label
            self.closed_list.append((label, content))

    def abs(self, m: int, path: str) -> Path:
        return self.mounts[m].path / path

    def before_step(self, m: int | None) -> bool:
        """Whether node ``m`` may take an ordinary step now.  Async: a node acts on what
        others closed only after it is durable (``ckptfs wait``); a node's own unsynced
        steps stay pending (local-first).  During a store fault nothing can be waited
        for: an async node acts only if it needs nothing from the other one, and a sync
        node only through ``fault_step`` (which allows a step to fail)."""
        if self.sync or self.fault == "full":
            return self.fault is None
        others = self.unsynced if m is None else self.unsynced - {m}
        if others:
            if self.fault is not None:
                return False
            self.sync_all()
        return True

    def sync_all(self, candidates: list[Model] | None = None) -> None:
        for i, mount in enumerate(self.mounts):
            proc = run_ckptfs("wait", str(mount.path), timeout=300)
            if proc.returncode:
                self.fail(f"`ckptfs wait` on mount {'AB'[i]} failed: {proc.stderr.strip()}")
        self.unsynced.clear()
        self.converge(None, candidates)

    # ------------------------------------------------------------------ checking

    def safety(self, i: int, obs: Observation, models: list[Model]) -> None:
        partials = set().union(*(m.partials(i) for m in models))
        for path, seen in sorted(obs.tree.items()):
            if seen[0] != "file":
                continue
            data = seen[1]
            if digest(data) in self.closed or data in partials:
                continue
            self.fail(f"SAFETY: mount {'AB'[i]} shows {path!r} as "
                      f"{describe(data, self.closed)}")

    def diff(self, i: int, obs: Observation, model: Model) -> str:
        want = model.view(i)
        lines = []
        for path in sorted(set(want) | set(obs.tree)):
            w, o = want.get(path), obs.tree.get(path)
            if same(w, o):
                continue
            lines.append(f"    {path!r}: expected {self.show(w)}, shows {self.show(o)}")
        if obs.unstable:
            lines.append(f"    (walk unstable: {obs.unstable})")
        return "\n".join(lines)

    def show(self, seen: tuple | None) -> str:
        if seen is None:
            return "nothing"
        if seen[0] == "file":
            _, data, mode, mtime, owner, xattrs = seen
            return (f"{describe(data, self.closed)}, mode {mode:04o}"
                    f"{'' if mtime is None else f', mtime_ns {mtime}'}"
                    f"{'' if owner == NEW_FILE_OWNER else f', owner {owner[0]}:{owner[1]}'}"
                    f"{'' if not xattrs else f', xattrs {dict(xattrs)}'}")
        return " ".join(str(s) for s in seen)

    def check(self, acting: int | None) -> None:
        """After a step: sync durability converges now; async checks safety everywhere
        and the acting node exactly, and converges at the next sync."""
        if acting is not None:
            self.unsynced.add(acting)
        if self.sync:
            self.converge(acting)
            return
        for i, mount in enumerate(self.mounts):
            if self.fault is not None and i != acting:
                # a node that did nothing in the outage may have to ask the store: it
                # may fail (EIO), never show a wrong content
                self.safety(i, observe(mount.path), [self.model])
                continue
            obs = self.stable_observe(i)
            self.safety(i, obs, [self.model])
            if i == acting and not matches(obs.tree, self.model.view(i)):
                self.fail(f"mount {'AB'[i]} does not show its own step:\n"
                          f"{self.diff(i, obs, self.model)}")

    def stable_observe(self, i: int) -> Observation:
        for _ in range(50):
            obs = observe(self.mounts[i].path)
            if not obs.unstable:
                return obs
            time.sleep(0.05)
        return obs

    def converge(self, acting: int | None, candidates: list[Model] | None = None) -> None:
        models = candidates or [self.model]
        start = time.monotonic()
        settle_until, deadline = start + SETTLE, start + CONVERGE
        first = True
        while True:
            seen = {}
            for i in range(len(self.mounts)):
                obs = self.stable_observe(i) if first and i == acting else \
                    observe(self.mounts[i].path)
                self.safety(i, obs, models)
                seen[i] = obs
                if first and i == acting and len(models) == 1 and \
                        not matches(obs.tree, models[0].view(i)):
                    self.fail(f"mount {'AB'[i]} does not show its own step:\n"
                              f"{self.diff(i, obs, models[0])}")
            first = False
            matching = [m for m in models
                        if all(not o.unstable and matches(o.tree, m.view(i))
                               for i, o in seen.items())]
            now = time.monotonic()
            if matching and now >= settle_until:
                self.model = matching[0]
                return
            if now > deadline:
                text = []
                for n, m in enumerate(models):
                    text.append(f"  candidate {n + 1}:" if len(models) > 1 else "")
                    for i, obs in seen.items():
                        d = self.diff(i, obs, m)
                        if d:
                            text.append(f"   mount {'AB'[i]}:\n{d}")
                self.fail(f"NO CONVERGENCE within {CONVERGE:.0f} s:\n" +
                          "\n".join(t for t in text if t))
            time.sleep(0.05)

    # ------------------------------------------------------------------ choosing names

    def free_files(self, m: int) -> list[str]:
        """Existing files nobody holds open (or held open on ``m`` itself)."""
        return [p for p in self.model.file_paths() if self.model.busy(p) in (None,)]

    def new_file_paths(self) -> list[str]:
        out = []
        for d in [""] + self.model.dirs():
            for name in FILE_NAMES:
                path = f"{d}/{name}" if d else name
                if path not in self.model.tree:
                    out.append(path)
        return out

    def new_dir_paths(self, exclude: str | None = None) -> list[str]:
        out = []
        for d in [""] + self.model.dirs():
            if exclude is not None and (d == exclude or d.startswith(exclude + "/")):
                continue
            if d.count("/") >= 1:
                continue
            for name in DIR_NAMES:
                path = f"{d}/{name}" if d else name
                if path not in self.model.tree:
                    out.append(path)
        return out

    def pick(self, data, options: list, label: str):
        """Draw one of ``options``; None when there is none (the step does nothing)."""
        if not options:
            return None
        return data.draw(st.sampled_from(sorted(options)), label=label)

    # ------------------------------------------------------------------ rules: saves

    @rule(data=st.data(), m=st.integers(0, 1), size=st.sampled_from(SIZES),
          how=st.sampled_from([h for h in ("plain", "fsync", "subprocess", "exit")
                               if h not in SKIP]))
    def file_save(self, data, m, size, how):
        """create or overwrite (O_TRUNC) + write + close a new version; with a fsync or a
        subprocess in the middle of the save, every node is checked mid-save; or a
        process that saves it and exits holding it open twice (the kernel's flushes
        come before its releases: a hostile run's sqlite lost its database so)."""
        if not self.before_step(m):
            return
        path = self.pick(data, self.free_files(m) + self.new_file_paths(), "path")
        if path is None:
            return
        vid, content = self.new_version(size)
        if how == "exit" and self.fault is None:
            self.exit_holding_twice(m, path, content, f"v{vid}")
            return
        self.write_file(m, path, content, f"v{vid}", "plain" if how == "exit" else how, data)

    def exit_holding_twice(self, m: int, path: str, content: bytes, label: str) -> None:
        self.note(f"{'AB'[m]}: save {path} = {label} ({len(content)} B, by a process that "
                  f"exits holding it open twice)")
        proc = subprocess.run([sys.executable, "-c", EXIT_HOLDING_TWICE,
                               str(self.abs(m, path)), oct(CREATE_MODE)], input=content)
        if proc.returncode != 0:
            self.fail(f"the saving process exited with {proc.returncode}")
        self.model.write(path, content)
        self.closed_version(content, label)
        self.check(m)

    @precondition(lambda self: self.closed_list)
    @rule(data=st.data(), m=st.integers(0, 1))
    def file_save_earlier(self, data, m):
        """Save bytes equal to an earlier version (dedup: its chunks exist already, or
        existed before gc)."""
        if not self.before_step(m):
            return
        path = self.pick(data, self.free_files(m) + self.new_file_paths(), "path")
        if path is None:
            return
        n = data.draw(st.integers(0, len(self.closed_list) - 1), label="earlier")
        label, content = self.closed_list[n]
        self.write_file(m, path, content, f"again {label}", "plain", data)

    def write_file(self, m: int, path: str, content: bytes, label: str, how: str,
                   data) -> None:
        self.note(f"{'AB'[m]}: save {path} = {label} ({len(content)} B, {how})")
        target = self.abs(m, path)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CREATE_MODE)
        try:
            split = len(content)
            if how != "plain":
                pieces = -(-len(content) // PIECE)
                split = min(len(content), PIECE * data.draw(st.integers(0, pieces), label="at"))
            self._write_all(fd, content[:split])
            if how != "plain":
                if how == "fsync":
                    os.fsync(fd)
                else:
                    subprocess.run(["true"], check=True)
                fid = self.model.open_writer(path, m, content)
                self.model.files[fid].written = split
                self.note(f"{'AB'[m]}:   ... {how} after {split} B, file still open")
                self.check(m)
            self._write_all(fd, content[split:])
        finally:
            try:
                os.close(fd)
            except OSError as exc:
                self.fail(f"close of {path} on {'AB'[m]} failed: {exc}")
        if how != "plain":
            self.model.close_writer(self.model.fid_at(path))
        else:
            self.model.write(path, content)
        self.closed_version(content, label)
        fid = self.model.fid_at(path)
        if self.fault is not None and fid is not None:
            self.fault_saved.setdefault(m, set()).add(fid)
        self.check(m)

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    @precondition(lambda self: self.model.file_paths())
    @rule(data=st.data(), m=st.integers(0, 1), size=st.sampled_from(TRUNCATE_SIZES))
    def file_truncate(self, data, m, size):
        if not self.before_step(m):
            return
        options = self.free_files(m)
        path = self.pick(data, options, "path")
        if path is None:
            return
        self.note(f"{'AB'[m]}: truncate {path} to {size}")
        os.truncate(self.abs(m, path), size)
        self.model.truncate(path, size)
        content = self.model.files[self.model.fid_at(path)].content
        self.closed_version(content, f"{path} truncated to {size}")
        self.check(m)

    # ------------------------------------------------------------------ rules: attributes

    def closed_files(self, m: int) -> list[str]:
        """Files with a closed version that no writer holds open."""
        return [p for p in self.free_files(m)
                if self.model.files[self.model.fid_at(p)].content is not None]

    @precondition(lambda self: self.model.file_paths() and "attrs" not in SKIP)
    @rule(data=st.data(), m=st.integers(0, 1),
          what=st.sampled_from(["chmod", "chmod", "utime", "chown", "xattr"]))
    def file_attrs(self, data, m, what):
        """chmod, os.utime to an explicit mtime, chown or a user.* setxattr (or its
        removal) of a closed file: its node shows it at once, every node converges to it;
        a save over the file keeps its mode, owner and extended attributes, a rename
        carries them.  In a sync store fault (or with the state dir full) it goes through
        ``fault_act``: it succeeds, or fails with EIO and then happened or not, never
        half; async, it succeeds on its node and lands after the outage."""
        outage = self.fault is not None and (self.sync or self.fault == "full")
        if outage:
            if self.fault == "full":
                m = self.full_node
            if max(len(self.candidates), *map(len, self.node_candidates)) > MAX_CANDIDATES:
                return
        elif not self.before_step(m):
            return
        path = self.pick(data, self.closed_files(m), "path")
        if path is None:
            return
        if what == "chmod":
            mode = data.draw(st.sampled_from(MODES), label="mode")
            op, text = ("chmod", path, mode), f"chmod {mode:04o} {path}"
        elif what == "utime":
            mtime = data.draw(st.sampled_from(MTIMES), label="mtime_ns")
            op, text = ("utime", path, mtime), f"utime {path} mtime_ns={mtime}"
        elif what == "chown":
            uid, gid = data.draw(st.sampled_from(OWNERS), label="owner")
            op, text = ("chown", path, uid, gid), f"chown {uid}:{gid} {path}"
        else:
            name, value = data.draw(st.sampled_from(XATTRS), label="xattr")
            op, text = ("setxattr", path, name, value), _xattr_text(path, name, value)
        if outage:
            self.fault_act(m, op, text)
            return
        self.note(f"{'AB'[m]}: {text}")
        want = self.model.copy().apply(op)
        try:
            self.do(m, op)
        except OSError as exc:
            if exc.errno != want or not want:
                self.fail(f"{text} on {'AB'[m]} failed: {exc}; the model gives "
                          f"{errno.errorcode.get(want, 'success')}")
        else:
            if want:
                self.fail(f"{text} on {'AB'[m]} succeeded; the model gives "
                          f"{errno.errorcode[want]}")
        assert self.model.apply(op) == want
        if self.fault is not None:
            # async: a change made in the outage is pending like a closed file
            self.fault_saved.setdefault(m, set()).add(self.model.fid_at(path))
        self.check(m)

    # ------------------------------------------------------------------ rules: names

    def movable(self, m: int, paths: list[str]) -> list[str]:
        return [p for p in paths if self.model.busy(p) in (None, m)]

    @precondition(lambda self: self.model.file_paths())
    @rule(data=st.data(), m=st.integers(0, 1))
    def file_rename(self, data, m):
        if not self.before_step(m):
            return
        sources = self.movable(m, self.model.file_paths())
        if not sources:
            return
        src = self.pick(data, sources, "src")
        if src is None:
            return
        targets = [p for p in self.free_files(m) if p != src] + self.new_file_paths()
        dst = self.pick(data, targets, "dst")
        if dst is None:
            return
        if not self.sync and self.model.holds_on_rename(src, dst) and self.unsynced:
            # Async: whether the store has dst's last closed version yet (the one the
            # name holds on to) is a race the model cannot call; durable first -- which
            # cannot be in a store fault (`wait` would wait for its end): not now.
            if self.fault is not None:
                return
            self.sync_all()
        if self.fault is not None and self.model.needs_store(("rename", src, dst)):
            self.store_step_in_outage(m, ("rename", src, dst), f"rename {src} -> {dst}")
            return
        self.note(f"{'AB'[m]}: rename {src} -> {dst}")
        os.rename(self.abs(m, src), self.abs(m, dst))
        assert self.model.rename(src, dst) == 0
        self.check(m)

    @precondition(lambda self: self.model.dirs())
    @rule(data=st.data(), m=st.integers(0, 1))
    def tree_rename_dir(self, data, m):
        if not self.before_step(m):
            return
        sources = self.movable(m, self.model.dirs())
        if not sources:
            return
        src = self.pick(data, sources, "src")
        if src is None:
            return
        empty = [d for d in self.model.dirs() if d != src and not self.model.children(d)
                 and not d.startswith(src + "/") and parent_of(src) != d]
        targets = self.new_dir_paths(exclude=src) + empty
        if not targets:
            return
        dst = self.pick(data, targets, "dst")
        if dst is None:
            return
        self.note(f"{'AB'[m]}: rename dir {src} -> {dst}")
        os.rename(self.abs(m, src), self.abs(m, dst))
        assert self.model.rename(src, dst) == 0
        self.check(m)

    @precondition(lambda self: self.model.file_paths())
    @rule(data=st.data(), m=st.integers(0, 1))
    def file_unlink(self, data, m):
        if not self.before_step(m):
            return
        options = self.movable(m, self.model.file_paths())
        if not options:
            return
        path = self.pick(data, options, "path")
        if path is None:
            return
        if self.fault is not None and self.model.needs_store(("unlink", path)):
            # (soak seed 1215472: the unlink of a linked name in a hang answered EIO)
            self.store_step_in_outage(m, ("unlink", path), f"unlink {path}")
            return
        self.note(f"{'AB'[m]}: unlink {path}")
        os.unlink(self.abs(m, path))
        assert self.model.unlink(path) == 0
        self.check(m)

    @precondition(lambda self: self.model.file_paths() and "link" not in SKIP)
    @rule(data=st.data(), m=st.integers(0, 1))
    def file_link(self, data, m):
        """A hard link to a closed file: every name shows the file's content and
        attributes, a save through one name shows through all of them, and a file goes
        only with its last name -- on every node."""
        if not self.before_step(m):
            return
        src = self.pick(data, self.closed_files(m), "src")
        if src is None:
            return
        dst = self.pick(data, self.new_file_paths(), "dst")
        if dst is None:
            return
        if self.fault is not None:
            self.store_step_in_outage(m, ("link", src, dst), f"link {src} {dst}")
            return
        self.note(f"{'AB'[m]}: link {src} {dst}")
        os.link(self.abs(m, src), self.abs(m, dst))
        assert self.model.link(src, dst) == 0
        self.check(m)

    def store_step_in_outage(self, m: int, op: tuple, text: str) -> None:
        """Async, during a store fault, a step that goes to the store at once (a hard
        link, the rename or unlink of a hard-linked name): it succeeds, or answers EIO (or
        ETIMEDOUT) and nothing changed -- on this node now, in the store and on every
        node after the outage (README: "else EIO and nothing changed")."""
        self.note(f"{'AB'[m]}: {text} (store away)")
        try:
            self.do(m, op)
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.ETIMEDOUT):
                self.fail(f"{text} on {'AB'[m]} during a store fault: {exc}")
            self.note(f"{'AB'[m]}:   ... {errno.errorcode[exc.errno]}: nothing changed")
        else:
            self.note(f"{'AB'[m]}:   ... ok")
            assert self.model.apply(op) == 0
            fid = self.model.fid_at(op[2]) if len(op) > 2 else None   # the new name:
            if fid is not None:                                      # a link's, a rename's
                self.fault_saved.setdefault(m, set()).add(fid)
        self.check(m)

    @precondition(lambda self: len(self.model.dirs()) < 4)
    @rule(data=st.data(), m=st.integers(0, 1))
    def tree_mkdir(self, data, m):
        if not self.before_step(m):
            return
        options = self.new_dir_paths()
        if not options:
            return
        path = self.pick(data, options, "path")
        if path is None:
            return
        self.note(f"{'AB'[m]}: mkdir {path}")
        os.mkdir(self.abs(m, path))
        assert self.model.mkdir(path) == 0
        self.check(m)

    @precondition(lambda self: self.model.dirs())
    @rule(data=st.data(), m=st.integers(0, 1))
    def tree_rmdir(self, data, m):
        if not self.before_step(m):
            return
        options = [d for d in self.model.dirs() if not self.model.children(d)]
        if not options:
            return
        path = self.pick(data, options, "path")
        if path is None:
            return
        self.note(f"{'AB'[m]}: rmdir {path}")
        os.rmdir(self.abs(m, path))
        assert self.model.rmdir(path) == 0
        self.check(m)

    # ------------------------------------------------------------------ rules: open writers

    @precondition(lambda self: len(self.writers) < 2)
    @rule(data=st.data(), m=st.integers(0, 1), size=st.sampled_from(SIZES[1:]),
          first=st.integers(0, 3))
    def writer_open(self, data, m, size, first):
        """A writer process opens (O_CREAT|O_TRUNC) and writes ``first`` pieces, then
        holds the file open across the next steps."""
        if not self.before_step(m):
            return
        path = self.pick(data, self.free_files(m) + self.new_file_paths(), "path")
        if path is None:
            return
        vid, content = self.new_version(size)
        self.note(f"{'AB'[m]}: writer opens {path} for v{vid} ({size} B), writes "
                  f"{first} piece(s)")
        writer = BgWriter(self.abs(m, path), vid, size)
        fid = self.model.open_writer(path, m, content)
        self.writers[fid] = (m, writer)
        if first:
            writer.command(f"write {first}")
        self.model.files[fid].written = writer.written
        self.check(m)

    @precondition(lambda self: self.writers)
    @rule(data=st.data(), action=st.sampled_from(
        [a for a in ("write 1", "write 3", "fsync", "sub")
         if not ({"fsync": "fsync", "sub": "subprocess"}.get(a) in SKIP)]))
    def writer_step(self, data, action):
        """An open writer writes more, fsyncs, or runs a subprocess (which closes its
        close-on-exec copy of the descriptor)."""
        fid = data.draw(st.sampled_from(sorted(self.writers)), label="writer")
        m, writer = self.writers[fid]
        if not self.before_step(m):
            return
        self.note(f"{'AB'[m]}: writer of v{writer.vid}: {action}")
        writer.command(action)
        self.model.files[fid].written = writer.written
        self.check(m)

    @precondition(lambda self: self.writers)
    @rule(data=st.data())
    def writer_close(self, data):
        fid = data.draw(st.sampled_from(sorted(self.writers)), label="writer")
        m, writer = self.writers[fid]
        if not self.before_step(m):
            return
        del self.writers[fid]
        self.note(f"{'AB'[m]}: writer of v{writer.vid} finishes and closes")
        writer.command("close")
        content = self.model.files[fid].pending
        self.model.close_writer(fid)
        self.closed_version(content, f"v{writer.vid}")
        if self.fault is not None:
            self.fault_saved.setdefault(m, set()).add(fid)
        self.check(m)
        joined = [r for r in self.readers if r.joined == fid]
        for reader in joined:
            reader.joined, reader.expected = None, content
        if joined and not self.sync:
            # The next save of the name beside a reader that joined this one through
            # the kernel goes on once this version is in the store (else EBUSY,
            # decision 0019): durable first; in an outage the readers finish now.
            if self.fault is None:
                self.sync_all()
            else:
                for reader in joined:
                    self.finish_reader(reader)

    @precondition(lambda self: self.writers and "kill" not in SKIP)
    @rule(data=st.data())
    def writer_kill(self, data):
        fid = data.draw(st.sampled_from(sorted(self.writers)), label="writer")
        m, writer = self.writers[fid]
        if not self.before_step(m):
            return
        del self.writers[fid]
        self.note(f"{'AB'[m]}: writer of v{writer.vid} SIGKILLed after {writer.written} B")
        writer.kill()
        self.model.lose_writer(fid)
        for reader in [r for r in self.readers if r.joined == fid]:
            self.readers.remove(reader)    # it read a version that was never closed
            reader.file.close()
        self.check(m)

    # ------------------------------------------------------------------ rules: readers

    @precondition(lambda self: len(self.readers) < 2 and self.fault is None
                  and "readers" not in SKIP)
    @rule(data=st.data(), m=st.integers(0, 1))
    def reader_open(self, data, m):
        """A reader opens a file and holds it across the next steps (a watcher loading
        ``latest.pt`` while the trainer saves it again): until it closes it reads the
        version it opened (DESIGN.md promise 2), whatever is saved over, renamed over or
        removed meanwhile.  Opened while a writer on its node writes the file, it reads
        that writer's version (through the kernel on node A: it joins the save's
        staging file, decision 0019)."""
        if not self.before_step(m):
            return
        joinable = [f for f, (wm, _) in self.writers.items() if wm == m]
        paths = [p for p in self.model.file_paths()
                 if self.model.fid_at(p) in joinable or
                 (self.model.fid_at(p) not in self.writers and
                  self.model.files[self.model.fid_at(p)].content is not None)]
        path = self.pick(data, paths, "path")
        if path is None:
            return
        fid = self.model.fid_at(path)
        self.check(m)           # its node shows the model's version of it now
        joined = fid if fid in joinable else None
        self.note(f"{'AB'[m]}: reader opens {path}"
                  f"{' while its writer writes' if joined else ''}")
        handle = open(self.abs(m, path), "rb")
        first = handle.read()
        if joined is None and digest(first) not in self.closed:
            handle.close()
            self.fail(f"a reader of {path} on {'AB'[m]} read no version ever closed "
                      f"({len(first)} B)")
        self.readers.append(HeldReader(m, path, handle, None if joined else first, joined))

    @precondition(lambda self: self.readers and self.fault is None)
    @rule(data=st.data())
    def reader_close(self, data):
        reader = data.draw(st.sampled_from(self.readers), label="reader")
        if reader.joined is not None:
            return               # its writer is still open: its version is not closed
        self.finish_reader(reader)

    def finish_reader(self, reader: "HeldReader") -> None:
        """Read the held file again from its start, then close it: the bytes of the
        version it opened."""
        self.readers.remove(reader)
        self.note(f"{'AB'[reader.m]}: reader of {reader.path} reads it all again and "
                  f"closes")
        try:
            reader.file.seek(0)
            got = reader.file.read()
        finally:
            reader.file.close()
        if got != reader.expected:
            label = self.closed.get(digest(got), "no closed version")
            want = self.closed.get(digest(reader.expected or b""), "?")
            self.fail(f"a reader held open on {'AB'[reader.m]} read {reader.path} as "
                      f"{label} ({len(got)} B), not the version it opened, {want}")

    # ------------------------------------------------------------------ rules: nodes

    def _kill_node(self, m: int) -> None:
        for reader in [r for r in self.readers if r.m == m]:
            self.readers.remove(reader)
            try:
                reader.file.close()
            except OSError:
                pass       # its daemon is gone (ENOTCONN): nothing to check
        self.mounts[m].kill()
        for fid, (wm, writer) in sorted(self.writers.items()):
            if wm == m:
                writer.kill()
                del self.writers[fid]
                self.model.lose_writer(fid)

    @precondition(lambda self: self.fault is None and "rot" not in SKIP)
    @rule(data=st.data(), m=st.integers(0, 1))
    def cache_rot(self, data, m):
        """One byte of a chunk in node ``m``'s cache rots on disk; the daemon restarts
        (SIGKILL: open writers on it lose their file).  Every read must still give the
        model's bytes (a daemon checks a cache file once per lifetime before serving
        it)."""
        if not self.before_step(m):
            return
        # What the cache holds is the daemon's business (not the model's): the draws do
        # not depend on it, so hypothesis can replay and shrink an example.
        which = data.draw(st.integers(0, 1 << 16), label="chunk")
        where = data.draw(st.integers(0, 1 << 16), label="at")
        cache = self.mounts[m].state_dir / "cache"
        chunks = sorted(p for p in cache.glob("??/*")
                        if CHUNK_FILE.fullmatch(p.name) and p.stat().st_size > 0)
        if not chunks:
            self.note(f"{'AB'[m]}: no cached chunk to rot")
            return
        path = chunks[which % len(chunks)]
        name = path.name
        at = where % path.stat().st_size
        self.note(f"{'AB'[m]}: byte {at} of cached chunk {name[:12]} rots; daemon "
                  f"SIGKILLed and restarted")
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        self._kill_node(m)
        self._start(self.mounts[m])
        self.check(m)

    @precondition(lambda self: self.fault is None and "restart" not in SKIP)
    @rule(m=st.integers(0, 1))
    def node_restart(self, m):
        """SIGKILL the daemon (open writers on it lose their file) and start it again on
        the same state dir."""
        if not self.before_step(m):
            return
        self.note(f"{'AB'[m]}: daemon SIGKILLed and restarted")
        self._kill_node(m)
        self._start(self.mounts[m])
        self.check(m)

    @precondition(lambda self: self.fault is None and "replace" not in SKIP)
    @rule(m=st.integers(0, 1))
    def node_replace(self, m):
        """A fresh node (new state dir) replaces one.  Async: what the old node closed is
        waited for first (a node whose state is thrown away loses its pending uploads by
        design)."""
        if not self.sync:
            self.sync_all()
        self.note(f"{'AB'[m]}: node replaced by a fresh mount")
        self._kill_node(m)
        self.mounts[m] = self._new_mount(m)
        self.check(m)

    @precondition(lambda self: self.fault is None and not self.writers and not self.readers
                  and "gc" not in SKIP)
    @rule(m=st.integers(0, 1))
    def node_gc(self, m):
        """``ckptfs gc --grace 0`` with no writer open (a younger grace protects chunks of
        unfinished saves; with none open, everything unreferenced is garbage)."""
        if not self.sync:
            self.sync_all()
        self.note(f"{'AB'[m]}: ckptfs gc --grace 0")
        run_ckptfs("gc", str(self.mounts[m].path), "--grace", "0", check=True)
        self.check(None)

    @precondition(lambda self: self.fault is None and not self.sync)
    @rule()
    def wait_all(self):
        self.note("ckptfs wait on every node")
        self.sync_all()

    # ------------------------------------------------------------------ rules: store faults

    @precondition(lambda self: self.fault is None and FAULT_KINDS)
    @rule(kind=st.sampled_from(FAULT_KINDS or ["none"]))
    def fault_start(self, kind):
        """The store both nodes share goes away (refuse, 403, 503, hang, torn, reset) until
        ``fault_end``.  Async: every step on a node goes on locally; sync: a step may fail
        with EIO, and then either happened or did not -- never half."""
        # Every node lists every directory first: a node that never listed one cannot
        # know, with the store away, whether a name exists there (EIO, by design).
        for i, mount in enumerate(self.mounts):
            self.safety(i, self.stable_observe(i), [self.model])
        self.note(f"store fault starts: {kind}")
        self.fault = kind
        self.fault_saved = {}
        self.candidates = [self.model]
        self.node_candidates = [[self.model], [self.model]]
        self.faults.start(kind)

    @precondition(lambda self: self.fault is None and STATE_MIB and "full" not in SKIP)
    @rule(m=st.integers(0, 1))
    def state_full(self, m):
        """Node ``m``'s state dir fills up (another program's file takes every byte of
        its file system) until ``fault_end``; meanwhile only ``fault_step`` acts, on that
        node: a step succeeds or fails with ENOSPC (or EIO), and then did not happen."""
        if not self.before_step(m):
            return
        self.note(f"{'AB'[m]}: state dir full")
        self.fault, self.full_node = "full", m
        self.fault_saved = {}
        self.candidates = [self.model]
        self.node_candidates = [[self.model], [self.model]]
        fill_file_system(self.mounts[m].state_dir)

    @precondition(lambda self: self.fault is not None
                  and (self.sync or self.fault == "full")
                  and max(len(self.candidates), *map(len, self.node_candidates))
                  <= MAX_CANDIDATES)
    @rule(data=st.data(), m=st.integers(0, 1), what=st.sampled_from(
        ["save", "save", "rename", "unlink", "mkdir", "rmdir"]))
    def fault_step(self, data, m, what):
        """Sync with the store away, or a full state dir on node ``m`` (then only that
        node acts): one step; it succeeds (then it happened) or fails with EIO or ENOSPC
        (then it happened or not); any other answer must be the one the model gives."""
        if self.fault == "full":
            m = self.full_node
        model = self.model
        if what == "save":
            path = self.pick(data, self.free_files(m) + self.new_file_paths(), "path")
            if path is None:
                return
            vid, content = self.new_version(data.draw(st.sampled_from(SIZES), label="size"))
            self.closed_version(content, f"v{vid}")
            op, text = ("write", path, content), f"save {path} = v{vid} ({len(content)} B)"
        elif what in ("rename", "unlink"):
            src = self.pick(data, self.movable(m, model.file_paths()), "src")
            if src is None:
                return
            if what == "unlink":
                op = ("unlink", src)
            else:
                dst = self.pick(data, [p for p in self.free_files(m) if p != src and
                                       (self.sync or not model.holds_on_rename(src, p))] +
                                self.new_file_paths(), "dst")
                if dst is None:
                    return
                op = ("rename", src, dst)
            text = " ".join(op)
        elif what == "mkdir":
            path = self.pick(data, self.new_dir_paths(), "path")
            if path is None:
                return
            op = ("mkdir", path)
            text = f"mkdir {path}"
        else:
            path = self.pick(data, [d for d in model.dirs() if not model.children(d)],
                             "path")
            if path is None:
                return
            op = ("rmdir", path)
            text = f"rmdir {path}"
        self.fault_act(m, op, text)

    def fault_act(self, m: int, op: tuple, text: str) -> None:
        """``op`` on node ``m`` during a sync store fault or with its state dir full: what
        each node and the store may be in afterwards (``after_fault_step``)."""
        self.note(f"{'AB'[m]}: {text} ({'state dir full' if self.fault == 'full' else 'store away'})")
        try:
            self.do(m, op)
            result = 0
        except OSError as exc:
            result = exc.errno
        name = errno.errorcode.get(result, str(result)) if result else "ok"
        self.note(f"{'AB'[m]}:   ... {name}")
        failed = result in (errno.EIO, errno.ETIMEDOUT, errno.ENOSPC)
        self.candidates = self.after_fault_step(self.candidates, op, result, "store")
        for i in range(len(self.mounts)):
            self.node_candidates[i] = self.after_fault_step(
                self.node_candidates[i], op, result, "own" if i == m else "other")
        for where, models in [("the store", self.candidates),
                              (f"node {'AB'[m]}", self.node_candidates[m])]:
            if not models:
                self.fail(f"{text} on {'AB'[m]} during a store fault gave {name}, which no "
                          f"state the model allows {where} to be in gives"
                          f"{' (it failed: it may or may not have happened)' if failed else ''}")
        self.model = self.candidates[-1]
        for i, mount in enumerate(self.mounts):
            self.safety(i, observe(mount.path), self.candidates + self.node_candidates[i])

    def do(self, m: int, op: tuple) -> None:
        """The model operation ``op`` (``Model.apply``'s) on node ``m``'s mount."""
        kind, path, *args = op
        if kind == "write":
            save(self.abs(m, path), args[0])
        elif kind == "rename":
            os.rename(self.abs(m, path), self.abs(m, args[0]))
        elif kind == "link":
            os.link(self.abs(m, path), self.abs(m, args[0]))
        elif kind == "chmod":
            os.chmod(self.abs(m, path), args[0])
        elif kind == "utime":
            os.utime(self.abs(m, path), ns=(args[0], args[0]))
        elif kind == "chown":
            os.chown(self.abs(m, path), args[0], args[1])
        elif kind == "setxattr" and args[1] is None:
            os.removexattr(self.abs(m, path), args[0])
        elif kind == "setxattr":
            os.setxattr(self.abs(m, path), args[0], args[1])
        else:
            getattr(os, kind)(self.abs(m, path))

    @staticmethod
    def after_fault_step(models: list[Model], op: tuple, result: int,
                         whose: str) -> list[Model]:
        """The states ``models`` may be in after a step during a sync store fault (or a
        full state dir) that answered ``result`` (0, or an errno):

        - ``own``, what the acting node answers from: the step happened if it
          succeeded, happened or not if it failed with EIO/ETIMEDOUT/ENOSPC, and any
          other answer is the one the state gives;
        - ``other``, what the other node may answer from: with the store away it may
          not have read a step yet, so a step that succeeded or may have happened
          both did and did not; a step refused with another errno did nothing;
        - ``store``, what every node converges to once the fault ends: a step that
          succeeded happened (a save that failed is kept by its node and lands later,
          so a rename of it succeeds there); one refused with another errno did
          nothing -- the answer came from the acting node's view, which may lag the
          store, so it rules out nothing here."""
        failed = result in (errno.EIO, errno.ETIMEDOUT, errno.ENOSPC)
        out: list[Model] = []
        for c in models:
            done = c.copy()
            rc = done.apply(op)
            if failed or (whose == "other" and result == 0):
                out += [c] if rc else [c, done]
            elif result == 0:
                out += [done] if rc == 0 else []
            elif whose == "own":
                out += [done] if rc == result else []
            else:
                out.append(c)
        unique: list[Model] = []
        for c in out:
            if not any(c.tree == u.tree and c.view(0) == u.view(0) for u in unique):
                unique.append(c)
        return unique

    @precondition(lambda self: self.fault is not None)
    @rule()
    def fault_end(self):
        """The store answers again.  Async: a node that closed a file during the outage,
        still there, must not say done before (``ckptfs wait`` non-zero, status names the
        outage);
        after it, everything reaches the store and every node converges.  Sync: every
        node converges to one of the states the failed steps allow."""
        kind, self.fault = self.fault, None
        if kind == "full":
            m, self.full_node = self.full_node, None
            self.note(f"{'AB'[m]}: state dir has room again")
            (self.mounts[m].state_dir / "filler").unlink()
            self.unsynced.add(m)
        else:
            if not self.sync:
                for i in sorted(self.unsynced):
                    # A file closed then removed during the outage leaves nothing to
                    # publish (seed 1215070: save f1, unlink f1, and `wait` was right).
                    if any(self.model.path_of(fid) is not None
                           for fid in self.fault_saved.get(i, ())):
                        self.pending_during_outage(i, kind)
            self.note(f"store fault ends ({kind})")
            self.faults.end()
        candidates, self.candidates = self.candidates, []
        if self.sync:
            self.converge(None, candidates)
        else:
            self.sync_all(candidates)

    def pending_during_outage(self, i: int, kind: str) -> None:
        root = str(self.mounts[i].path)
        proc = run_ckptfs("wait", root, "--timeout", "3", timeout=120)
        if proc.returncode == 0:
            # Evidence for seeds 1215064 and 1215156 (not reproduced by replaying them):
            # what the node published, what the store saw, what passed the proxy.
            doc = json.loads(run_ckptfs("status", "--json", root).stdout or "{}")
            fs = doc.get("fs", {})
            proxy = self.faults.store.proxy
            evidence = {"fs": {k: fs.get(k) for k in (
                "publishes", "publish_failures", "pending_uploads", "failing_uploads",
                "pending_metadata", "store_unavailable", "chunks_uploaded",
                "chunks_deduplicated", "open_handles")},
                "store_stats": doc.get("store_stats"), "fuse_requests":
                doc.get("fuse_requests"), "data_path": doc.get("data_path"),
                "proxy_bytes_since_fault": None if proxy is None else
                [proxy.bytes_up, proxy.bytes_down]}
            self.fail(f"`ckptfs wait` on {'AB'[i]} said done while the store was away "
                      f"({kind}) and it had closed files since; {json.dumps(evidence)}")
        # A node learns the store is away from a request that fails: in a hang, not
        # before its first request times out (store_timeout), which may be after the
        # 3 s above when the file was closed just now.
        deadline = time.monotonic() + 2 * STORE_TIMEOUT + 5
        while True:
            status = json.loads(run_ckptfs("status", "--json", root, check=True).stdout)
            if status["fs"].get("store_unavailable"):
                return
            if time.monotonic() > deadline:
                self.fail(f"status of {'AB'[i]} does not say the store is away ({kind}) "
                          f"while work is pending: {status['fs']}")
            time.sleep(0.2)

    # ------------------------------------------------------------------ rules: one node racing itself

    @precondition(lambda self: self.model.file_paths() and "self-race" not in SKIP)
    @rule(data=st.data(), m=st.integers(0, 1), rounds=st.integers(1, 6),
          sticky=st.booleans())
    def self_race(self, data, m, rounds, sticky):
        """One node, fast: create a fresh target, chmod/lchown it, rename a file over it,
        rename it back -- ``rounds`` times; after each rename lchown of the new name
        works, lstat of it is the moved inode and the old name is gone.  ``sticky``: in a sticky directory."""
        if not self.before_step(m):
            return
        src = self.pick(data, self.movable(m, self.model.file_paths()), "src")
        if src is None:
            return
        dst = self.pick(data, self.new_file_paths(), "dst")
        if dst is None:
            return
        if self.fault is not None and self.model.needs_store(("rename", src, dst)):
            return   # a hard-linked name: its renames need the store (file_rename)
        where = parent_of(dst)
        self.note(f"{'AB'[m]}: {rounds} round(s) of: save fresh {dst}, chmod it, rename "
                  f"{src} over it and back{' (sticky ' + (where or '/') + ')' if sticky and where else ''}")
        if sticky and where:
            os.chmod(self.abs(m, where), 0o1777)
        a, b = self.abs(m, src), self.abs(m, dst)
        ino = os.lstat(a).st_ino
        for n in range(rounds):
            vid, content = self.new_version(100)
            self.closed_version(content, f"v{vid}")
            save(b, content)
            os.chmod(b, 0o600)
            os.lchown(b, os.getuid(), os.getgid())
            for old, new, x, y in ((a, b, src, dst), (b, a, dst, src)):
                os.rename(old, new)
                try:
                    os.lchown(new, os.getuid(), os.getgid())
                except OSError as exc:
                    self.fail(f"round {n + 1}: lchown of {y} right after rename {x} -> {y} "
                              f"on {'AB'[m]}: {exc}")
                got = os.lstat(new).st_ino
                if got != ino:
                    self.fail(f"round {n + 1}: after rename {x} -> {y} on {'AB'[m]}, "
                              f"lstat({y}) is inode {got}, not the moved {ino}")
                try:
                    os.lstat(old)
                except FileNotFoundError:
                    pass
                else:
                    self.fail(f"round {n + 1}: after rename {x} -> {y} on {'AB'[m]}, "
                              f"{x} is still there")
            assert self.model.write(dst, content) == 0
            assert self.model.rename(src, dst) == 0
            assert self.model.rename(dst, src) == 0
            # (the lchown after each rename gives the moved file to the test's user)
            assert self.model.chown(src, os.getuid(), os.getgid()) == 0
        self.check(m)

    # ------------------------------------------------------------------ rules: races

    def race_ops(self) -> list[tuple]:
        files = self.model.file_paths()
        ops: list[tuple] = []
        for f in files:
            ops.append(("unlink", f))
            ops.append(("write", f, 40_000))
            ops.append(("chmod", f, MODES[len(ops) % len(MODES)]))
            ops.append(("utime", f, MTIMES[len(ops) % len(MTIMES)]))
            ops.append(("chown", f, *OWNERS[len(ops) % len(OWNERS)]))
            ops.append(("setxattr", f, *XATTRS[len(ops) % len(XATTRS)]))
            for g in files + self.new_file_paths():
                if g != f:
                    ops.append(("rename", f, g))
        for g in self.new_file_paths()[:2]:
            ops.append(("write", g, 40_000))
            if "link" not in SKIP:
                ops += [("link", f, g) for f in files]
        return ops

    @precondition(lambda self: self.fault is None and not self.writers
                  and self.model.file_paths() and "race" not in SKIP)
    @rule(data=st.data())
    def race(self, data):
        """One operation on each node at the same time; every node must converge to one
        serial order's result."""
        self.before_step(None)
        if not self.sync:
            self.sync_all()
        ops = self.race_ops()
        op_a = data.draw(st.sampled_from(ops), label="op on A")
        op_b = data.draw(st.sampled_from(ops), label="op on B")
        model_ops, texts = [], []
        for op in (op_a, op_b):
            if op[0] == "write":
                vid, content = self.new_version(op[2])
                self.closed_version(content, f"v{vid}")
                model_ops.append(("write", op[1], content))
                texts.append(f"save {op[1]} = v{vid} ({op[2]} B)")
            elif op[0] == "setxattr":
                model_ops.append(op)
                texts.append(_xattr_text(*op[1:]))
            else:
                model_ops.append(op)
                texts.append(" ".join(f"{x:04o}" if op[0] == "chmod" and isinstance(x, int)
                                      else str(x) for x in op))
        self.note(f"race: A {texts[0]} || B {texts[1]}")
        barrier = threading.Barrier(2)
        results: list[str] = ["", ""]

        def run(i: int) -> None:
            op = model_ops[i]
            barrier.wait()
            try:
                self.do(i, op)
                results[i] = "ok"
            except OSError as exc:
                results[i] = errno.errorcode.get(exc.errno, str(exc))

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            if t.is_alive():
                self.fail("a racing operation hung for 120 s")
        self.note(f"      results: A {results[0]}, B {results[1]}")
        candidates = []
        for order in ((0, 1), (1, 0)):
            c = self.model.copy()
            for i in order:
                c.apply(model_ops[i])
            candidates.append(c)
        candidates += self.written_again(model_ops)
        if self.sync:
            self.converge(None, candidates)
        else:
            self.sync_all(candidates)


    def written_again(self, model_ops: list[tuple]) -> list[Model]:
        """A save racing another node's rename or unlink of its name may also land
        after it, as the file the writer had open written again under its name
        (``Model.write_again``): one more candidate, where the file is not
        hard-linked (a save through a link follows the file)."""
        out = []
        for w, o in ((0, 1), (1, 0)):
            save, other = model_ops[w], model_ops[o]
            fid = self.model.fid_at(save[1])
            if save[0] != "write" or other[0] not in ("rename", "unlink") \
                    or other[1] != save[1] or fid is None or self.model.files[fid].linked:
                continue
            c = self.model.copy()
            c.apply(other)
            c.write_again(save[1], save[2], self.model.files[fid].attrs())
            out.append(c)
        return out


def _xattr_text(path: str, name: str, value: bytes | None) -> str:
    return f"removexattr {path} {name}" if value is None else \
        f"setxattr {path} {name}={value!r}"


def _settings() -> settings:
    return settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    database=None, derandomize=SEED is None, print_blob=True,
                    report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.generate, Phase.shrink] if SHRINK else [Phase.generate])


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.expect_log_errors(*OUTAGE_ERRORS)
@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("kind", STORES)
def test_model(kind, durability, tmp_path, request):
    ctx = Context(tmp_path, kind, durability,
                  request.getfixturevalue("seaweed") if kind == "s3" else None)

    def factory() -> ModelMachine:
        return ModelMachine(ctx)

    if SEED is not None:
        factory = seed(int(SEED))(factory)
    started = time.monotonic()
    outcome = "failed"
    try:
        run_state_machine_as_test(factory, settings=_settings())
        outcome = "passed"
    finally:
        elapsed = time.monotonic() - started
        line = {"store": kind, "durability": durability, "seed": SEED,
                "examples": ctx.examples, "steps": ctx.steps, "seconds": round(elapsed, 1),
                "outcome": outcome}
        print(f"model run: {json.dumps(line)}", file=sys.stderr)
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(json.dumps(line) + "\n")
