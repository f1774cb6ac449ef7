"""The reference role: adds the reference policy's log-probs (``ref_log_probs``) to samples, forward only.

Its model is ``model.path`` and stays so unless the controller sends ``load``; the work is
:func:`relax_hpc.roles.forward.work_forward` (tasks ``logprobs``, ``load``, ``stop``). Its model's TP/PP, sequence
parallelism and token budget are the recipe's ``forward:`` keys where set, else ``train``'s
(:func:`relax_hpc.train.forward_config.role_train`).
"""

import sys

from relax_hpc.roles.forward import work_forward
from relax_hpc.roles.runtime import main

ROLE = "reference"


def work(ctx, comm) -> None:
    work_forward(ctx, comm, "ref_log_probs")


if __name__ == "__main__":
    sys.exit(main(ROLE, work))
