"""The ``ckptfs`` command: argument parsing, the mount handshake, and the control-socket
client.  Each failure ends with one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_STATE_ROOT = Path("/var/lib/ckptfs")
def default_state_dir(mountpoint: Path) -> Path:
    name = str(mountpoint.resolve()).strip("/").replace("/", "-") or "root"
    return DEFAULT_STATE_ROOT / name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description="FUSE filesystem for ML "
                                     "checkpoints, published atomically to an object store")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount a store")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--config", type=Path, help="TOML settings file (default "
                   "/etc/ckptfs/ckptfs.toml if it exists)")
    m.add_argument("--foreground", action="store_true", help="stay in the foreground")
    add_setting_flags(m)
    m.add_argument("--log-file", type=Path, help="daemon log (default STATE_DIR/ckptfs.log)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="finish pending uploads (for at most --timeout), "
                       "then unmount")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--timeout", type=_timeout_arg, default=None,
                   help="seconds to wait for pending uploads before unmounting anyway; "
                   "unfinished ones stay journaled and the next mount resumes them "
                   "(default: the mount's stop_timeout, 600)")

    s = sub.add_parser("status", help="show what a mount is doing")
    s.add_argument("mountpoint", type=Path)
    s.add_argument("--json", action="store_true", help="the daemon's full report as JSON")
    s.add_argument("--watch", action="store_true", help="refresh until interrupted")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes "
                   "with --watch (default 2)")
    s.add_argument("--staged", action="store_true", help="list this node's staged "
                   "(unsealed, unlisted) checkpoint directories: idle time, state, path")

    w = sub.add_parser("wait", help="block until everything closed under a mount is durable")
    w.add_argument("path", type=Path)
    w.add_argument("--timeout", type=_timeout_arg, default=None,
                   help="give up after this many seconds (exit 1)")
    st = sub.add_parser("state", help="print the state of a path: staged, uploading, "
                        "published, remote or cached")
    st.add_argument("path", type=Path)
    c = sub.add_parser("commit", help="seal a staged checkpoint directory (make it listed)")
    c.add_argument("path", type=Path)

    g = sub.add_parser("gc", help="remove staged trees and unreferenced chunks older than "
                       "the grace period")
    g.add_argument("mountpoint", type=Path)
    g.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    g.add_argument("--grace", type=float, default=None,
                   help="seconds (default: the mount's gc_grace, 24 h)")

    from .fsck import add_parser as add_fsck_parser
    add_fsck_parser(sub)

    pf = sub.add_parser("prefetch", help="warm a file or a tree into this node's cache")
    pf.add_argument("path", type=Path)

    b = sub.add_parser("bench", help="run the checkpoint workload against ckptfs and "
                       "its baselines; print medians and ratios")
    from ..bench.runner import add_arguments
    add_arguments(b)
    return parser


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per row of the settings table (config.SETTINGS).  Values stay text here:
    ``config.load`` parses and checks them like those of the file and the variables."""
    from ..node.config import SETTINGS

    for setting in SETTINGS:
        if setting.kind == "switch":
            parser.add_argument(setting.flag, action="store_const", const=True,
                                help=setting.help)
        elif setting.kind == "choice":
            parser.add_argument(setting.flag, choices=setting.choices, help=setting.help)
        else:
            parser.add_argument(setting.flag, help=setting.help)


