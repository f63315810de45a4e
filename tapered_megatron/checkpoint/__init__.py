"""Checkpoints on disk: everything that writes, reads, checks or converts a training checkpoint.

Modules, one job each (this package imports none of them, so reading names stays torch-free):

* :mod:`~tapered_megatron.checkpoint.layout`: the directory layout (names, tags, ``latest``,
  ``complete``), the manifests of every file and their checks, the save directory's lock; no torch.
* :mod:`~tapered_megatron.checkpoint.save`: DeepSpeed's save and load plus our client state,
  pruning, resume selection and the save directory's ownership.
* :mod:`~tapered_megatron.checkpoint.universal`: the layout-free ``universal/`` copy, and
  resuming (resharding) from it under another parallel layout.
* :mod:`~tapered_megatron.checkpoint.received`: bounded parsing of received configuration files
  (YAML / JSON); no torch.
* :mod:`~tapered_megatron.checkpoint.safe_load`: loading received ``.pt`` files as plain data.
* :mod:`~tapered_megatron.checkpoint.consolidate`: full fp32 weights from a checkpoint of any
  layout, for export and evaluation.
* :mod:`~tapered_megatron.checkpoint.errors`: the error the checkpoint- and export-reading tools
  raise.
"""
