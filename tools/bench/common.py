"""What every benchmark in tools/bench/ reports the same way: the machine it ran on, and the append to
docs/benchmarks.md (append only: several tools write there; newest last)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine(*versions: str) -> str:
    """``node: CPU model, N CPUs, Python x, <versions>; load average a, b, c at start``."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    parts = [f"{os.cpu_count()} CPUs", f"Python {platform.python_version()}", *versions]
    return f"{platform.node()}: {cpu}, {', '.join(parts)}; load average {load} at start"


def append(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` as a new section of the benchmarks file (created with its heading if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        if f.tell() == 0:
            f.write("# Benchmarks\n\nAppended by the tools in tools/bench/; newest last.\n\n")
        f.write("\n" + text.rstrip("\n") + "\n")
    print(f"appended to {path}")
