"""Shared command-line plumbing: bad input becomes one clear line on stderr, never a traceback.

- ``ConfigError`` / ``UsageError`` / ``FileNotFoundError`` / ``NotADirectoryError`` / ``IsADirectoryError`` /
  ``PermissionError``: the input is wrong (a flag, a file, a layout): ``error: ...``, exit code 2;
- ``RunError``: the run failed for a reason outside the input (disk full during a save, a read error on the
  token store): ``error: ...``, exit code 1; the message says what was kept (e.g. which checkpoint ``latest``
  still names);
- out of memory (``torch.OutOfMemoryError`` on a device, the CPU allocator's error on the host): ``error: ...``
  with torch's own first line and what needs less memory, exit code 1.
"""
from __future__ import annotations

import argparse
import functools
import sys

from .config import ConfigError


class UsageError(Exception):
    """A user error worth one line (missing file, wrong flag combination, ...)."""


class RunError(Exception):
    """The run failed (not the input's fault); one line, exit code 1."""


USAGE_ERRORS = (ConfigError, UsageError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _line(e: BaseException) -> str:
    msg = " ".join(str(e).split("\n")).strip() or type(e).__name__
    return f"error: {msg}"


def friendly_errors(main):
    """Wrap a CLI ``main``: usage errors -> 'error: ...' and exit 2; ``RunError`` -> 'error: ...' and exit 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except RunError as e:
            print(_line(e), file=sys.stderr)
            sys.exit(1)
        except USAGE_ERRORS as e:
            print(_line(e), file=sys.stderr)
            sys.exit(2)
        except Exception as e:
            # torch.OutOfMemoryError (a device), or the CPU allocator's RuntimeError; torch is not imported here
            if type(e).__name__ != "OutOfMemoryError" and "can't allocate memory" not in str(e):
                raise
            first = (str(e).strip().splitlines() or ["out of memory"])[0]
            print(f"error: out of memory ({first}); a smaller --micro-batch-size, "
                  "--recompute-granularity selective (or full), or no --cuda-graph-impl local (layer graphs keep "
                  "memory pools of their own) needs less; checkpoints already written are kept", file=sys.stderr)
            sys.exit(1)

    return wrapper


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <what> (see --help)`` and exit code 2, no usage block."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)
