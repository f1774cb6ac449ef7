"""The rollout role: runs the inference engines, generates samples and rewards them.

For now it only bootstraps its communicators (see :mod:`relax_hpc.roles.runtime`); its work goes in ``work``.
"""

import sys

from relax_hpc.roles.runtime import main

ROLE = "rollout"

if __name__ == "__main__":
    sys.exit(main(ROLE))
