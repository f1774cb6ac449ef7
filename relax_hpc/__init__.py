"""relax_hpc: RL post-training of LLMs (GRPO, GSPO, SAPO) native to Slurm, without Ray.

The folders draw the architecture (docs/architecture.md): ``recipe`` (what the user asked for),
``launch`` (how it reaches Slurm or this machine), ``controller`` (the loop), ``roles`` (one module per
role), ``algo``/``train`` (learning), ``rollout``/``weights``/``exchange`` (data and weights in motion),
``ops`` (metrics and notifications).
"""

__version__ = "0.1.0"
