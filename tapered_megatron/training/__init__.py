"""The training job: launch/validation (``launch``), optimiser and LR schedule (``optim``),
checkpoints (``checkpoint``), logs (``logger``) and the loop (``trainer``). Entry point:
``pretrain/main.py``."""
