"""External engines (relax_hpc.controller.external) against real reference engines started with keys of their own:
the join checks the key file and the key, the weights come by /update_weights_from_disk and the version the engine
then reports is what was sent, the rollout role's client refuses an answer with a version never sent, and an engine
that dies is dropped with the reason. Never stopped by the run: only these tests stop the engines they start."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import time

import pytest

from ctl_helpers import make_run
from relax_hpc.controller import external as external_mod
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.external import External
from relax_hpc.engines.client import EngineClient, EngineOutputError
from relax_hpc.engines.launcher import start_engine
from relax_hpc.engines.pool import CheckedClient, ExternalEngines, as_client
from tests.rollout.conftest import ENGINE_ARGS, tiny_llama  # noqa: F401 - a fixture, used by name

KEY = "key-of-the-engine-not-the-run"


def _key_file(path, key=KEY, mode=0o600):
    path.write_text(key + "\n")
    path.chmod(mode)
    return str(path)


@pytest.fixture(scope="module")
def keyed(tiny_llama, tmp_path_factory):
    """A reference engine started as anyone would, with its own key; its URL and key file."""
    d = tmp_path_factory.mktemp("keyed-engine")
    handle = start_engine("cpu", tiny_llama, log_path=d / "engine.log", extra_args=ENGINE_ARGS, api_key=KEY)
    try:
        handle.wait_ready(120)
        yield handle.url, _key_file(d / "engine.key")
    finally:
        handle.stop()


@pytest.fixture
def ext(tmp_path, tiny_llama):
    run = make_run(tmp_path)
    reg = EngineRegistry()
    reg.add("engine0", "http://127.0.0.1:1", origin="initial", state="ready", weight_version="0")
    events: list[tuple[str, str]] = []
    x = External(run, reg, model_path=str(tiny_llama), event=lambda k, d: events.append((k, d)),
                 on_change=lambda: None)
    x.events = events
    return x


def _settle(x: External, lost=None, timeout=120.0):
    """Tick until no load is in flight (the loads are threads; the tick applies their outcome)."""
    deadline = time.monotonic() + timeout
    while x.loads and time.monotonic() < deadline:
        time.sleep(0.05)
        x.tick(lost or (lambda n, why: pytest.fail(f"{n} dropped: {why}")))
    assert not x.loads


def test_an_external_engine_stays_out_of_the_weight_sync_group_but_takes_requests():
    reg = EngineRegistry()
    reg.add("engine0", "http://a:1", origin="initial", state="ready", weight_version="3")
    reg.add("ext0", "http://b:2", origin="external", state="ready", weight_version="3")
    assert reg.live() == {"engine0": "http://a:1"}  # the group: the run's engines only
    assert reg.routable(min_version=3) == {"engine0": "http://a:1", "ext0": "http://b:2"}


def test_it_joins_loads_the_weights_from_disk_and_reports_the_version_sent(ext, keyed, tiny_llama):
    url, key_file = keyed
    name, why = ext.add(url, key_file, "a test")
    assert name == "ext0" and "joined" in why
    e = ext.registry.engines["ext0"]
    assert (e.origin, e.state, e.job_id) == ("external", "syncing", "external")
    assert ext.snapshot_for(1) is not None  # an external engine is registered: the actor writes snapshots
    # no step synced yet: the model on disk is step 0's weights
    _settle(ext)
    client = EngineClient(url, api_key=KEY, retries=0)
    assert (e.state, e.weight_version, client.weight_version()) == ("ready", "0", "0")
    doc = json.loads(external_mod.external_file(ext.run).read_text())
    assert doc == {url: {"name": "ext0", "key_file": key_file, "sent": ["0"]}}
    assert stat.S_IMODE(os.stat(external_mod.external_file(ext.run)).st_mode) == 0o600
    # the actor's sync of step 5 wrote its snapshot (here: the model's own files, as an HF directory)
    shutil.copytree(tiny_llama, ext.snapshot_for(5))
    ext.synced(5)
    _settle(ext)
    assert (e.weight_version, client.weight_version()) == ("5", "5")

    # the rollout role's client: the engine's own key, and every answer's version is one the controller sent
    path = external_mod.external_file(ext.run)
    c = as_client(url, externals=ExternalEngines(path), retries=0)
    assert isinstance(c, CheckedClient)
    assert asyncio.run(c.agenerate([1, 2, 3], {"max_new_tokens": 2})).weight_version == "5"  # sent: 0, 5

    doc[url]["sent"] = ["4"]  # as if the controller had never sent 5
    path.write_text(json.dumps(doc))
    with pytest.raises(EngineOutputError, match="weight version '5', which the run never sent to this external "
                                                "engine \\(sent: 4\\)"):
        asyncio.run(c.agenerate([1, 2, 3], {"max_new_tokens": 2}))
    with pytest.raises(EngineOutputError, match="weight version '5'"):  # the router's path (custom generate)
        c.request("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    doc[url]["sent"] = ["4", "5"]  # listed just now (within the reader's cache): read again before refusing
    path.write_text(json.dumps(doc))
    asyncio.run(c.agenerate([1, 2, 3], {"max_new_tokens": 2}))


def test_a_join_is_refused_naming_the_fix(ext, keyed, tmp_path):
    url, key_file = keyed
    loose = _key_file(tmp_path / "loose.key", mode=0o644)
    assert ext.add(url, loose, "t") == (None, f"--key-file {loose}: mode 0644, readable by others than its owner; an "
                                              f"engine key must be private. Fix: chmod 600 {loose}")
    name, why = ext.add(url, _key_file(tmp_path / "wrong.key", key="wrong"), "t")
    assert name is None and "refused the key" in why and "(HTTP 401)" in why
    name, why = ext.add("http://127.0.0.1", key_file, "t")
    assert name is None and "expected http://HOST:PORT" in why
    assert ext.add(url, key_file, "t")[0] == "ext0"
    name, why = ext.add(url + "/", key_file, "t")
    assert name is None and "serves this run already, as ext0" in why
    assert list(ext.registry.engines) == ["engine0", "ext0"]


def test_a_dead_external_engine_is_dropped_with_the_reason(ext, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(external_mod, "HEALTH_EVERY_S", 0.0)
    handle = start_engine("cpu", tiny_llama, log_path=tmp_path / "engine.log", extra_args=ENGINE_ARGS, api_key=KEY)
    try:
        handle.wait_ready(120)
        assert ext.add(handle.url, _key_file(tmp_path / "k"), "t")[0] == "ext0"
        _settle(ext)
        os.kill(handle.pid, signal.SIGKILL)  # kill -9 of the engine this test started
        deadline = time.monotonic() + 30
        while handle.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        dropped: list[tuple[str, str]] = []
        deadline = time.monotonic() + 60
        while not dropped and time.monotonic() < deadline:
            ext.tick(lambda n, why: dropped.append((n, why)))
            time.sleep(0.05)
        assert dropped and dropped[0][0] == "ext0" and "no longer answers /health" in dropped[0][1], dropped
    finally:
        handle.stop()


def test_the_recipes_external_engines_join_or_are_left_out_with_why(tmp_path, keyed, tiny_llama):
    url, key_file = keyed
    run = make_run(tmp_path)
    events: list[tuple[str, str]] = []
    x = External(run, EngineRegistry(), model_path=str(tiny_llama), event=lambda k, d: events.append((k, d)),
                 on_change=lambda: None, configured=[{"url": url, "key_file": key_file},
                                                     {"url": "http://127.0.0.1:9", "key_file": key_file}])
    assert x.snapshot_for(1) is not None  # configured: the first syncs already write snapshots for them
    x.join_configured()
    assert x.names() == ["ext0"] and x.registry.engines["ext0"].url == url and not x.configured
    assert events[-1][0] == "engine_external" and "http://127.0.0.1:9 (rollout.external_engines) not used: " \
        "the engine at http://127.0.0.1:9 did not answer /model_info" in events[-1][1]
    _settle(x)
