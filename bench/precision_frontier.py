"""PPO in fp32 and in bf16 on the reward-KL frontier: bench.arm_frontier with ppo.precision's two values.

.venv/bin/python -m bench.precision_frontier --seeds 3                  # both precisions at the default beta
.venv/bin/python -m bench.precision_frontier --seeds 3 --betas 1,0.5    # and at half the KL weight
.venv/bin/python -m bench.precision_frontier --seeds 3 --table-only     # the table from MLflow, nothing run
"""

from __future__ import annotations

import sys

from bench import arm_frontier
from bench.arm_frontier import FIGURES, Point, table  # noqa: F401  (the frontier's figures and table, for its users)

if __name__ == "__main__":
    arm_frontier.main(sys.argv[1:], setting="ppo.precision", arms="fp32,bf16")
