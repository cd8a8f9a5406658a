"""The command line: argument parsing, the API client of the control socket, display."""

from .commands import main

__all__ = ["main"]
