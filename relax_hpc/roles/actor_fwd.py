"""The actor_fwd role: adds the current policy's log-probs to samples (forward-only Megatron).

For now it only bootstraps its communicators (see :mod:`relax_hpc.roles.runtime`); its work goes in ``work``.
"""

import sys

from relax_hpc.roles.runtime import main

ROLE = "actor_fwd"

if __name__ == "__main__":
    sys.exit(main(ROLE))
