"""``ckptfs fsck --store URL``: open the store, run ``cluster.fsck`` over it (and
``cluster.fsck_repair`` with ``--repair``), print the report as lines or JSON.

Exit 0: clean; 1: damage found (what remains after a repair); 2: could not run (a bad
URL, no credentials, no ``ckptfs.json`` marker, the store unreachable), said in one
line.  Knows the report's shape and the state dir's layout, nothing of how the store is
walked."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

CLEAN, DAMAGED, CANNOT_RUN = 0, 1, 2
LIST_AT_MOST = 20           # orphaned chunks named one by one in the text output


def add_parser(sub) -> None:
    """The ``fsck`` subcommand and its options, on ``ckptfs``'s subparsers."""
    parser = sub.add_parser("fsck", help="check a store: entries parse, the chunks they "
                            "name exist (--full: and hash right); name damaged files; "
                            "never deletes")
    parser.add_argument("--store", required=True, help="store URL: s3://bucket/prefix or "
                        "file:///path")
    parser.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 "
                        "or AWS_ENDPOINT_URL)")
    parser.add_argument("--full", action="store_true", help="also read every chunk and "
                        "check its bytes hash to its id")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument("--state-dir", type=Path, help="a node's state dir: with --repair, "
                        "missing chunks its cache or staging files hold are put back")
    parser.add_argument("--repair", action="store_true", help="re-upload missing chunks "
                        "found (and verified) in --state-dir; nothing else is written")
    parser.add_argument("--workers", type=int, default=8, help="parallel store requests "
                        "(default 8; --full holds one chunk in memory per worker)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one store "
                        "request may take, retries included (default 60)")


def _cannot(message: str) -> int:
    print(f"ckptfs: fsck: {message}", file=sys.stderr)
    return CANNOT_RUN


def cmd_fsck(args: argparse.Namespace) -> int:
    from ..cluster.fsck import check
    from ..cluster.fsck_repair import LocalCopies, repair
    from ..errors import first_cause
    from ..format.remote import FORMAT_KEY
    from ..store import BadStoreURL, RetryingStore, StoreError, open_store, store_policy

    if args.repair and args.state_dir is None:
        return _cannot("--repair needs --state-dir DIR (the node whose copies to use)")
    copies = None
    if args.state_dir is not None:
        # The daemon's layout of a state dir (node/daemon.py): cache/, staging/, abandoned/.
        cache = args.state_dir / "cache"
        if not cache.is_dir():
            return _cannot(f"{args.state_dir} is not a ckptfs state dir (no cache/ in it)")
        copies = LocalCopies(cache, [args.state_dir / "staging", args.state_dir / "abandoned"])
    progress = _progress(args.verbose)
    try:
        raw = open_store(args.store, args.endpoint_url, args.timeout)
        raw.check()
        store = RetryingStore(raw, store_policy(args.timeout))
        if not store.exists(FORMAT_KEY):
            return _cannot(f"no {FORMAT_KEY} marker in {args.store}: not a ckptfs store "
                           "(or the wrong prefix)")
        report = check(store, full=args.full, workers=args.workers, progress=progress)
        if args.repair and copies is not None and report.missing_chunks:
            repair(store, report, copies, progress)
    except BadStoreURL as exc:
        return _cannot(str(exc))
    except StoreError as exc:
        return _cannot(f"{args.store}: {exc}")
    except Exception as exc:  # noqa: BLE001 - one line (no credentials, DNS, ...)
        if args.verbose:
            raise
        cause = first_cause(exc)
        return _cannot(f"{args.store}: {cause.__class__.__name__}: {cause}")
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        for line in report_lines(report):
            print(line)
    return DAMAGED if report.damaged else CLEAN


def _progress(verbose: bool):
    if not verbose:
        return lambda msg: None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return lambda msg: print(f"ckptfs: fsck: {msg}", file=sys.stderr)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _n(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def report_lines(report) -> list[str]:
    """The human summary: one line per finding, then the verdict."""
    lines = [f"fsck {report.url}: {_n(report.entries, 'entry', 'entries')} ("
             f"{_n(report.dirs, 'directory', 'directories')}, {_n(report.files, 'file')}), "
             f"{_n(report.chunks, 'chunk')} ({_mib(report.chunk_bytes)})"
             + (f", {report.chunks_hashed} re-hashed" if report.chunks_hashed else "")]
    for d in report.damaged_files:
        what = [f"{len(d.missing)} chunk(s) missing"] if d.missing else []
        what += [f"{len(d.corrupt)} chunk(s) corrupt"] if d.corrupt else []
        lines.append(f"DAMAGED {d.path}: {', '.join(what)} (first: "
                     f"{(d.missing + d.corrupt)[0]})")
    for chunk in report.missing_chunks:
        lines.append(f"MISSING chunk {chunk}")
    for chunk in report.corrupt_chunks:
        lines.append(f"CORRUPT chunk {chunk}")
    for key, reason in report.bad_entries:
        lines.append(f"BAD ENTRY {key}: {reason}")
    for dir_id, n in report.dangling_dirs:
        lines.append(f"DANGLING directory id {dir_id}: {n} entr{'y' if n == 1 else 'ies'} "
                     "under it, no entry names it")
    for path, key in report.missing_inodes:
        lines.append(f"MISSING inode object {key} (hard link {path})")
    for chunk, source in report.repaired:
        lines.append(f"repaired chunk {chunk} from {source}")
    for tree in report.staged_trees:
        lease = "no seal lease" if tree.lease_age is None else \
            f"seal lease renewed {tree.lease_age:.0f} s ago"
        lines.append(f"staged tree {tree.path} (unsealed, idle {tree.idle:.0f} s, {lease})")
    for path, target, age in report.rename_claims:
        lines.append(f"rename in progress {path} -> {target} (claimed {age:.0f} s ago)")
    if report.orphan_chunks:
        named = ", ".join(report.orphan_chunks[:LIST_AT_MOST])
        more = "" if len(report.orphan_chunks) <= LIST_AT_MOST else ", ..."
        lines.append(f"orphaned chunks: {len(report.orphan_chunks)} "
                     f"({_mib(report.orphan_chunk_bytes)}; gc reclaims them after its grace "
                     f"period, uploads in flight look the same): {named}{more}")
    if report.orphan_inodes:
        lines.append(f"orphaned inode objects: {', '.join(report.orphan_inodes)}")
    if report.stray_keys:
        lines.append(f"not chunk keys under chunks/: {', '.join(report.stray_keys)}")
    if report.leases or report.gc_phase:
        lines.append(f"seal leases: {report.leases}; gc: {report.gc_phase or 'never ran'}")
    if report.damaged:
        counts = [(len(report.damaged_files), "damaged file"),
                  (len(report.missing_chunks), "missing chunk"),
                  (len(report.corrupt_chunks), "corrupt chunk"),
                  (len(report.bad_entries), "bad entry"),
                  (len(report.dangling_dirs), "dangling directory id"),
                  (len(report.missing_inodes), "missing inode object")]
        lines.append("result: DAMAGE: " + ", ".join(
            _n(n, what, what[:-1] + "ies" if what.endswith("y") else "")
            for n, what in counts if n))
    else:
        lines.append("result: clean")
    return lines
