"""TCPStores listen on the address the run uses, not on every interface (issue 28): a --local run's rendezvous
store is on 127.0.0.1 only, unreachable through the machine's other addresses."""

from __future__ import annotations

import datetime
import socket

import psutil
import pytest
import yaml

from relax_hpc.controller.channel import Channel
from relax_hpc.recipe import dump_recipe, load_recipe
from relax_hpc.rundir import create_run_dir, write_json
from relax_hpc.stores import listen_address, master_store


def _listeners(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def _other_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None on a machine without one)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_a_local_runs_rendezvous_store_listens_on_loopback_only(tmp_path, monkeypatch):
    from relax_hpc.roles import comm
    from relax_hpc.roles.runtime import RoleContext

    rd = create_run_dir(tmp_path / "runs", "r")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"logging": {"heartbeat_s": 0.2, "heartbeat_timeout_s": 5}}))
    rd.recipe.write_text(dump_recipe(load_recipe(tmp_path / "r.yaml")))
    ch = Channel(rd.token(), "127.0.0.1")
    write_json(rd.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    for k, v in {"RELAX_LAUNCH_ID": "l1", "RELAX_RANK": "0", "RELAX_WORLD_SIZE": "1", "RELAX_NODE": "localhost",
                 "RELAX_RENDEZVOUS": "file"}.items():
        monkeypatch.setenv(k, v)
    ctx = RoleContext("actor", rd.path)
    try:
        store = comm._rendezvous(ctx, datetime.timedelta(seconds=5))
        assert _listeners(store.port) == ["127.0.0.1"]  # not 0.0.0.0 / "::", torch's default
        store.set("k", "v")
        assert store.get("k") == b"v"
        other = _other_address()
        if other is not None:  # the same port through the machine's other address: nobody there
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, store.port), timeout=5).close()
    finally:
        ctx.close()
        ch.close()


def test_which_address_a_store_binds():
    assert listen_address("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    assert listen_address("localhost")[1] in ("127.0.0.1", "::1")
    other = _other_address()
    if other is not None:  # a node's address (what its name resolves to under Slurm): that address only
        assert listen_address(other) == (socket.AF_INET, other)
        store = master_store(other, None, datetime.timedelta(seconds=5))
        assert _listeners(store.port) == [other]
    assert listen_address("no-such-host.invalid") is None  # unresolvable: every interface, as before


def test_where_a_nodes_engine_listens():
    from relax_hpc.roles.engine_host import engine_listen_host

    assert engine_listen_host(local=True) == "127.0.0.1"
    where = listen_address(socket.gethostname())
    want = where[1] if where is not None and where[0] == socket.AF_INET else "0.0.0.0"
    assert engine_listen_host(local=False) == want  # the node's address; every interface only for a loopback name
