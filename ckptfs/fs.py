"""Compatibility: the filesystem core moved to ``ckptfs.core``."""

from .core import *  # noqa: F401,F403
from .core import __all__  # noqa: F401
