"""Can this process mount FUSE here?  The checks made before anything is mounted, each
failing with a ``MountError`` of one line that names the cause and what to do — so that
libfuse's own advice (``try 'modprobe fuse' first``, wrong in a container) never has to
be read: the mount point (a directory, empty, not in use, not a dead mount), the FUSE
device (there, the FUSE device, openable by us), the right to mount (CAP_SYS_ADMIN for
root, ``fusermount3`` for anyone else), whether ``allow_other`` is permitted (root, or
``user_allow_other`` in /etc/fuse.conf); and an explanation when ``mount(2)`` fails
anyway.

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
from ..procstat import fstype_of_mount

FUSE_DEVICE = "/dev/fuse"
FUSE_RDEV = (10, 229)                       # misc device 229 (Documentation/admin-guide/devices.txt)
CAP_SYS_ADMIN = 21
FUSERMOUNT = "fusermount3"
# Where libfuse looks for fusermount3 besides PATH (its build's bindir).
FUSERMOUNT_DIRS = ("/usr/bin", "/bin", "/usr/local/bin")
FUSE_CONF = "/etc/fuse.conf"

NO_DEVICE_ADVICE = ("load the fuse module on the host, or give the container the device "
                    "(--device /dev/fuse)")


def check_mountpoint(path: Path) -> None:
    """A directory, empty, not mounted on (but for an empty volume of a container, made to
    be mounted on), not the leftover of a daemon that died."""
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
    if os.path.ismount(path) and _in_use(path):
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


def _in_use(path: Path) -> bool:
    """A mount point is in use unless it is an empty directory mounted there to be
    mounted on — a container's volume (docker ``-v``, a Kubernetes ``emptyDir`` or
    ``hostPath``, a bind with ``rshared`` propagation): a FUSE mount there is in use
    whatever it holds (its daemon may be slow to answer), anything else if not empty
    (the emptiness is checked next)."""
    fstype = fstype_of_mount(os.fsencode(os.path.realpath(path)))
    return fstype is None or fstype == "fuse" or fstype.startswith(("fuse.", "fuseblk"))


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
                 f"package: apt-get install fuse3, dnf install fuse3, apk add fuse3; or "
                 f"mount as root)")


def check_may_mount(mountpoint: Path | None = None) -> None:
    """Root mounts with ``mount(2)``, which needs CAP_SYS_ADMIN (libfuse falls back to the
    setuid ``fusermount3``, which gets it only from the bounding set); anyone else
    mounts through ``fusermount3``, which mounts only on a directory the user may write
    (and owns, if it is sticky)."""
    if has_cap_sys_admin():
        return
    if os.geteuid() == 0:
        if not _capabilities("CapBnd") & (1 << CAP_SYS_ADMIN):
            raise MountError(NO_CAP)
        return
    fusermount = find_fusermount()
    if fusermount is None:
        raise MountError(NO_FUSERMOUNT)
    problem = _setuid_problem(fusermount)
    if problem:
        raise MountError(f"{fusermount} cannot mount for a non-root user: {problem}")
    if mountpoint is not None:
        _check_user_mountpoint(mountpoint)


def _check_user_mountpoint(mountpoint: Path) -> None:
    """fusermount3's own rule for an ordinary user's mount point (util/fusermount.c)."""
    try:
        st = os.stat(mountpoint)
    except OSError:
        return                                  # check_mountpoint said why
    owner = f"owned by {_user(st.st_uid)}, {stat.filemode(st.st_mode)}"
    if st.st_mode & stat.S_ISVTX and st.st_uid != os.getuid():
        raise MountError(f"mount point {mountpoint} is sticky and not this user's ({owner}; "
                         f"you are {_who_short()}): fusermount3 mounts only on a "
                         f"directory the user owns there; chown it to the user, or "
                         f"mount as root")
    if not os.access(mountpoint, os.W_OK):
        raise MountError(f"mount point {mountpoint} is not writable by {_who_short()} "
                         f"({owner}): fusermount3 mounts only on a directory the user may "
                         f"write; chown it to the user, or mount as root")


def _setuid_problem(fusermount: str) -> str | None:
    """Why the setuid-root ``fusermount3`` would not run as root here, if it would not:
    not setuid root, on a nosuid filesystem, or under no_new_privs (docker's
    ``--security-opt no-new-privileges``)."""
    try:
        st = os.stat(fusermount)
        nosuid = bool(os.statvfs(fusermount).f_flag & os.ST_NOSUID)
    except OSError:
        return None
    if not st.st_mode & stat.S_ISUID or st.st_uid != 0:
        return (f"it is not setuid root ({stat.filemode(st.st_mode)} "
                f"{_user(st.st_uid)}): chmod u+s {fusermount} as root, or reinstall fuse3")
    if nosuid:
        return (f"it is on a nosuid filesystem: mount as root, or from a filesystem "
                f"that allows setuid")
    if _no_new_privs():
        return ("this process runs with no_new_privs, which disables setuid (docker/podman "
                "--security-opt no-new-privileges, Kubernetes allowPrivilegeEscalation: "
                "false): drop that option, or mount as root, or in a user namespace")
    return None


def _no_new_privs() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NoNewPrivs:"):
                    return line.split()[1] == "1"
    except (OSError, IndexError):
        pass
    return False


def explain_mount_failure(mountpoint: Path, detail: str) -> str:
    """The line for a ``mount(2)`` that failed after every check passed (libfuse's own
    lines are in the log above it)."""
    if os.geteuid() == 0 and not has_cap_sys_admin():
        return NO_CAP
    if os.geteuid() != 0 and find_fusermount() is None:
        return NO_FUSERMOUNT
    return (f"FUSE mount on {mountpoint} failed ({detail}); libfuse's reason is in the "
            f"log just before this line")


def user_allow_other(fuse_conf: str = FUSE_CONF) -> bool:
    """``user_allow_other`` on a line of its own in ``fuse_conf``, as fusermount3 reads
    it (``#`` starts a comment)."""
    try:
        with open(fuse_conf) as f:
            return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def allow_other_permitted(fuse_conf: str = FUSE_CONF) -> bool:
    """Root (also root of a user namespace) and a process with CAP_SYS_ADMIN mount with
    ``mount(2)``, which takes ``allow_other``; anyone else mounts through fusermount3,
    which refuses it unless ``fuse_conf`` says ``user_allow_other``."""
    return os.geteuid() == 0 or has_cap_sys_admin() or user_allow_other(fuse_conf)


def resolve_allow_other(setting: str, fuse_conf: str = FUSE_CONF) -> tuple[bool, str]:
    """Whether to mount with ``allow_other`` for the setting (auto, on, off), and the
    line that says so for the log; ``on`` where it is not permitted is a MountError."""
    permitted = allow_other_permitted(fuse_conf)
    if setting == "off":
        return False, (f"allow_other off: only {_who_short()} can use this mount "
                       f"(allow_other = off)")
    if setting == "on" and not permitted:
        raise MountError(f"allow_other = on, but {_who_short()} may not mount with "
                         f"allow_other: fusermount3 allows it only with a line "
                         f"user_allow_other in {fuse_conf} (add it as root), or mount as "
                         f"root; allow_other = auto mounts for this user alone")
    if permitted:
        return True, (f"allow_other on: every user may use this mount, the kernel checks "
                      f"permissions (allow_other = {setting})")
    return False, (f"allow_other off: only {_who_short()} can use this mount (an ordinary "
                   f"user may set allow_other only with user_allow_other in {fuse_conf}; "
                   f"allow_other = auto)")


def _who_short() -> str:
    uid = os.geteuid()
    return f"uid {uid} ({_user(uid)})"
