"""The rollout driver's errors: a leaf, so multi-turn and the driver raise the same ones."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A rollout batch could not be produced (an engine refused a request, retries ran out, ...)."""


class NoEngineError(RolloutError):
    """Every engine of the driver is dead; the message names each one and why."""

    restartable = True  # a restart starts the engines again (roles.tasks: the controller restarts the steps)


class RequestTimeout(RolloutError):
    """A request got no answer within ``rollout.request_timeout_s`` (its total, across attempts and engines)."""

    restartable = True  # the engines did not answer: the machinery (a restart starts them again), not the recipe
