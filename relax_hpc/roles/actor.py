"""The actor role: trains the policy (Megatron) and pushes weights to the engines.

For now it only bootstraps its communicators (see :mod:`relax_hpc.roles.runtime`); its work goes in ``work``.
"""

import sys

from relax_hpc.roles.runtime import main

ROLE = "actor"

if __name__ == "__main__":
    sys.exit(main(ROLE))
