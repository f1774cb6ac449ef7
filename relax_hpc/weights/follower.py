"""A forward role in the weight-sync group: actor_fwd follows the actor the way an engine does.

actor_fwd computes π_old for step N with the weights of step N−1. It used to load the actor's checkpoint after
every step, which forced the actor to save a full checkpoint, optimizer included, every step: tens of GB per
step for a 7B model. Now rank 0 of the role answers the weight-update half of SGLang's HTTP API, the same
:class:`~relax_hpc.engines.receiver.WeightReceiver` the CPU engine uses. The actor's
:class:`~relax_hpc.weights.WeightSender` adds it to the group beside the engines, so every sync puts the new
weights, tagged with their version, into its HF-named staging tensors. Before a forward, the role copies the
version its task names into the Megatron model (:func:`relax_hpc.train.export.load_hf_weights`). Checkpoints go
back to ``checkpoint.interval``.

The staging tensors sit in host memory, one copy of the HF weights. The actor trains step N only after
actor_fwd's forward of step N, and it syncs step N after that, so the copy is never overwritten while a
forward still needs it.
"""

from __future__ import annotations

import logging
import threading

import torch

from relax_hpc.engines.http import ENGINE_VERSION, EngineServer, advertised_host, ok, route_handler
from relax_hpc.engines.receiver import WeightReceiver, weight_routes

log = logging.getLogger("relax_hpc.follower")


class Follower(WeightReceiver):
    """Staging tensors by HF name (the actor's export order and shapes) and the version they hold."""

    def __init__(self, params: dict[str, torch.Tensor], weight_version: str = "0"):
        super().__init__(params, weight_version)
        # on GPU nodes the group is NCCL: broadcasts land on this node's GPU, then are copied to the staging tensors
        self.device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.server: EngineServer | None = None
        self.url = ""

    def server_info(self) -> dict:
        # a CPU engine's version: the sender then uses update sessions, which this receiver has; the backends it
        # serves (nccl and gloo on a GPU, gloo on CPU) and its one update path (a group) for the sender's choice
        return {"tp_size": 1, "dp_size": 1, "version": ENGINE_VERSION, "engine": "relax_hpc-follower",
                "status": "ready", "weight_version": self.weight_version, **self.sync_info()}

    def take(self, version: str) -> dict[str, torch.Tensor]:
        """The staged tensors, which must be ``version``'s (the controller gives a task only once its sync is done)."""
        with self.model_lock:
            if self.weight_version != str(version):
                raise RuntimeError(f"this role was asked for the weights of step {version} but holds those of "
                                   f"{self.weight_version!r}: a weight sync did not reach it")
            return self.params

    def serve(self, host: str, api_key: str | None) -> str:
        """Answer the sender on a kernel-chosen port of ``host`` (a daemon thread); returns the URL."""
        routes = {
            **weight_routes(self),
            "/server_info": lambda b: ok(self.server_info()), "/get_server_info": lambda b: ok(self.server_info()),
            "/model_info": lambda b: ok({"weight_version": self.weight_version}),
            "/get_model_info": lambda b: ok({"weight_version": self.weight_version}),
            "/health": lambda b: (200, None), "/health_generate": lambda b: (200, None),
            # nothing generates here: pausing, continuing and flushing have nothing to do
            "/pause_generation": lambda b: ok({"message": "Generation paused successfully.", "status": "ok"}),
            "/continue_generation": lambda b: ok({"message": "Generation continued successfully.", "status": "ok"}),
            "/flush_cache": lambda b: (200, "Cache flushed."),
        }
        self.server = EngineServer((host, 0), route_handler(routes, api_key))
        self.url = f"http://{advertised_host(host)}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, name="follower",
                         daemon=True).start()
        log.info("following the actor's weights at %s", self.url)
        return self.url

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
