"""The real thing, once: a MegatronActor (megatron-core + megatron-bridge, world 1, gloo) trains one step and
pushes its weights, gathered and converted to HF names by the bridge, to a CPU engine."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_hpc.engines.client import EngineClient, SamplingParams
from relax_hpc.weights import engine_fingerprint, fingerprint

from .conftest import teacher_forced_logprobs

# megatron-core and megatron-bridge are required installs (tools/install): missing, this fails rather than skips
assert importlib.util.find_spec("megatron.core") and importlib.util.find_spec("megatron.bridge"), \
    "megatron-core / megatron-bridge not installed: run tools/install"
pytestmark = pytest.mark.slow
N_ENGINES = 1
PROMPT = [1, 10, 11, 12, 13, 14]


def test_megatron_actor_push(engines, tiny_model, tmp_path):
    c = EngineClient(engines[0].url, timeout=60)
    before = c.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    log = tmp_path / "actor.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("actor_worker.py")), str(tiny_model),
                              c.url, str(tmp_path)], stdout=f, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        try:
            p.wait(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"actor worker timed out; log tail:\n{log.read_text()[-4000:]}")
    res = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in res, res["error"]

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original = load_file(str(tiny_model / "model.safetensors"))
    assert sorted(original) == res["names"], "the bridge's HF names are the checkpoint's names"
    assert res["fingerprint"] != fingerprint(original), "the train step changed the weights"
    assert engine_fingerprint(c, res["names"]) == res["fingerprint"]
    assert c.weight_version() == "actor-1"
    m = res["metrics"]
    assert m["perf/weight_sync_tensors"] == len(original) and m["perf/weight_sync_buckets"] > 1
    # most of the weights went out of the actor's own parameter memory, without a pack copy
    assert m["perf/weight_sync_in_place_bytes"] > 0.5 * m["perf/weight_sync_bytes"], m

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    g = c.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    ref = teacher_forced_logprobs(trained, PROMPT, g.output_ids)
    assert (ref - torch.tensor(g.output_logprobs)).abs().max().item() < 1e-4
    assert g.weight_version == "actor-1" and g.output_logprobs != before.output_logprobs
    c.close()
