"""Checkpoint profiles: which directories are *staged* until sealed, and which closed
files seal them (DESIGN.md promise 4).  Pure name logic: knows nothing of inodes, the
store or FUSE.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    name: str
    pattern: str                                  # glob on the directory's own name
    marks: tuple[str, ...] = ()                   # closed directly inside it: seal it
    pointers: tuple[str, ...] = ()                # closed in its parent, naming it: seal it

    def matches(self, dirname: str) -> bool:
        return fnmatch.fnmatchcase(dirname, self.pattern)


DEFAULT_PROFILES: tuple[Profile, ...] = (
    Profile("hf-trainer", "checkpoint-*", marks=("trainer_state.json", ".metadata")),
    Profile("checkpoint_", "checkpoint_*", marks=("trainer_state.json", ".metadata",
                                                  "commit_success.txt")),
    Profile("deepspeed", "global_step*", marks=(".metadata",), pointers=("latest",)),
    Profile("megatron", "iter_[0-9][0-9][0-9][0-9][0-9][0-9][0-9]",
            pointers=("latest_checkpointed_iteration.txt",)),
    Profile("orbax", "*.orbax-checkpoint-tmp", marks=("commit_success.txt",)),
)


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

    def is_pointer(self, filename: bytes) -> bool:
        f = filename.decode("utf-8", "surrogateescape")
        return any(f in p.pointers for p in self.profiles)

    def pointed_names(self, filename: bytes, content: bytes) -> list[bytes]:
        """Names of sibling directories a pointer file's content may name."""
        if not self.is_pointer(filename) or len(content) > 4096:
            return []
        text = content.decode("utf-8", "replace").strip()
        if not text or "/" in text or "\0" in text:
            return []
        names = [text]
        if re.fullmatch(r"\d+", text):
            n = int(text)
            names += [f"iter_{n:07d}", f"global_step{n}"]
        f = filename.decode("utf-8", "surrogateescape")
        out = []
        for candidate in names:
            if any(f in p.pointers and p.matches(candidate) for p in self.profiles) \
                    or candidate == text:
                out.append(candidate.encode("utf-8", "surrogateescape"))
        return out
