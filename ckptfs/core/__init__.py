"""The filesystem core, one module per concern; ``Filesystem`` is the façade."""

from .entries import entry_identity
from .filesystem import Filesystem
from .names import check_name_or_raise
from .state import (MAX_STAGED_FRACTION, RENAME_EXCHANGE, RENAME_NOREPLACE, Config,
                    Handle, Runtime, Session)

__all__ = ["Config", "Filesystem", "Handle", "MAX_STAGED_FRACTION", "RENAME_EXCHANGE",
           "RENAME_NOREPLACE", "Runtime", "Session", "check_name_or_raise",
           "entry_identity"]
