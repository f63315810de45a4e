"""Where the files shipped beside the code are: presets, DeepSpeed configs, the local evaluation
tasks, the sample corpus and the Slurm template.

In a checkout they sit at their repository paths (:data:`RESOURCES`), where the commands and docs
name them (``--config pretrain/configs/quickstart.yaml``, ``--ds_config ds_configs/zero1.json``).
An installed wheel carries copies at the same relative paths under ``tapered_megatron/_resources/``
(``setup.py`` puts them there). :func:`resource` returns the installed copy when there is one,
else the checkout's path. A leaf module: ``setup.py`` reads :data:`RESOURCES` from it too.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
INSTALLED = PACKAGE / "_resources"  # only in an installed wheel

#: name -> path relative to the repository root (and to :data:`INSTALLED` in a wheel)
RESOURCES = {
    "presets": "pretrain/configs",
    "ds_configs": "ds_configs",
    "tasks": "tasks",
    "sample_corpus": "data/sample/corpus.jsonl.gz",
    "slurm_template": "scripts/slurm_cluster_template.sbatch",
}


def resource(name: str) -> Path:
    """The file or folder ``name`` (a key of :data:`RESOURCES`): the installed copy, else the
    checkout's (which may not exist when neither does; callers name it in their errors)."""
    relative = RESOURCES[name]
    installed = INSTALLED / relative
    return installed if installed.exists() else PACKAGE.parent / relative
