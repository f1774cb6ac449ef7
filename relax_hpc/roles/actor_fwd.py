"""The actor_fwd role: adds the current policy's log-probs (``log_probs``, π_old) to samples, forward only.

It follows the actor through the actor's checkpoints (task ``load``); the work is
:func:`relax_hpc.roles.forward.work_forward` (tasks ``logprobs``, ``load``, ``stop``). Its model's TP/PP, sequence
parallelism and token budget are the recipe's ``forward:`` keys where set, else ``train``'s
(:func:`relax_hpc.train.forward_config.role_train`).
"""

import sys

from relax_hpc.roles.forward import work_forward
from relax_hpc.roles.runtime import main

ROLE = "actor_fwd"


def work(ctx, comm) -> None:
    work_forward(ctx, comm, "log_probs")


if __name__ == "__main__":
    sys.exit(main(ROLE, work))
