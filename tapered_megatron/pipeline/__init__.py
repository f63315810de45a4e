"""Command-line home of the pipeline balancer: ``python -m tapered_megatron.pipeline.balance``.

The balancer itself is :mod:`tapered_megatron.planning.balance`; the pipeline runtime is
:mod:`tapered_megatron.parallel.pipeline`."""
