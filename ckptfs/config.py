"""Settings for a mount: defaults, then the TOML file, then ``CKPTFS_*`` variables, then
command-line flags (DESIGN.md §5).  Unknown keys are errors, with one line naming them.
Knows nothing of how the settings are used."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .remote import MAX_CHUNK_SIZE
from .profiles import DEFAULT_PROFILES, TEXT, Profile, Profiles

DEFAULT_CONFIG_FILE = Path("/etc/ckptfs/ckptfs.toml")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(ValueError):
    pass


def parse_size(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
    number = text[:-1] if unit else text
    try:
        size = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ConfigError(f"not a size: {value!r}") from None
    if size <= 0:
        raise ConfigError(f"size must be positive: {value!r}")
    return size


def parse_chunk_size(value) -> int:
    size = parse_size(value)
    if size > MAX_CHUNK_SIZE:
        raise ConfigError(f"chunk size must be at most {MAX_CHUNK_SIZE >> 20} MiB: {value!r}")
    return size


def parse_bool(value) -> bool:
    if isinstance(value, bool):
        return value
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


def _number(cast, what: str, zero_ok: bool):
    def parse(value):
        try:
            n = cast(value)
        except (TypeError, ValueError):
            raise ConfigError(f"not {what}: {value!r}") from None
        if n < 0 or (n == 0 and not zero_ok):
            raise ConfigError(f"must be {'non-negative' if zero_ok else 'positive'}: {value!r}")
        return n
    return parse


parse_positive_int = _number(int, "a whole number", zero_ok=False)
parse_seconds = _number(float, "a number of seconds", zero_ok=True)


def parse_checkpoint_formats(value) -> tuple[str, ...]:
    """Formats whose structure is checked before a close publishes (formats.FORMATS):
    a comma list or a TOML array; empty turns the check off."""
    from .formats import parse_formats

    text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
    try:
        return parse_formats(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


_KEYS = {
    "store": str,
    "endpoint_url": str,
    "state_dir": str,
    "durability": parse_durability,
    "single_writer": parse_bool,
    "chunk_size": parse_chunk_size,
    "cache_size": parse_size,
    "metadata_ttl": parse_seconds,
    "upload_concurrency": parse_positive_int,
    "fetch_concurrency": parse_positive_int,
    "gc_grace": parse_seconds,
    "gc_settle": parse_seconds,
    "writeback_cache": parse_bool,
    "checkpoint_formats": parse_checkpoint_formats,
    "lease_ttl": _number(float, "a number of seconds", zero_ok=False),
    "stale_staged_after": parse_seconds,
}


@dataclass
class Settings:
    store: str | None = None
    endpoint_url: str | None = None
    state_dir: str | None = None
    durability: str = "sync"
    single_writer: bool = False
    chunk_size: int = 8 << 20
    cache_size: int = 8 << 30
    metadata_ttl: float = 1.0
    upload_concurrency: int = 8
    fetch_concurrency: int = 8
    gc_grace: float = 24 * 3600.0
    # How long gc waits after announcing a pass before it relies on writers having seen
    # it (decision 0003).  Recorded in a new store's ckptfs.json; the store's value wins.
    gc_settle: float = 600.0
    writeback_cache: bool = False
    checkpoint_formats: tuple[str, ...] = ("torch", "safetensors", "npy", "pickle")
    lease_ttl: float = 30.0
    stale_staged_after: float = 600.0   # report a staged directory nobody writes or seals
    profiles: Profiles = field(default_factory=Profiles)


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
        unknown = set(doc) - set(_KEYS) - {"profiles", "extra_profiles"}
        if unknown:
            raise ConfigError(f"config file {path}: unknown key(s) {', '.join(sorted(unknown))}")
        for key, value in doc.items():
            if key == "profiles":
                settings.profiles = _profiles(value)
            elif key == "extra_profiles":
                settings.profiles = Profiles(DEFAULT_PROFILES + _profiles(value).profiles)
            else:
                setattr(settings, key, _apply(key, value, f"config file {path}"))
    for name, value in env.items():
        if not name.startswith("CKPTFS_") or name in ("CKPTFS_FAULTS",):
            continue
        key = name[len("CKPTFS_"):].lower()
        if key not in _KEYS:
            raise ConfigError(f"unknown environment variable {name}")
        setattr(settings, key, _apply(key, value, name))
    for key, value in flags.items():
        if value is not None:
            setattr(settings, key, _apply(key, value, f"--{key.replace('_', '-')}"))
    return settings


def _apply(key: str, value, where: str):
    try:
        return _KEYS[key](value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {key}: {exc}") from None
