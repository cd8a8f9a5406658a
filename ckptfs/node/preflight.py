"""Can this process mount FUSE here?  The checks made before anything is mounted, each
failing with a ``MountError`` of one line that names the cause and what to do — so that
libfuse's own advice (``try 'modprobe fuse' first``, wrong in a container) never has to
be read: the mount point (a directory, empty, not in use, not a dead mount), the FUSE
device (there, the FUSE device, openable by us), the right to mount (CAP_SYS_ADMIN for
root, ``fusermount3`` for anyone else); and an explanation when ``mount(2)`` fails anyway.

Knows nothing of pyfuse3, the store, or the daemon: only paths, the process's identity
and capabilities.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import shutil
import stat
from pathlib import Path

from ..errors import MountError

FUSE_DEVICE = "/dev/fuse"
FUSE_RDEV = (10, 229)                       # misc device 229 (Documentation/admin-guide/devices.txt)
CAP_SYS_ADMIN = 21
FUSERMOUNT = "fusermount3"
# Where libfuse looks for fusermount3 besides PATH (its build's bindir).
FUSERMOUNT_DIRS = ("/usr/bin", "/bin", "/usr/local/bin")

NO_DEVICE_ADVICE = ("load the fuse module on the host, or give the container the device "
                    "(--device /dev/fuse)")


def check_mountpoint(path: Path) -> None:
    """A directory, empty, not mounted on, not the leftover of a daemon that died."""
    try:
        st = os.stat(path)
        if os.path.ismount(path):
            os.listdir(path)            # asks the filesystem: a dead FUSE mount answers
    except FileNotFoundError:
        raise MountError(f"mount point {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(f"mount point {path} is still mounted but its daemon is gone: "
                             f"clear it with fusermount3 -u {path} (or umount -l {path}), "
                             f"then mount again") from None
        if not os.path.ismount(path):
            raise MountError(f"mount point {path}: {exc.strerror}") from None
        st = None
    if os.path.ismount(path):
        raise MountError(f"{path} is already a mount point (in use): unmount it first, "
                         f"or choose another mount point")
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mount point {path} is not a directory")
    try:
        with os.scandir(path) as entries:
            if any(entries):
                raise MountError(f"mount point {path} is not empty: mount on an empty "
                                 f"directory")
    except OSError as exc:
        raise MountError(f"mount point {path}: {exc.strerror}") from None


def _who() -> str:
    uid, gid = os.geteuid(), os.getegid()
    return f"uid {uid} ({_user(uid)}), gid {gid} ({_group(gid)})"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no name"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return "no name"


def check_fuse_device(path: str = FUSE_DEVICE) -> None:
    """Open the FUSE device read-write, as libfuse will, and close it again."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MountError(_device_error(path, exc)) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if not stat.S_ISCHR(st.st_mode) or rdev != FUSE_RDEV:
        what = (f"character device {rdev[0]}:{rdev[1]}" if stat.S_ISCHR(st.st_mode)
                else "not a character device")
        raise MountError(f"{path} is not the FUSE device ({what}, not "
                         f"{FUSE_RDEV[0]}:{FUSE_RDEV[1]}): {NO_DEVICE_ADVICE}")


def _device_error(path: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return f"no {path}: {NO_DEVICE_ADVICE}"
    if exc.errno in (errno.ENODEV, errno.ENXIO):
        return f"{path} is there but no FUSE driver answers it: {NO_DEVICE_ADVICE}"
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return f"cannot open {path}: {exc.strerror}"
    try:
        st = os.stat(path)
        nodev = bool(os.statvfs(path).f_flag & os.ST_NODEV)
        device = (f"device {stat.filemode(st.st_mode)} {_user(st.st_uid)}:"
                  f"{_group(st.st_gid)}{', on a nodev mount' if nodev else ''}")
    except OSError:
        nodev, device = False, "device mode unknown"
    if nodev:
        advice = ("give the container the device (--device /dev/fuse) rather than a node "
                  "on a nodev filesystem")
    elif os.geteuid() == 0 or exc.errno == errno.EPERM:
        advice = ("the container may not use the device: give it the device "
                  "(--device /dev/fuse)")
    else:
        advice = (f"let this user open it (mode 0666 is usual for {path}), "
                  f"or mount as root")
    return (f"{path} is not permitted: {exc.strerror} ({device}; you are {_who()}): "
            f"{advice}")


def _capabilities(field: str) -> int:
    """A capability mask of this process (``CapEff``, ``CapBnd``) from /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return -1          # unknown: assume everything, let mount(2) decide


def has_cap_sys_admin() -> bool:
    return bool(_capabilities("CapEff") & (1 << CAP_SYS_ADMIN))


def find_fusermount() -> str | None:
    found = shutil.which(FUSERMOUNT)
    if found:
        return found
    for directory in FUSERMOUNT_DIRS:
        candidate = os.path.join(directory, FUSERMOUNT)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


NO_CAP = ("no CAP_SYS_ADMIN: mounting a filesystem needs it (give the container "
          "--cap-add SYS_ADMIN, or a user namespace)")
NO_FUSERMOUNT = (f"{FUSERMOUNT} not found: a non-root mount needs it (install the fuse3 "
                 f"package, or mount as root)")


def check_may_mount() -> None:
    """Root mounts with ``mount(2)``, which needs CAP_SYS_ADMIN (libfuse falls back to the
    setuid ``fusermount3``, which gets it only from the bounding set); anyone else
    mounts through ``fusermount3``."""
    if has_cap_sys_admin():
        return
    if os.geteuid() == 0:
        if not _capabilities("CapBnd") & (1 << CAP_SYS_ADMIN):
            raise MountError(NO_CAP)
        return
    if find_fusermount() is None:
        raise MountError(NO_FUSERMOUNT)


def explain_mount_failure(mountpoint: Path, detail: str) -> str:
    """The line for a ``mount(2)`` that failed after every check passed (libfuse's own
    lines are in the log above it)."""
    if os.geteuid() == 0 and not has_cap_sys_admin():
        return NO_CAP
    if os.geteuid() != 0 and find_fusermount() is None:
        return NO_FUSERMOUNT
    return (f"FUSE mount on {mountpoint} failed ({detail}); libfuse's reason is in the "
            f"log just before this line")
