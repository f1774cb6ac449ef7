"""Answer extraction and comparison for the rule rewards: the last ``\\boxed{}``, "####", the last number;
normalization; numeric equality. A leaf: it imports nothing of relax_hpc."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-+]?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), braces balanced; None if none."""
    if not text:
        return None
    matches = list(_BOXED.finditer(text))
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
                j += 1
            continue  # unbalanced: try an earlier one
        word = re.match(r"[^\s$]+", text[i:])
        if word:
            return word.group(0).strip()
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` ("1,234", "-3.5", "7/2"), or None."""
    if not text:
        return None
    found = _NUMBER.findall(text)
    return found[-1].strip() if found else None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last ``\\boxed{}``, else what follows "####" (GSM8K), else the last number."""
    if text is None:
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail.split("\n", 1)[0].strip()
    return extract_last_number(text)


def normalize_answer(ans: str) -> str:
    """A canonical string for a math answer: LaTeX wrappers, spaces, ``$``, trailing dots and units marks dropped."""
    s = str(ans).strip()
    inner = extract_boxed(s)
    if inner is not None:
        s = inner
    s = _TEXT.sub(r"\1", s)
    for tok in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%",
                "\\displaystyle"):
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if s.startswith("x=") or s.startswith("y=") or s.startswith("k=") or s.startswith("n="):
        s = s[2:]
    return s.lower()


def to_number(ans: str) -> Fraction | float | None:
    """The value of a numeric answer ("1,000", "-3.50", "7/2", "\\frac{7}{2}", "-\\frac{1}{3}", "2.5e3"), else None."""
    s = normalize_answer(ans)
    m = re.fullmatch(r"([-+]?)\\frac\{([^{}]*)\}\{([^{}]*)\}", s)
    if m:
        num, den = to_number(m.group(2)), to_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        val = Fraction(num) / Fraction(den) if not isinstance(num, float) and not isinstance(den, float) else num / den
        return -val if m.group(1) == "-" else val
    s = s.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    if "/" in s:
        a, _, b = s.partition("/")
        na, nb = to_number(a), to_number(b)
        if na is None or nb is None or nb == 0:
            return None
        return Fraction(na) / Fraction(nb) if isinstance(na, Fraction) and isinstance(nb, Fraction) else na / nb
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        pass
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def math_equal(pred: str | None, label: Any, *, rel_tol: float = 1e-6) -> bool:
    """Numerically equal when both are numbers (relative tolerance ``rel_tol``), else equal after normalization."""
    if pred is None or label is None:
        return False
    label = str(label)
    a, b = to_number(pred), to_number(label)
    if a is not None and b is not None:
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=rel_tol)
    return normalize_answer(pred) == normalize_answer(label)


def label_answer(label: Any) -> str:
    """The answer in a label: the label itself, or the final answer when it is a whole solution."""
    s = str(label)
    if "\\boxed" in s or "####" in s:
        return extract_answer(s) or s
    return s
