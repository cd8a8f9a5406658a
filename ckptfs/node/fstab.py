"""Mounting from ``/etc/fstab`` (``mount -t fuse.ckptfs``): ``mount.fuse3`` runs
``ckptfs STORE_URL MOUNTPOINT -o OPTIONS``; this turns that call into ``ckptfs mount``
arguments.  An fstab line::

    s3://bucket/prefix  /mnt/ckpt  fuse.ckptfs  _netdev,state_dir=/var/lib/ckptfs/mnt-ckpt,durability=async  0 0

Options named like the settings (``state_dir``, ``durability``, ``config``,
``endpoint_url``, ``metrics_address``, ``cache_size``, ...; ``-`` or ``_``) map to the
``mount`` flags; the generic mount options that ``mount`` and ``mount.fuse3`` hand on
(``rw``, ``dev``, ``suid``, ``_netdev``, ``x-systemd.*``, ...) are accepted and ignored
(``default_permissions`` too: ckptfs always mounts with it); FUSE's bare ``allow_other``
is ``allow_other=on``;
anything else is an error with one line.  Knows nothing beyond argument lists.
"""

from __future__ import annotations

# Generic options a mount helper may be handed: none changes what ckptfs does.
IGNORED = {"rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto",
           "user", "users", "nouser", "owner", "group", "defaults", "_netdev", "nofail",
           "async", "atime", "noatime", "relatime", "strictatime", "nodiratime",
           "default_permissions"}
# Options that take a value, and the one boolean.
VALUED = ("store", "config", "state_dir", "durability", "endpoint_url", "chunk_size",
          "cache_size", "metadata_ttl", "upload_concurrency", "fetch_concurrency",
          "gc_grace", "gc_settle", "checkpoint_formats", "lease_ttl", "stale_staged_after",
          "store_timeout", "stop_timeout", "max_staged", "upload_hold", "metrics_address",
          "log_file", "s3_client", "allow_other", "passthrough", "peer_listen",
          "peer_advertise", "peer_timeout", "peer_fanout", "chunk_hash")
FLAGS = ("single_writer", "writeback_cache")


class FstabError(ValueError):
    pass


def is_helper_call(argv: list[str]) -> bool:
    """``ckptfs STORE_URL MOUNTPOINT ...`` (a store URL where a command would be)."""
    return len(argv) >= 2 and "://" in argv[0]


def mount_argv(argv: list[str]) -> list[str]:
    """``[URL, MOUNTPOINT, "-o", "a=b,c", ...]`` -> ``["mount", MOUNTPOINT, "--store",
    URL, ...]``.  ``-o`` may repeat; ``-v`` is passed on."""
    url, mountpoint, rest = argv[0], argv[1], argv[2:]
    out = ["mount", mountpoint, "--store", url]
    verbose = False
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "-o" and i + 1 < len(rest):
            out += _options(rest[i + 1])
            i += 2
        elif arg.startswith("-o") and len(arg) > 2:
            out += _options(arg[2:])
            i += 1
        elif arg in ("-v", "--verbose"):
            verbose = True
            i += 1
        elif arg in ("-n", "-s", "-f"):     # mount's no-mtab, sloppy, fake: harmless
            i += 1
        else:
            raise FstabError(f"unexpected argument {arg!r} (ckptfs STORE_URL MOUNTPOINT "
                             f"-o OPTIONS)")
    return (["-v"] if verbose else []) + out


def _options(text: str) -> list[str]:
    out: list[str] = []
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        name = key.replace("-", "_")
        if name in IGNORED or name.startswith(("x-", "comment=")):
            continue
        if name == "allow_other" and not sep:       # FUSE's own spelling: on
            out += ["--allow-other", "on"]
        elif name in VALUED:
            if not sep or not value:
                raise FstabError(f"mount option {key} needs a value ({key}=...)")
            out += ["--" + name.replace("_", "-"), value]
        elif name in FLAGS and not sep:
            out.append("--" + name.replace("_", "-"))
        else:
            raise FstabError(f"unknown mount option {item!r}")
    return out
