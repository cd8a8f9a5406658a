"""Settings for a mount: defaults, then the TOML file, then ``CKPTFS_*`` variables, then
command-line flags (DESIGN.md §5).  One table (``SETTINGS``) names each setting once, with
its type, default, validation and help: the TOML keys, the variables, the ``ckptfs mount``
flags (``cli``) and the ``Settings`` defaults all come from it (``Settings`` repeats each
name with its type for the type checker; a test holds it to the table).  Unknown keys are
errors, with one line naming them.  Knows nothing of how the settings are used."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any

from ..format.chunkid import ALGORITHMS
from ..format.remote import MAX_CHUNK_SIZE
from ..format.profiles import DEFAULT_PROFILES, TEXT, Profile, Profiles

if TYPE_CHECKING:
    from ..cluster.retention import Rule

DEFAULT_CONFIG_FILE = Path("/etc/ckptfs/ckptfs.toml")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(ValueError):
    pass


DAY = 24 * 3600.0


def _finite(value, what: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"not {what}: {value!r}")
    try:
        n = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"not {what}: {value!r}") from None
    if not math.isfinite(n):
        raise ConfigError(f"must be a finite number: {value!r}")
    return n


def parse_size(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        text = str(value).strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
        number = text[:-1] if unit else text
        size = int(_finite(number, "a size", ) * _UNITS[unit]) if number else -1
    if size <= 0:
        raise ConfigError(f"size must be positive: {value!r}")
    return size


def _size_between(low: int, high: int, power_of_two: bool = False):
    def parse(value) -> int:
        size = parse_size(value)
        if not low <= size <= high:
            raise ConfigError(f"must be at least {_human(low)} and at most {_human(high)}: "
                              f"{value!r}")
        if power_of_two and size & (size - 1):
            raise ConfigError(f"must be a power of two ({_human(low)} to {_human(high)}): "
                              f"{value!r}")
        return size
    return parse


def _human(size: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"


def parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"not a boolean: {value!r}")
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {value!r}")


def parse_durability(value) -> str:
    if value not in ("sync", "async"):
        raise ConfigError(f"durability must be 'sync' or 'async', not {value!r}")
    return value


def parse_allow_other(value) -> str:
    """``auto``, ``on`` or ``off`` (a boolean's spellings are taken for on and off)."""
    text = str(value).strip().lower() if not isinstance(value, bool) else \
        ("on" if value else "off")
    if text in ("auto", "on", "off"):
        return text
    try:
        return "on" if parse_bool(text) else "off"
    except ConfigError:
        raise ConfigError(f"allow_other must be 'auto', 'on' or 'off', not {value!r}") \
            from None


def parse_passthrough(value) -> str:
    if value not in ("auto", "off"):
        raise ConfigError(f"passthrough must be 'auto' or 'off', not {value!r}")
    return value


def parse_s3_client(value) -> str:
    if value not in ("direct", "boto3"):
        raise ConfigError(f"s3_client must be 'direct' or 'boto3', not {value!r}")
    return value


def parse_chunk_hash(value) -> str:
    if value not in ALGORITHMS:
        raise ConfigError(f"chunk_hash must be one of {', '.join(ALGORITHMS)}, not {value!r}")
    return str(value)


def _count(low: int, high: int):
    def parse(value) -> int:
        n = _finite(value, "a whole number")
        if n != int(n):
            raise ConfigError(f"not a whole number: {value!r}")
        if not low <= n <= high:
            raise ConfigError(f"must be between {low} and {high}: {value!r}")
        return int(n)
    return parse


def _seconds(low: float, high: float, low_ok: bool = True):
    def parse(value) -> float:
        n = _finite(value, "a number of seconds")
        if n < 0:
            raise ConfigError(f"must be non-negative: {value!r}")
        if n < low or (n == low and not low_ok) or n > high:
            bound = f"at least {low:g}" if low_ok else f"more than {low:g}"
            days = high / DAY
            top = f"{days:g} day{'s' if days != 1 else ''}" if high >= DAY else f"{high:g} seconds"
            raise ConfigError(f"must be {bound} seconds and at most {top}: {value!r}")
        return n
    return parse


parse_positive_int = _count(1, 1 << 30)
parse_seconds = _seconds(0.0, 3650 * DAY)


def parse_checkpoint_formats(value) -> tuple[str, ...]:
    """Formats whose structure is checked before a close publishes (formats.FORMATS):
    a comma list or a TOML array; empty turns the check off."""
    from ..format.checkpoints import parse_formats

    text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
    try:
        return parse_formats(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_metrics_address(value) -> str:
    from .metrics import parse_address
    try:
        parse_address(str(value))
    except ValueError as exc:
        raise ConfigError(f"{exc} (give HOST:PORT, e.g. 127.0.0.1:9464)") from None
    return str(value)


def parse_peer_address(value) -> str:
    from .metrics import parse_address
    try:
        host, port = parse_address(str(value))
    except ValueError as exc:
        raise ConfigError(f"{exc} (give HOST:PORT, e.g. 10.0.0.5:7601)") from None
    if port == 0:
        raise ConfigError(f"give a port other nodes can reach, not 0: {value!r}")
    return str(value)


@dataclass(frozen=True)
class Setting:
    """One mount setting: every place it can be given comes from this row.  The TOML key
    is ``name``; the variable is ``CKPTFS_<NAME>``; the flag is ``--<name-with-dashes>``
    (with ``help``; a ``switch`` flag takes no value, a ``choice`` flag one of
    ``choices``).  ``parse`` turns a value from any source into ``type`` or raises
    ``ConfigError`` with the reason."""

    name: str
    type: type | UnionType
    default: object
    parse: Callable[[object], object]
    help: str | None = None
    kind: str = "value"              # value | switch | choice
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "CKPTFS_" + self.name.upper()

    @property
    def toml_key(self) -> str:
        return self.name


def _text(value) -> str:
    return str(value)


# The one table of mount settings (defaults < TOML file < CKPTFS_* < flags).  A new
# setting is one row here, its typed field in Settings below, and a field in the settings'
# consumer (fs.Config for the filesystem core); a test holds both to this table.
SETTINGS: tuple[Setting, ...] = (
    Setting("store", str | None, None, _text, "file:///path or s3://bucket/prefix"),
    Setting("endpoint_url", str | None, None, _text,
            "S3 endpoint (default: AWS variables/config)"),
    Setting("state_dir", str | None, None, _text,
            "node-local state (default /var/lib/ckptfs/<mountpoint>)"),
    Setting("durability", str, "sync", parse_durability, None, "choice", ("sync", "async")),
    Setting("single_writer", bool, False, parse_bool,
            "accept a store without conditional writes", "switch"),
    # A chunk is a power of two up to 64 MiB (remote.MAX_CHUNK_SIZE: every node must be
    # able to read it).  64 KiB at least: smaller chunks are for tests (the model tests
    # use 64K), never sensible in production (8 MiB is the default).
    Setting("chunk_size", int, 8 << 20,
            _size_between(64 << 10, MAX_CHUNK_SIZE, power_of_two=True),
            "chunk size (default 8M)"),
    Setting("cache_size", int, 8 << 30, _size_between(1 << 20, 1 << 50),
            "node cache limit (default 8G)"),
    Setting("metadata_ttl", float, 1.0, _seconds(0.0, DAY),
            "seconds a remote listing is trusted (default 1)"),
    Setting("upload_concurrency", int, 8, _count(1, 1024),
            "chunk uploads in flight (default 8)"),
    Setting("fetch_concurrency", int, 8, _count(1, 1024),
            "chunk downloads in flight (default 8)"),
    Setting("gc_grace", float, DAY, parse_seconds,
            "seconds before gc may remove staged trees (default 86400)"),
    # How long gc waits after announcing a pass before it relies on writers having seen
    # it (decision 0003).  Recorded in a new store's ckptfs.json; the store's value wins.
    Setting("gc_settle", float, 600.0, parse_seconds,
            "seconds gc lets writers see each announcement (recorded when this mount "
            "creates the store; default 600)"),
    Setting("writeback_cache", bool, False, parse_bool,
            "let the kernel buffer writes (experimental)", "switch"),
    # Kernel FUSE passthrough (README "The data path"): auto uses it where the kernel, the
    # pyfuse3 build and CAP_SYS_ADMIN allow (and writeback_cache is off); off: never.
    Setting("passthrough", str, "auto", parse_passthrough,
            "kernel passthrough for new files' writes: auto (default) or off", "choice",
            ("auto", "off")),
    Setting("checkpoint_formats", tuple[str, ...], ("torch", "safetensors", "npy", "pickle"),
            parse_checkpoint_formats,
            "formats whose structure is checked before a close publishes "
            "(default torch,safetensors,npy,pickle; empty: none)"),
    Setting("lease_ttl", float, 30.0, _seconds(0.0, DAY, low_ok=False),
            "seconds a node's seal lease lives unrenewed (default 30; see "
            "docs/decisions/0004)"),
    # Report a staged directory nobody writes or seals (stale.py).
    Setting("stale_staged_after", float, 600.0, parse_seconds,
            "seconds after which a staged checkpoint directory that nothing writes and "
            "nobody sealed is reported (default 600)"),
    # The overall bound of one store call, all retries together; past it, EIO.
    Setting("store_timeout", float, 60.0, _seconds(1.0, DAY),
            "seconds one store request may take, retries included, before it fails "
            "with EIO (default 60)"),
    # How long an unmount (or SIGTERM) waits for pending uploads before it unmounts
    # anyway, leaving them journaled for the next mount.
    Setting("stop_timeout", float, 600.0, _seconds(0.0, 7 * DAY),
            "seconds an unmount or SIGTERM waits for pending uploads before unmounting "
            "anyway, uploads kept journaled (default 600)"),
    # Async mode: closed bytes not yet uploaded past which writers wait for uploads
    # (default: half the state dir's free space at mount).
    Setting("max_staged", int | None, None, _size_between(1 << 20, 1 << 60),
            "async mode: closed bytes not yet uploaded past which writers wait for uploads "
            "(default: half the state dir's free space at mount)"),
    # Async mode: background uploads wait while a writer writes (decision 0015), at most
    # this long at a stretch; then they go beside it one at a time.
    Setting("upload_hold", float, 10.0, _seconds(0.0, DAY),
            "async mode: seconds uploads wait for a writing process to pause before they "
            "go beside it one at a time (default 10; 0: at once)"),
    # How chunk bytes move to and from S3 (decision 0014): "direct" sends PUT/GET of
    # whole objects over http.client with botocore's signer; "boto3" uses boto3 for all.
    Setting("s3_client", str, "direct", parse_s3_client,
            "S3 client for object bytes: direct (lean, default) or boto3", "choice",
            ("direct", "boto3")),
    # Other users (and root) may use the mount (FUSE's allow_other): auto is on where
    # permitted (root, or user_allow_other in /etc/fuse.conf: preflight.py), else off.
    Setting("allow_other", str, "auto", parse_allow_other,
            "let other users use the mount: auto (on for root or with user_allow_other "
            "in /etc/fuse.conf, else off; default), on, off", "choice",
            ("auto", "on", "off")),
    # How new chunks are named (format/chunkid.py; decision 0025): blake3 costs about
    # half sha256's CPU per byte; a store's first blake3 chunk needs format v2, which
    # ckptfs releases before it refuse to mount.  sha256 keeps a v1 store v1.
    Setting("chunk_hash", str, "blake3", parse_chunk_hash,
            "hash naming new chunks: blake3 (default; upgrades a format-1 store to 2) or "
            "sha256 (format 1, readable by older releases)", "choice", ALGORITHMS),
    # Prometheus text on http://HOST:PORT/metrics (metrics.py); unset: no server.
    Setting("metrics_address", str | None, None, parse_metrics_address,
            "serve Prometheus metrics at http://HOST:PORT/metrics (default: none)"),
    # Nodes of one store serve each other chunks (cluster/peers.py); unset: no peers.
    Setting("peer_listen", str | None, None, parse_peer_address,
            "serve cached chunks to the other nodes of this store on HOST:PORT and fetch "
            "from them first (default: off)"),
    Setting("peer_advertise", str | None, None, parse_peer_address,
            "the HOST:PORT other nodes reach this node's peer server at (default: "
            "--peer-listen)"),
    Setting("peer_timeout", float, 10.0, _seconds(0.1, 3600.0),
            "seconds a chunk from a peer may take (from a relay: twice that) before the "
            "next peer or the store is asked (default 10)"),
    # Above this many askers a chunk's owner serves ceil(sqrt(askers)) relays, which
    # serve the rest (the second hop: cluster/peer_route.py).
    Setting("peer_fanout", int, 8, parse_positive_int,
            "nodes that ask a chunk's owner directly; with more, the next-ranked nodes "
            "relay it to the others (default 8)"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# Read from the environment by others, not settings (tests' fault injection).
OTHER_ENV = ("CKPTFS_FAULTS",)
# TOML-only tables: the checkpoint profiles (replacing the defaults, or added to them).
PROFILE_KEYS = ("profiles", "extra_profiles")
# TOML-only tables: retention rules ([[retention]], retention.py).
TABLE_KEYS = PROFILE_KEYS + ("retention",)

def _default(name: str) -> Any:
    return BY_NAME[name].default


@dataclass
class Settings:
    """The resolved settings of one mount: one field per row of SETTINGS, in its order,
    with the row's type and its default (tests/unit/test_settings_table.py holds the
    fields to the table), plus the profiles and the retention rules."""

    store: str | None = _default("store")
    endpoint_url: str | None = _default("endpoint_url")
    state_dir: str | None = _default("state_dir")
    durability: str = _default("durability")
    single_writer: bool = _default("single_writer")
    chunk_size: int = _default("chunk_size")
    cache_size: int = _default("cache_size")
    metadata_ttl: float = _default("metadata_ttl")
    upload_concurrency: int = _default("upload_concurrency")
    fetch_concurrency: int = _default("fetch_concurrency")
    gc_grace: float = _default("gc_grace")
    gc_settle: float = _default("gc_settle")
    writeback_cache: bool = _default("writeback_cache")
    passthrough: str = _default("passthrough")
    checkpoint_formats: tuple[str, ...] = _default("checkpoint_formats")
    lease_ttl: float = _default("lease_ttl")
    stale_staged_after: float = _default("stale_staged_after")
    store_timeout: float = _default("store_timeout")
    stop_timeout: float = _default("stop_timeout")
    max_staged: int | None = _default("max_staged")
    upload_hold: float = _default("upload_hold")
    s3_client: str = _default("s3_client")
    allow_other: str = _default("allow_other")
    chunk_hash: str = _default("chunk_hash")
    metrics_address: str | None = _default("metrics_address")
    peer_listen: str | None = _default("peer_listen")
    peer_advertise: str | None = _default("peer_advertise")
    peer_timeout: float = _default("peer_timeout")
    peer_fanout: int = _default("peer_fanout")
    profiles: Profiles = field(default_factory=Profiles)
    retention: tuple[Rule, ...] = ()        # one per [[retention]]


def _profiles(raw) -> Profiles:
    if not isinstance(raw, list):
        raise ConfigError("profiles must be an array of tables ([[profiles]])")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"profiles[{i}] is not a table")
        unknown = set(item) - {"name", "pattern", "marks", "pointers", "pointer_kind"}
        if unknown:
            raise ConfigError(f"profiles[{i}]: unknown key(s) {', '.join(sorted(unknown))}")
        if not isinstance(item.get("pattern"), str) or not item["pattern"]:
            raise ConfigError(f"profiles[{i}] needs a pattern")
        try:
            out.append(Profile(name=str(item.get("name", item["pattern"])),
                               pattern=item["pattern"], marks=tuple(item.get("marks", ())),
                               pointers=tuple(item.get("pointers", ())),
                               pointer_kind=item.get("pointer_kind", TEXT)))
        except ValueError as exc:
            raise ConfigError(f"profiles[{i}]: {exc}") from None
    return Profiles(tuple(out))


def _retention(raw) -> tuple[Rule, ...]:
    from ..cluster.retention import Rule
    if not isinstance(raw, list):
        raise ConfigError("retention must be an array of tables ([[retention]])")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"retention[{i}] is not a table")
        unknown = set(item) - {"pattern", "keep_last"}
        if unknown:
            raise ConfigError(f"retention[{i}]: unknown key(s) {', '.join(sorted(unknown))}")
        if not isinstance(item.get("pattern"), str) or not item["pattern"]:
            raise ConfigError(f"retention[{i}] needs a pattern")
        keep = item.get("keep_last")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"retention[{i}]: keep_last must be a whole number of at "
                              f"least 1, not {keep!r}")
        out.append(Rule(item["pattern"], keep))
    return tuple(out)


def load(config_file: Path | None, env: dict[str, str], flags: dict) -> Settings:
    """Merge defaults < file < environment < flags (flags whose value is None are unset)."""
    settings = Settings()
    path = config_file
    if path is None and DEFAULT_CONFIG_FILE.exists():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        by_toml = {st.toml_key: st for st in SETTINGS}
        unknown = set(doc) - set(by_toml) - set(TABLE_KEYS)
        if unknown:
            raise ConfigError(f"config file {path}: unknown key(s) {', '.join(sorted(unknown))}")
        for key, value in doc.items():
            if key == "profiles":
                settings.profiles = _profiles(value)
            elif key == "retention":
                settings.retention = _retention(value)
            elif key == "extra_profiles":
                settings.profiles = Profiles(DEFAULT_PROFILES + _profiles(value).profiles)
            else:
                _apply(settings, by_toml[key], value, f"config file {path}")
    by_env = {st.env: st for st in SETTINGS}
    for name, value in env.items():
        if not name.startswith("CKPTFS_") or name in OTHER_ENV:
            continue
        if name not in by_env:
            raise ConfigError(f"unknown environment variable {name}")
        _apply(settings, by_env[name], value, name)
    for key, value in flags.items():
        if value is not None:
            _apply(settings, BY_NAME[key], value, BY_NAME[key].flag)
    return settings


def _apply(settings, setting: Setting, value, where: str) -> None:
    try:
        setattr(settings, setting.name, setting.parse(value))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {setting.name}: {exc}") from None
