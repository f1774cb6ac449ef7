"""Errors that say whether doing the same work again can succeed.

A :class:`PermanentError` will happen again if the same work is done again: bad data, a bad recipe value, a user
function that raises the same way, a training step that is not finite under ``train.nonfinite: fail``. The
controller fails the run at once with its reason instead of restarting the steps (restarts are for what a restart
can fix: a node that died, an engine that crashed, a hung collective). Any module may raise one; this module
imports nothing of the package, so no import cycle can go through it.
"""

from __future__ import annotations


class PermanentError(Exception):
    """An error a restart cannot fix. Subclass it, or raise it directly with a message that names the key, the
    value and the fix."""

    permanent = True
    restartable = False


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
