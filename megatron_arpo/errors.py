"""The one exception family the command line turns into exit code 2.

``InputError`` marks a problem with what the user gave a command — a config file, a dataset row, an SFT
file, a checkpoint to resume from, a tool setting the machine cannot honour — as opposed to a failure
of the run itself. Its message names the file/key/row and the fix; ``megatron_arpo.cli`` prints it on
one line, with no traceback, and exits 2. ``ConfigError``, ``DatasetError``, ``SFTDataError`` and
``ResumeError`` are InputErrors.

:func:`as_symlink_loop` turns the two ways a symlink loop surfaces (``OSError`` ELOOP from the OS,
``RuntimeError`` from Python 3.11's ``Path.resolve``) into one such error, wherever a path was followed.
:func:`first_line` is the one-line summary of an exception that messages quote.
"""

import errno
from typing import Sequence


class InputError(ValueError):
    """Bad user input; the message says what is wrong, where, and how to fix it."""


class ConfigError(InputError):
    """An invalid experiment config; ``errors`` lists each problem as ``key.path: message``."""

    def __init__(self, errors: Sequence[str] | str, source: str | None = None):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(prefix + "; ".join(self.errors))


class SymlinkLoopError(InputError):
    """A path runs into links that point back to each other."""


def as_symlink_loop(exc: BaseException) -> SymlinkLoopError | None:
    """The InputError for ``exc`` when it reports a symlink loop, else None."""
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        path = exc.filename
    elif isinstance(exc, RuntimeError) and str(exc).startswith("Symlink loop from "):
        path = str(exc)[len("Symlink loop from "):].strip("'\"")
    else:
        return None
    return SymlinkLoopError(f"{path}: a symlink loop (links that point back to each other); fix or remove the "
                            f"link, or give the real path")


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when the message is empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
