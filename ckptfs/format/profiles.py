"""Checkpoint profiles: which directories are *staged* until sealed, and which closed
files seal them (DESIGN.md promise 4).  Pure name and content logic: knows nothing of
inodes, the store or FUSE.

A *mark* is closed (or renamed) directly inside the directory it seals.  A *pointer* is
closed (or renamed) in the directory's parent and names it; how its content is read is
the profile's ``pointer_kind``:

- ``text``: the whole file is one sibling's name (DeepSpeed's ``latest``); a bare number
  also names ``iter_%07d`` (Megatron) and ``global_step%d`` (DeepSpeed).
- ``ray-snapshot``: Ray Train's ``checkpoint_manager_snapshot.json``, which the
  controller rewrites after each checkpoint is in place; every ``checkpoint_dir_name``
  in it names a checkpoint Ray has recorded (all kept ones, the latest among them).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

TEXT = "text"
RAY_SNAPSHOT = "ray-snapshot"

# How many bytes of a pointer file are read: a larger file is not a pointer.  A Ray
# snapshot grows with every kept checkpoint and its metrics (about 100 bytes each).
POINTER_SIZE_LIMITS = {TEXT: 4096, RAY_SNAPSHOT: 8 << 20}


@dataclass(frozen=True)
class Profile:
    name: str
    pattern: str                                  # glob on the directory's own name
    marks: tuple[str, ...] = ()                   # closed directly inside it: seal it
    pointers: tuple[str, ...] = ()                # closed in its parent, naming it: seal it
    pointer_kind: str = TEXT                      # how a pointer's content names it

    def __post_init__(self) -> None:
        if self.pointer_kind not in POINTER_SIZE_LIMITS:
            raise ValueError(f"pointer_kind must be one of "
                             f"{', '.join(sorted(POINTER_SIZE_LIMITS))}, not {self.pointer_kind!r}")

    def matches(self, dirname: str) -> bool:
        return fnmatch.fnmatchcase(dirname, self.pattern)


DEFAULT_PROFILES: tuple[Profile, ...] = (
    Profile("hf-trainer", "checkpoint-*", marks=("trainer_state.json", ".metadata")),
    Profile("checkpoint_", "checkpoint_*", marks=("trainer_state.json", ".metadata",
                                                  "commit_success.txt")),
    Profile("ray-train", "checkpoint_*", pointers=("checkpoint_manager_snapshot.json",),
            pointer_kind=RAY_SNAPSHOT),
    Profile("deepspeed", "global_step*", marks=(".metadata",), pointers=("latest",)),
    Profile("megatron", "iter_[0-9][0-9][0-9][0-9][0-9][0-9][0-9]",
            pointers=("latest_checkpointed_iteration.txt",)),
    Profile("orbax", "*.orbax-checkpoint-tmp", marks=("commit_success.txt",)),
)


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name \
        and "\0" not in name


def _ray_snapshot_names(content: bytes) -> list[str]:
    """Every ``checkpoint_dir_name`` value in a Ray Train checkpoint manager snapshot."""
    try:
        doc = json.loads(content)
    except (ValueError, RecursionError):
        return []
    names: list[str] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "checkpoint_dir_name":
                    if _plain_name(value):
                        names.append(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return names


@dataclass
class Profiles:
    profiles: tuple[Profile, ...] = field(default=DEFAULT_PROFILES)

    def staged_on_create(self, dirname: bytes) -> bool:
        name = dirname.decode("utf-8", "surrogateescape")
        return any(p.matches(name) for p in self.profiles)

    def is_mark_for(self, dirname: bytes, filename: bytes) -> bool:
        """Does closing ``filename`` directly inside ``dirname`` seal it?"""
        d = dirname.decode("utf-8", "surrogateescape")
        f = filename.decode("utf-8", "surrogateescape")
        return any(p.matches(d) and f in p.marks for p in self.profiles)

    def _pointing(self, filename: bytes) -> list[Profile]:
        f = filename.decode("utf-8", "surrogateescape")
        return [p for p in self.profiles if f in p.pointers]

    def is_pointer(self, filename: bytes) -> bool:
        return bool(self._pointing(filename))

    def pointer_size_limit(self, filename: bytes) -> int:
        """How many bytes of ``filename`` to read as a pointer (0: it is none)."""
        return max((POINTER_SIZE_LIMITS[p.pointer_kind] for p in self._pointing(filename)),
                   default=0)

    def pointed_names(self, filename: bytes, content: bytes) -> list[bytes]:
        """Names of sibling directories a pointer file's content may name."""
        out: list[bytes] = []
        for kind in sorted({p.pointer_kind for p in self._pointing(filename)}):
            if len(content) > POINTER_SIZE_LIMITS[kind]:
                continue
            for name in _PARSERS[kind](self, filename, content):
                encoded = name.encode("utf-8", "surrogateescape")
                if encoded not in out:
                    out.append(encoded)
        return out

    def _text_names(self, filename: bytes, content: bytes) -> list[str]:
        text = content.decode("utf-8", "replace").strip()
        if not text or "/" in text or "\0" in text:
            return []
        names = [text]
        if re.fullmatch(r"\d+", text):
            n = int(text)
            names += [f"iter_{n:07d}", f"global_step{n}"]
        f = filename.decode("utf-8", "surrogateescape")
        return [candidate for candidate in names
                if candidate == text or any(f in p.pointers and p.matches(candidate)
                                            for p in self.profiles)]

    def _ray_names(self, filename: bytes, content: bytes) -> list[str]:
        return _ray_snapshot_names(content)


_PARSERS: dict[str, Callable[[Profiles, bytes, bytes], list[str]]] = {
    TEXT: Profiles._text_names,
    RAY_SNAPSHOT: Profiles._ray_names,
}
