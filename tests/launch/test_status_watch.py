"""``relax-status --watch`` in a real terminal (a pty, as a user's ssh session is): the rich view refreshes in
place as the run moves, and the command exits by itself when the run ends, with the run's final view on screen."""

import os
import pty
import re
import select
import subprocess
import sys
import time


from relax_hpc.launch import localproc
from relax_hpc.rundir import write_json

from .conftest import base_env
from .test_status import metrics_rows, run_dir, sleeper as run_process  # noqa: F401 (a fixture)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """A child process on a pty; ``expect`` reads what it draws until a pattern shows (bounded wait)."""

    def __init__(self, argv, env):
        self.master, slave = pty.openpty()
        os.set_blocking(self.master, False)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.raw = ""

    def read(self, timeout):
        r, _, _ = select.select([self.master], [], [], timeout)
        if r:
            try:
                self.raw += os.read(self.master, 65536).decode("utf-8", "replace")
            except OSError:  # EIO: the child closed its side
                return False
        return True

    def expect(self, pattern, timeout=60.0):
        deadline = time.monotonic() + timeout
        start = len(self.raw)
        while time.monotonic() < deadline:
            if re.search(pattern, ANSI.sub("", self.raw[start:])):
                return
            if not self.read(0.5) and self.proc.poll() is not None:
                break
        raise AssertionError(f"{pattern!r} not drawn; the screen so far:\n{ANSI.sub('', self.raw)[-3000:]}")

    def wait(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.5)
        while self.read(0.1) and self.proc.poll() is not None and select.select([self.master], [], [], 0)[0]:
            pass
        return self.proc.wait(timeout=1)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def test_watch_refreshes_in_a_terminal_and_exits_with_the_run(tmp_path, run_process):
    rd = run_dir(tmp_path, "local", job_id=str(run_process.pid), pid=run_process.pid,
                 pid_start=localproc.start_ticks(run_process.pid))
    roles = {"actor": {"phase": "train", "ranks": 1}, "rollout": {"phase": "generate", "ranks": 1}}
    write_json(rd.state, {"state": "RUNNING", "step": 1, "total_steps": 3, "attempt": 0, "roles": roles})
    metrics_rows(rd, [1])
    code = "import sys; from relax_hpc.launch.cli import status_main; sys.exit(status_main(sys.argv[1:]))"
    term = Terminal([sys.executable, "-c", code, str(rd.path), "--watch", "--interval", "0.2"],
                    base_env(TERM="xterm-256color", COLUMNS="120", LINES="40"))
    try:
        term.expect(r"RUNNING")
        term.expect(r"\b1\s*/\s*3\b")
        drawn = len(term.raw)
        write_json(rd.state, {"state": "RUNNING", "step": 2, "total_steps": 3, "attempt": 0, "roles": roles})
        metrics_rows(rd, [1, 2])
        term.expect(r"\b2\s*/\s*3\b")
        # the progress: the reward (last, mean), the time per step and the time left (from metrics.jsonl)
        term.expect(r"reward 0\.020 \(mean 0\.015 over 2 steps\)\s+2\.0s/step\s+2\.0s left")
        redraw = term.raw[drawn:]
        # drawn over the old view (cursor moved up, lines erased), not printed below it
        assert re.search(r"\x1b\[\d*A", redraw) and "\x1b[2K" in redraw, repr(redraw[:400])
        assert term.proc.poll() is None  # still watching a running run
        write_json(rd.state, {"state": "COMPLETED", "step": 3, "total_steps": 3, "attempt": 0,
                              "roles": {k: {**v, "phase": "done"} for k, v in roles.items()}})
        run_process.kill()
        run_process.wait()
        assert term.wait() == 0  # it ends by itself when the run does
        final = ANSI.sub("", term.raw[drawn:])
        assert "COMPLETED" in final and re.search(r"\b3\s*/\s*3\b", final)
    finally:
        term.close()
