"""The one error type a bad recipe raises: every problem at once, each naming key, value and fix."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that must not be submitted. ``problems`` is a list of (key, value, message)."""

    def __init__(self, problems: list[tuple[str, object, str]], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        where = f"recipe {self.source}" if self.source else "recipe"
        n = len(self.problems)
        lines = [f"{where} is invalid ({n} problem{'s' if n != 1 else ''}); nothing was submitted:"]
        for key, value, msg in self.problems[:MAX_SHOWN]:
            shown = "" if value is _MISSING else " = ***" if _secret(key) else f" = {short_repr(value)}"
            lines.append(f"  - {key}{shown}: {msg}")
        if n > MAX_SHOWN:
            lines.append(f"  ... and {n - MAX_SHOWN} more (fix these first)")
        return "\n".join(lines)


SECRET_KEYS = ("slurm.env", "slurm.container.env", "logging.notify_urls")  # values never shown (rundir.MASK's keys)


def _secret(key: str) -> bool:
    return any(key == k or key.startswith((k + ".", k + "[")) for k in SECRET_KEYS)


MAX_SHOWN = 50
"""Problems listed in one error (a list of 10000 wrong items is one mistake)."""


def short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: a refused value may be a 1 MB string or a 20000-item list,
    or an integer too long for Python to print."""
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits
        return f"<an integer of {value.bit_length() if isinstance(value, int) else '?'} bits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
"""Marks a problem about a key whose value is not worth showing (an unknown section, say)."""
