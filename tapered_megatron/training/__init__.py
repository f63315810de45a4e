"""The training job: launch/validation (``launch``), optimiser and LR schedule (``optim``),
logs (``logger``) and the loop (``trainer``); checkpoints are :mod:`tapered_megatron.checkpoint`.
Entry point: ``pretrain/main.py``."""
