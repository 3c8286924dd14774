"""Shared command-line plumbing: bad input becomes one clear line on stderr and exit code 2."""
from __future__ import annotations

import functools
import sys

from .config import ConfigError


class UsageError(Exception):
    """A user error worth one line (missing file, wrong flag combination, ...)."""


def friendly_errors(main):
    """Wrap a CLI ``main``: ConfigError/UsageError/FileNotFoundError -> 'error: ...' and exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ConfigError, UsageError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
