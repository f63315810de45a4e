"""Planning: the cost model (:mod:`.cost`, measured per-unit costs in :mod:`.profile`, stage clocks
in :mod:`.clock`), the exact partition solver (:mod:`.solver`), the pipeline balancer
(:mod:`.balance`) and the scale planner (:mod:`.planner`). The pipeline runtime they plan for is
:mod:`tapered_megatron.parallel.pipeline`."""
