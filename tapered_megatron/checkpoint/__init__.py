"""Checkpoints on disk: everything that writes, reads, checks or converts a training checkpoint.

Modules, one job each (this package imports none of them, so ``layout``, ``manifest`` and
``received`` stay torch-free):

* :mod:`~tapered_megatron.checkpoint.layout`: the directory layout (names, tags, ``latest``,
  ``complete``, the save directory's lock) and :class:`~tapered_megatron.checkpoint.layout.
  ParallelLayout`, the parallel layout a run trains and a checkpoint is saved under.
* :mod:`~tapered_megatron.checkpoint.manifest`: the size and sha256 of every file of a tag or
  export, written and checked.
* :mod:`~tapered_megatron.checkpoint.save`: DeepSpeed's save plus our files, then ``complete``,
  ``latest`` and pruning; :mod:`~tapered_megatron.checkpoint.collective` is its rank, world
  size and barrier.
* :mod:`~tapered_megatron.checkpoint.resume`: which checkpoint ``train.resume`` points at, and
  loading it.
* :mod:`~tapered_megatron.checkpoint.save_dir`: one job and one run per ``train.save_dir``.
* :mod:`~tapered_megatron.checkpoint.universal`: the layout-free ``universal/`` copy, and
  resuming (resharding) from it under another parallel layout.
* :mod:`~tapered_megatron.checkpoint.preflight`: the checks of ``train.save_dir`` and
  ``train.resume`` before any process group starts.
* :mod:`~tapered_megatron.checkpoint.received` and :mod:`~tapered_megatron.checkpoint.safe_load`:
  received files read within bounds (configuration files) and as plain data (``.pt`` files).
* :mod:`~tapered_megatron.checkpoint.consolidate`: full fp32 weights from a checkpoint of any
  layout, for export and evaluation; :mod:`~tapered_megatron.checkpoint.errors` is the error it
  and the export tools raise.
"""
