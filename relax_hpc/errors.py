"""Errors that say whether doing the same work again can succeed.

A :class:`PermanentError` will happen again if the same work is done again: bad data, a bad recipe value, a user
function that raises the same way, a training step that is not finite under ``train.nonfinite: fail``. The
controller fails the run at once with its reason instead of restarting the steps (restarts are for what a restart
can fix: a node that died, an engine that crashed, a hung collective). Any module may raise one; this module
imports nothing of the package, so no import cycle can go through it.

:func:`verdict` is how a role classifies the error it dies of (``docs/reliability.md``, "Failure classes"):
``no_space`` (a full disk or quota: fails at once, naming the disk; a resume works once space is freed),
``permanent`` (fails at once), or None (a restart may help).
"""

from __future__ import annotations

import errno

PERMANENT, NO_SPACE = "permanent", "no_space"
VERDICTS = (PERMANENT, NO_SPACE)  # what a role's ``error`` message may say of its error (controller/protocol.py)

# Raised while a role loads its inputs (data, tokenizer, model config, user functions), before its first task,
# these are about the inputs, which a restart reads again unchanged. Not here: RuntimeError (CUDA, NCCL, gloo,
# out of memory), OSError beyond a missing or unreadable path (a network or a filesystem that may come back).
LOADING_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, LookupError, AttributeError, ImportError, SyntaxError, AssertionError,
    NotImplementedError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
# how a full disk reads where the errno is lost on the way (HDF5, torch's writers put it in the message only)
NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded")


class PermanentError(Exception):
    """An error a restart cannot fix. Subclass it, or raise it directly with a message that names the key, the
    value and the fix."""

    permanent = True
    restartable = False


def _chain(error: BaseException):
    """``error`` and the errors it was raised from or while handling, once each."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]


def is_permanent(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says it will happen again."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if getattr(e, "permanent", False) is True:
            return True
        seen.add(id(e))
        e = e.__cause__
    return False


def no_space(error: BaseException) -> BaseException | None:
    """The error in ``error``'s chain that says a filesystem is full (ENOSPC) or a quota is used up (EDQUOT),
    by its errno or, where a library kept only the text, by its message; None if none does."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
    for e in _chain(error):
        if any(t in str(e).lower() for t in NO_SPACE_TEXT):
            return e
    return None


def verdict(error: BaseException, *, loading: bool = False) -> str | None:
    """:data:`NO_SPACE`, :data:`PERMANENT` or None (a restart may help) for the error a role dies of.

    ``loading``: raised while the role loads its inputs (before its first task), where :data:`LOADING_ERRORS`
    are permanent too. A full disk comes first: a :class:`PermanentError` raised because a write failed is
    still about the disk."""
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: the process was told to go
        return None
    if no_space(error) is not None:
        return NO_SPACE
    if is_permanent(error) or (loading and isinstance(error, LOADING_ERRORS)):
        return PERMANENT
    return None
