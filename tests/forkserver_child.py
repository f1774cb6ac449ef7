"""Run by tests/test_forkserver.py as ``python -m forkserver_child OUT ACTION``: writes what a started process sees
to OUT (JSON), then does ACTION (exit N, message, raise, interrupt, sleep, atexit, thread)."""

import atexit
import json
import os
import sys
import threading
from pathlib import Path


def report() -> dict:
    import numpy as np

    return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "cwd": os.getcwd(),
            "argv": sys.argv[1:], "main": __name__, "foo": os.environ.get("FORKSERVER_TEST_FOO"),
            "stdin": os.path.realpath("/proc/self/fd/0"), "path0": sys.path[0], "draw": float(np.random.random()),
            "title": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").strip().decode().split(" ")[1:],
            "affinity": sorted(os.sched_getaffinity(0))}


if __name__ == "__main__":
    out, action = sys.argv[1], sys.argv[2]
    Path(out).write_text(json.dumps(report()))
    print("stdout line", flush=True)
    if action.startswith("exit"):
        sys.exit(int(action[4:]))
    if action == "message":
        sys.exit("a message for stderr")
    if action == "raise":
        raise RuntimeError("raised in the child")
    if action == "interrupt":
        raise KeyboardInterrupt
    if action == "sleep":
        threading.Event().wait()
    if action == "atexit":
        atexit.register(lambda: print("atexit ran"))
        print("buffered, not flushed", end="")
    if action == "thread":
        def late() -> None:
            threading.Event().wait(0.5)  # still running when the main thread returns
            Path(out + ".thread").write_text("the thread finished")

        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