def _timeout_arg(text: str) -> float:
    from ..node.config import ConfigError, parse_seconds
    try:
        return parse_seconds(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fail(message: str, code: int = 1) -> int:
    print(f"ckptfs: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from ..node.fstab import FstabError, is_helper_call, mount_argv
    if is_helper_call(argv):        # mount.fuse3: ckptfs STORE_URL MOUNTPOINT -o ...
        try:
            argv = mount_argv(argv)
        except FstabError as exc:
            return fail(str(exc))
    args = build_parser().parse_args(argv)
    try:
        return run_command(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (-v shows it)
        if args.verbose:
            raise
        from ..errors import first_cause
        cause = first_cause(exc)
        return fail(f"{args.command}: {cause.__class__.__name__}: {cause}")


def run_command(args: argparse.Namespace) -> int:
    if args.command == "mount":
        return cmd_mount(args)
    if args.command == "umount":
        return cmd_umount(args.mountpoint, args.timeout)
    if args.command == "status":
        if args.watch or not (args.json or args.staged):
            return cmd_status_text(args.mountpoint, args.watch, args.interval)
        return cmd_status(args.mountpoint, args.staged)
    if args.command == "wait":
        return cmd_wait(args.path, args.timeout)
    if args.command == "state":
        return cmd_state(args.path)
    if args.command == "commit":
        return cmd_commit(args.path)
    if args.command == "gc":
        return cmd_gc(args.mountpoint, args.dry_run, args.grace)
    if args.command == "prefetch":
        return cmd_prefetch(args.path)
    if args.command == "fsck":
        from .fsck import cmd_fsck
        return cmd_fsck(args)
    if args.command == "bench":
        from ..bench.runner import main as bench_main
        return bench_main(args)
    return fail(f"unknown command {args.command}")


# --------------------------------------------------------------------------- mount


def cmd_mount(args: argparse.Namespace) -> int:
    from ..node.config import SETTINGS, ConfigError, load
    from ..errors import MountError
    from ..node.preflight import check_mountpoint
    from ..store import BadStoreURL, check_store_url

    mountpoint = args.mountpoint.absolute()
    flags = {s.name: getattr(args, s.name) for s in SETTINGS}
    try:
        settings = load(args.config, dict(os.environ), flags)
    except ConfigError as exc:
        return fail(str(exc))
    if not settings.store:
        return fail("no store: give --store URL (or store = ... in the config file)")
    state_dir = Path(settings.state_dir or default_state_dir(mountpoint)).absolute()
    # Cheap checks first, so mistakes fail without a daemon.
    try:
        check_store_url(settings.store)
        check_mountpoint(mountpoint)
    except (BadStoreURL, MountError) as exc:
        return fail(str(exc))
    if args.foreground:
        return run_foreground(args, settings, mountpoint, state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_file = args.log_file or state_dir / "ckptfs.log"
    read_fd, write_fd = os.pipe()
    # The daemon re-reads the same file, variables and flags, so it resolves the same
    # settings; only the state dir is made explicit.
    cmd = [sys.executable, "-m", "ckptfs", *(["-v"] if args.verbose else []), "mount",
           str(mountpoint), "--foreground", "--ready-fd", str(write_fd),
           "--log-file", str(log_file)]
    if args.config:
        cmd += ["--config", str(args.config)]
    for key, value in flags.items():
        if key == "state_dir":
            value = str(state_dir)
        if value is True:
            cmd.append("--" + key.replace("_", "-"))
        elif value is not None:
            cmd += ["--" + key.replace("_", "-"), str(value)]
    with open(log_file, "ab") as log_out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_out, stderr=log_out,
                                pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        message = pipe.read().decode(errors="replace").strip()
    if message.startswith("OK"):
        print(f"ckptfs: mounted {settings.store} on {mountpoint} (pid {proc.pid}, "
              f"log {log_file})")
        return 0
    proc.wait()
    if message.startswith("ERR "):
        return fail(message[4:])
    return fail(f"daemon exited with status {proc.returncode} before mounting; see {log_file}")


# The settings MountOptions takes as they are (the core's go in through Config).
DAEMON_SETTINGS = ("endpoint_url", "single_writer", "metrics_address", "retention",
                   "s3_client", "peer_listen", "peer_advertise", "peer_timeout", "peer_fanout",
                   "allow_other")


def run_foreground(args: argparse.Namespace, settings, mountpoint: Path, state_dir: Path) -> int:
    import dataclasses

    import trio

    from ..node.daemon import Daemon, MountOptions
    from ..core import Config
    from ..errors import MountError, first_cause

    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if args.log_file and args.ready_fd is None:
        handlers = [logging.FileHandler(args.log_file)]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=handlers,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Every setting the core has a field for (the rest are the daemon's, below).
    config = Config(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(Config)
                       if hasattr(settings, f.name)})
    wrap = None
    if os.environ.get("CKPTFS_FAULTS"):
        from ..store.faults import FaultInjectingStore, FaultPlan
        plan = FaultPlan.from_json(os.environ["CKPTFS_FAULTS"])
        wrap = lambda store: FaultInjectingStore(store, plan)  # noqa: E731
    opts = MountOptions(mountpoint=mountpoint, store_url=settings.store, state_dir=state_dir,
                        config=config, **{k: getattr(settings, k) for k in DAEMON_SETTINGS})
    ready_fd = args.ready_fd
    mounted = False

    def on_ready() -> None:
        nonlocal ready_fd, mounted
        mounted = True
        if ready_fd is not None:
            os.write(ready_fd, b"OK\n")
            os.close(ready_fd)
            ready_fd = None

    try:
        try:
            trio.run(Daemon(opts, store_wrap=wrap).run, on_ready)
        except BaseExceptionGroup as group:     # a nursery's: the first real cause
            raise first_cause(group) from None
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line in the log and the terminal
        log = logging.getLogger("ckptfs")
        if mounted and not isinstance(exc, MountError):
            log.exception("daemon failed")      # a crash while mounted: its traceback
            return fail(f"daemon failed: {exc.__class__.__name__}: {exc}")
        message = str(exc) if isinstance(exc, MountError) \
            else f"{exc.__class__.__name__}: {exc}"
        log.error("mount failed: %s", message)
        if ready_fd is not None:
            os.write(ready_fd, f"ERR {message}\n".encode())
            return 1
        return fail(message)
    return 0


# --------------------------------------------------------------------------- control socket


def control_request(mountpoint: Path, request: dict):
    """Replies of the daemon serving ``mountpoint`` (api.request: one client)."""
    from .api import request as send
    return send(mountpoint, request)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_umount(mountpoint: Path, timeout: float | None = None) -> int:
    mountpoint = mountpoint.absolute()
    request: dict = {"cmd": "umount"}
    if timeout is not None:
        request["timeout"] = timeout
    from .display import Bar
    done: dict | None = None
    said = False
    try:
        with Bar("unmounting: pending uploads") as bar:
            first = None
            for reply in control_request(mountpoint, request):
                if reply.get("error"):
                    return fail(reply["error"])
                if reply.get("done"):
                    done = reply
                elif "pending_uploads" in reply:
                    failing = len(reply.get("failing") or {})
                    line = (f"waiting for {reply['pending_uploads']} pending upload(s) "
                            f"({_mib(reply.get('pending_bytes', 0))}"
                            f"{f', {failing} failing' if failing else ''}), at most "
                            f"{reply.get('remaining', 0):.0f} s more")
                    first = reply["pending_uploads"] if first is None else first
                    bar.update(completed=first - reply["pending_uploads"], total=first,
                               description=line)
                    if not said and not bar.active:      # once, for logs
                        print(f"ckptfs: {line}", file=sys.stderr, flush=True)
                        said = True
    except ConnectionError as exc:
        if "daemon is gone" in str(exc):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
            return fail(f"{exc}; lazily unmounted")
        return fail(str(exc))
    if done is None:
        return fail(f"{mountpoint}: the daemon closed the connection early")
    from ..procstat import fstype_of_mount
    from .api import FSTYPE
    deadline = time.monotonic() + 60
    # The mount gone, not just any mount there: a container's volume stays a mount point.
    while fstype_of_mount(os.fsencode(os.path.realpath(mountpoint))) == FSTYPE:
        if time.monotonic() > deadline:
            return fail(f"{mountpoint} is still mounted after 60 s")
        time.sleep(0.05)
    left = done.get("journaled", 0)
    if left:
        print(f"ckptfs: unmounted {mountpoint}; {left} upload(s) not finished stay journaled "
              f"in {done.get('state_dir')}; the next mount resumes them", file=sys.stderr)
    return 0


def cmd_status_text(mountpoint: Path, watch: bool, interval: float) -> int:
    from .api import refused
    from .display import status_text
    from .display import watch as watch_loop

    def fetch() -> str:
        for reply in control_request(mountpoint.absolute(), {"cmd": "status"}):
            if reply.get("error"):
                raise refused(reply)
            return status_text(reply)
        raise ConnectionError(f"{mountpoint}: the daemon closed the connection early")

    try:
        if watch:
            watch_loop(fetch, max(0.1, interval))
        else:
            print(fetch())
    except OSError as exc:
        return fail(exc.strerror or str(exc))
    return 0


def cmd_status(mountpoint: Path, staged: bool = False) -> int:
    try:
        for reply in control_request(mountpoint.absolute(),
                                     {"cmd": "staged" if staged else "status"}):
            if reply.get("error"):
                return fail(reply["error"])
            if not staged:
                print(json.dumps(reply, indent=2, sort_keys=True))
                continue
            print(f"{'IDLE':>10}  {'STATE':<8} PATH")
            for item in reply["staged"]:
                print(f"{item['idle_s']:>9.1f}s  {item['state']:<8} {item['path']}")
            print(f"ckptfs: {len(reply['staged'])} staged (unlisted) checkpoint "
                  f"director{'y' if len(reply['staged']) == 1 else 'ies'} on this node; "
                  f"'stale' = idle over {reply['stale_staged_after']:g} s and unsealed: "
                  "`ckptfs commit PATH` seals one", file=sys.stderr)
    except ConnectionError as exc:
        return fail(str(exc))
    return 0


def cmd_commit(path: Path) -> int:
    from . import api
    path = path.absolute()
    if not path.is_dir():
        return fail(f"{path}: not a directory")
    try:
        result = api.commit(path)
    except OSError as exc:      # ConnectionError, or the daemon's refusal
        return fail(exc.strerror or str(exc))
    pending = result.pending
    if pending:
        print(f"ckptfs: seal pending: {path} waits for node(s) "
              f"{', '.join(pending['waiting_for'])} still writing below it"
              + (f" (dead: {', '.join(pending['dead'])})" if pending["dead"] else "")
              + "; it completes by itself, `ckptfs status` shows it")
        return 3
    if result.journaled:
        print(f"ckptfs: seal journaled (async mode): {path} appears sealed on every node "
              f"once the uploads below it are in the store; `ckptfs wait` waits for that")
        return 0
    print(f"ckptfs: {'sealed' if result.sealed else 'already visible'}: {path}")
    return 0


def cmd_state(path: Path) -> int:
    from . import api
    try:
        print(api.state(path))
    except OSError as exc:
        return fail(exc.strerror or str(exc))
    return 0


def _mount_of(path: Path) -> Path:
    from .api import mount_of
    return mount_of(path)


def cmd_gc(mountpoint: Path, dry_run: bool, grace: float | None) -> int:
    request: dict = {"cmd": "gc", "dry_run": dry_run}
    if grace is not None:
        request["grace"] = grace
    try:
        from .display import Bar
        with Bar("gc: walking the store", kind="spin"):
            replies = list(control_request(mountpoint.absolute(), request))
        for reply in replies:
            if reply.get("error"):
                return fail(reply["error"])
            if reply.get("done"):
                verb = "would remove" if dry_run else "removed"
                for tree in reply["staged_trees"]:
                    print(f"{verb} staged tree {tree}")
                for name in reply["local_abandoned"]:
                    print(f"{verb} abandoned staging file {name}")
                for key in reply.get("bad_entries", []):
                    print(f"ckptfs: gc: cannot parse entry {key}", file=sys.stderr)
                for key in reply.get("orphan_inodes", []):
                    print(f"ckptfs: gc: inode object {key} has no name linking to it "
                          "(kept)", file=sys.stderr)
                print(f"ckptfs: gc pass {reply.get('generation', 0)} {verb} "
                      f"{len(reply['staged_trees'])} staged tree(s), "
                      f"{reply['entries_deleted']} entries, {reply['chunks_deleted']} chunk(s) "
                      f"({reply['chunk_bytes_deleted'] / 2**20:.1f} MiB); kept "
                      f"{reply['chunks_kept']} chunk(s); condemned "
                      f"{reply.get('chunks_condemned', 0)} for the next pass")
                if reply.get("stopped"):
                    return fail(f"gc stopped: {reply['stopped']}")
                return 0
    except ConnectionError as exc:
        return fail(str(exc))
    return fail("the daemon closed the connection early")


def cmd_prefetch(path: Path) -> int:
    path = path.absolute()
    if not path.exists():
        return fail(f"{path}: no such file or directory")
    from .display import Bar
    try:
        with Bar(f"prefetch {path.name}", kind="bytes") as bar:
            replies = []
            for reply in control_request(_mount_of(path), {"cmd": "prefetch",
                                                           "path": str(path)}):
                if "progress" in reply:
                    bar.update(completed=reply["progress"], total=reply["total"])
                else:
                    replies.append(reply)
        for reply in replies:
            if reply.get("error"):
                return fail(reply["error"])
            if reply.get("done"):
                for failure in reply["failed"]:
                    print(f"ckptfs: prefetch failed: {failure}", file=sys.stderr)
                skipped = reply.get("skipped", 0)
                print(f"ckptfs: prefetched {reply['files']} file(s), "
                      f"{reply['bytes'] / 2**20:.1f} MiB" +
                      (f", {len(reply['failed'])} failed" if reply["failed"] else "") +
                      (f", {skipped} skipped (no permission to read or search them)"
                       if skipped else ""))
                return 0 if reply["ok"] else 1
    except ConnectionError as exc:
        return fail(str(exc))
    return fail("the daemon closed the connection early")


def cmd_wait(path: Path, timeout: float | None = None) -> int:
    from . import api
    from .display import Bar

    with Bar("waiting for uploads") as bar:
        first: list[int] = []
        outage: list[str] = []

        def progress(reply: dict) -> None:
            outage[:] = [reply["store_unavailable"]] if reply.get("store_unavailable") else []
            n = reply["pending_uploads"]
            if not first:
                first.append(n)
            bar.update(completed=max(0, first[0] - n), total=max(first[0], n),
                       description=f"{n} upload(s) pending "
                                   f"({_mib(reply.get('pending_bytes', 0))})")

        try:
            api.wait(path, timeout, progress)
        except TimeoutError:
            return fail(f"{path}: not durable after {timeout:g} s" +
                        (f": {outage[0]}" if outage else ""))
        except OSError as exc:
            return fail(exc.strerror or str(exc))
    return 0
