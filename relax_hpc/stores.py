"""TCPStore servers that listen on the address the run uses, not on every interface.

A TCPStore takes any connection and asks for no key, and torch's server listens on every interface unless it is
given a socket. :func:`master_store` binds ``host``'s own address (127.0.0.1 in ``--local`` runs, the node's
address under Slurm) and hands torch that socket (``master_listen_fd``). Used by the roles' rendezvous and
cross-role group (:mod:`relax_hpc.roles.comm`) and by the weight-sync group (:mod:`relax_hpc.weights.sync`);
:func:`listen_address` also places the engines a Slurm run starts (:mod:`relax_hpc.roles.engine_host`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a store is made: listen_address serves torch-free engine hosts too
    import torch.distributed as dist

log = logging.getLogger(__name__)


def listen_address(host: str) -> tuple[int, str] | None:
    """(family, address) a listener that others reach as ``host`` binds: ``host``'s own address, so the listener
    is not reachable on the node's other interfaces. None (every interface) where a name other than localhost
    resolves to a loopback address (a Debian-style ``127.0.1.1 node`` line) or not at all: peers on other nodes
    resolve it to the node's real address, which a loopback bind would refuse."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # IPv4 first, as torch's client tries it first
    family, addr = infos[0][0], infos[0][4][0]
    local_name = host in ("127.0.0.1", "::1", "localhost")
    if (addr.startswith("127.") or addr == "::1") and not local_name:
        log.warning("%s resolves to the loopback address %s: listening on every interface so other nodes reach "
                    "it", host, addr)
        return None
    return family, addr


def master_store(host: str, world: int | None, timeout: datetime.timedelta) -> dist.TCPStore:
    """The server side of a TCPStore that others reach as ``host``, on a port the kernel picks, listening on
    ``host``'s address only (:func:`listen_address`)."""
    import torch.distributed as dist

    where = listen_address(host)
    if where is None:
        return dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    sock = socket.socket(where[0], socket.SOCK_STREAM)
    try:
        sock.bind((where[1], 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # torch's server owns the socket from here and closes it
    try:
        return dist.TCPStore(host, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
