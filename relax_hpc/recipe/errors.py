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
        for key, value, msg in self.problems:
            shown = "" if value is _MISSING else f" = {value!r}"
            lines.append(f"  - {key}{shown}: {msg}")
        return "\n".join(lines)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
"""Marks a problem about a key whose value is not worth showing (an unknown section, say)."""
