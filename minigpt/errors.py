"""The one base of every error a user can cause, and the one way a command line reports it.

`UserError` is what minigpt raises for input it refuses: a bad value, a preset that cannot
apply, a damaged run, a prompt too long, a file that is not what it claims. Its message says
what is wrong and what to do, in one line. Every command line runs inside `reported`, which
prints any `UserError` as `error: <message>` on stderr and exits with its `exit_code` (2; 3 for
a run whose training diverged), and lets everything else through as a traceback: a traceback
means a bug of ours, never a mistake of the user's. A disk that fills or a folder that cannot be
written is the machine's state, not a bug: `reported` turns those OSErrors into one line too.

The errors keep the built-in class they had before this base existed (`ConfigError` is still a
`ValueError`), so code that caught those goes on catching them.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Callable, Iterator


class UserError(Exception):
    """An error a user can cause; the message says what is wrong and what to do."""

    exit_code = 2


class TokenizerError(UserError, RuntimeError):
    """A tokenizer cannot be loaded or refuses a text (`minigpt.tokenizer`, which exports it);
    the message says what to do about it."""


# The reasons a write fails that are the machine's state, not a bug: a full disk or quota, a
# read-only or foreign folder, a file past its size limit.
WRITE_FAULTS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def write_fault(error: BaseException) -> str | None:
    """The one-line refusal of a failed write that is the machine's state (`WRITE_FAULTS`):
    what could not be written and why; None for any other error."""
    if not isinstance(error, OSError) or error.errno not in WRITE_FAULTS:
        return None
    return (f"cannot write {error.filename or 'a file'}: {error.strerror}. What was written "
            f"before is kept; once the cause is gone (free space, a writable folder), run the "
            f"command again (a training run: with --resume)")


@contextlib.contextmanager
def reported(exit: Callable[[int], object] = sys.exit) -> Iterator[None]:
    """Run a command line's work: a `UserError` (or a write the machine refused) becomes one
    `error:` line on stderr and `exit(code)`; anything else propagates as it is."""
    try:
        yield
    except UserError as error:
        _say(error)
        exit(error.exit_code)
    except OSError as error:
        why = write_fault(error)
        if why is None:
            raise
        _say(why)
        exit(2)


def _say(error: BaseException | str) -> None:
    text = " ".join(str(error).split("\n")).strip() or type(error).__name__
    print(f"error: {text}", file=sys.stderr, flush=True)


def exit_code(fn: Callable[[], object]) -> int:
    """`fn()` as a command line's `main` returns it: 0, or the code of the error `reported`
    printed (for `main` functions that return their status rather than exit)."""
    codes: list[int] = []
    with reported(exit=codes.append):
        result = fn()
        return int(result or 0)
    return codes[0]
