"""Pipeline partitioning: cost model (:mod:`.cost`, :mod:`.profile`), exact solver
(:mod:`.solver`), methods and CLI (:mod:`.balance`), and the explicit-boundary DeepSpeed
``PipelineModule`` (:mod:`.module`). The scale planner is :mod:`tapered_megatron.plan`."""
