"""Stands in for SGLang's interpreter in relax_hpc's launcher (the test's ``RELAX_SGLANG_PYTHON`` is a wrapper that
runs this file with SGLang's interpreter and the launcher's arguments): it runs the launcher's own ``-c`` code
(``relax_hpc.engines.launcher.SGLANG_LAUNCHER``: the API key from the environment into ``sys.argv``) with its last
step, ``runpy.run_module("sglang.launch_server")``, replaced by what that module does first: SGLang's own
``prepare_server_args(sys.argv[1:])``. An unknown or misspelled flag exits with SGLang's parser error (code 2).

Writes to ``$RELAX_CONTRACT_OUT`` the resolved server arguments relax_hpc cares about, whether the key was still in
the environment afterwards, and whether it was on the process's command line."""

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import boot  # noqa: E402,F401 - before sglang

os.environ.setdefault("HF_HUB_OFFLINE", "1")
out = os.environ.pop("RELAX_CONTRACT_OUT")
if sys.argv[1] != "-c":
    sys.exit(f"parse_launch.py: expected the launcher's `-c CODE ARGS...`, got {sys.argv[1:3]}")
code, args = sys.argv[2], sys.argv[3:]


def parse_only(module, run_name=None, alter_sys=False):
    assert module == "sglang.launch_server", module
    from sglang.srt.server_args import prepare_server_args

    a = prepare_server_args(sys.argv[1:])
    cmdline = open("/proc/self/cmdline", "rb").read().split(b"\0")
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "api_key": a.api_key, "tp_size": a.tp_size, "model_path": a.model_path,
                   "host": a.host, "port": a.port, "weight_version": a.weight_version, "random_seed": a.random_seed,
                   "mem_fraction_static": a.mem_fraction_static,
                   "enable_return_routed_experts": a.enable_return_routed_experts,
                   "key_left_in_env": "RELAX_SGLANG_API_KEY" in os.environ,
                   "key_on_cmdline": bool(a.api_key) and any(a.api_key.encode() in c for c in cmdline)}, f)


runpy.run_module = parse_only
sys.argv = ["-c", *args]  # as `python -c CODE ARGS...` sets it
exec(compile(code, "<relax_hpc SGLANG_LAUNCHER>", "exec"), {"__name__": "__main__"})
