"""Training logs: one console line per log interval, tensorboardX events and, with
``logging.wandb_project``, a Weights & Biases run (rank 0 writes).

Scalars (tag ``train/...`` / ``val/...``, step = iteration): loss, ppl, lr, grad_norm,
tokens_per_s, tflops (model FLOPs per second per device), mfu, mem_gb, step_ms and, under
pipeline parallelism, ``pipe/stage{k}_ms`` (forward + backward compute time of stage k). The
per-layer MLP widths of the taper plan are logged once as a figure (``model/widths``). The wandb
run gets the same scalars under the same tags, and its config holds the full resolved config,
the parallel layout (``layout``) and the taper plan with its widths (``taper_plan``).

MFU = achieved model FLOPs / peak FLOPs. Model FLOPs per token come from the model library's
counters (forward; backward = 2x forward; activation recomputation not counted). The peak is
``logging.peak_tflops`` per device when set, otherwise the table of known accelerators
(``pipeline.cost.PEAK_TFLOPS``, dense bf16, looked up by the device's product name), otherwise a
short matmul probe on the device measured once at start-up (fp32 on CPU, bf16 on an
accelerator).
"""

from __future__ import annotations

import math
import os
import resource
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from tapered_megatron.accelerator import lookup, matmul_peak, on_cpu
from tapered_megatron.accelerator import product_name as device_product_name
from tapered_megatron.config import Config
from tapered_megatron.planning.cost import PEAK_TFLOPS
from tapered_megatron.training.alignment import LayerAlignment
from tapered_megatron.training.alignment import figure as alignment_figure

__all__ = ["TrainLogger", "device_product_name", "memory_gb", "peak_tflops", "probe_tflops"]


def peak_tflops(configured: float) -> float:
    """Peak TFLOP/s of one device: configured, known accelerator, or a measured matmul probe."""
    if configured > 0:
        return configured
    if not on_cpu():
        known = lookup(device_product_name(), PEAK_TFLOPS)
        if known is not None:
            return known
    return probe_tflops()


def probe_tflops(n: int = 1024, reps: int = 5, dtype: torch.dtype | None = None) -> float:
    """Best-case ``n x n`` matmul TFLOP/s on this rank's device, the fastest of ``reps`` + 1
    products; ``dtype`` defaults to fp32 on CPU and bf16 on an accelerator."""
    return matmul_peak([(n, n, n)], dtype=dtype, reps=reps + 1, warmup=0)[0] / 1e12


def memory_gb() -> float:
    """Peak accelerator memory allocated, or the process's peak RSS on CPU, in GB."""
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return acc.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def start_wandb(cfg: Config, layout: dict[str, Any], run_dir: str) -> Any:
    """A wandb run in ``logging.wandb_project`` (``logging.wandb_mode``) whose files go under
    ``run_dir/wandb``; its config is the resolved config plus the layout and the taper plan."""
    import wandb

    os.makedirs(run_dir, exist_ok=True)
    config = {**cfg.to_dict(), "layout": layout, "taper_plan": cfg.taper_plan.to_dict()}
    return wandb.init(
        project=cfg.logging.wandb_project,
        mode=cfg.logging.wandb_mode,
        dir=run_dir,
        name=cfg.name if cfg.name != "custom" else None,
        config=config,
    )


class TrainLogger:
    """Console line + tensorboardX writer (+ a wandb run); only rank 0 writes, every rank may
    call. ``layout`` (the parallel layout's fields) goes into the wandb run's config."""

    def __init__(
        self,
        cfg: Config,
        rank: int,
        flops_per_token: float,
        world_size: int,
        tb_dir: str,
        layout: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak_tflops(cfg.logging.peak_tflops)
        self.writer = None
        self.wandb = None
        if rank == 0 and tb_dir:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(tb_dir)
        if rank == 0 and cfg.logging.wandb_project:
            self.wandb = start_wandb(cfg, layout or {}, cfg.train.save_dir)

    def _scalars(self, values: dict[str, float], it: int) -> None:
        """Write ``{tag: value}`` at step ``it`` to tensorboard and wandb."""
        if self.writer is not None:
            for tag, v in values.items():
                self.writer.add_scalar(tag, v, it)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=it)

    def print(self, msg: str) -> None:
        """Print on rank 0 only (flushed)."""
        if self.rank == 0:
            print(msg, flush=True)

    def widths_figure(self) -> None:
        """Log the taper plan's per-layer MLP widths as a bar chart."""
        if self.writer is None:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plan = self.cfg.taper_plan
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(range(plan.layers), plan.widths, color="tab:blue")
        ax.axhline(plan.d_ff_base, color="gray", ls="--", lw=1, label="uniform d_ff")
        ax.set_xlabel("layer")
        ax.set_ylabel("d_ff(l)")
        ax.set_title(f"{self.cfg.model.arch}: {plan.schedule} {list(plan.ratios)}")
        ax.legend()
        fig.tight_layout()
        self.writer.add_figure("model/widths", fig, 0)
        plt.close(fig)

    def train(
        self,
        it: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens: int,
        seconds: float,
        stage_ms: list[float] | None = None,
        loss_scale: float | None = None,
        skipped_steps: int = 0,
        diagnostics: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Log one interval ending at iteration ``it``; return the scalars (for tests/bench).

        ``loss_scale`` (fp16's dynamic scale) and ``skipped_steps`` (the run's optimizer steps
        skipped so far: fp16 overflows, non-finite gradients) are logged when given / non-zero;
        ``diagnostics`` (the model's, :func:`tapered_megatron.models.take_diagnostics`) when
        given.
        """
        tps = tokens / max(seconds, 1e-9)
        tflops = self.flops_per_token * tps / self.world_size / 1e12
        out = {
            "loss": loss,
            "ppl": math.exp(min(loss, 30.0)),
            "lr": lr,
            "tokens_per_s": tps,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak > 0 else 0.0,
            "mem_gb": memory_gb(),
        }
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        if loss_scale is not None:
            out["loss_scale"] = loss_scale
        if skipped_steps or loss_scale is not None:
            out["skipped_steps"] = skipped_steps
        out.update(diagnostics or {})
        if self.rank != 0:
            return out
        scalars = {f"train/{k}": v for k, v in out.items()}
        scalars.update({f"pipe/stage{s}_ms": ms for s, ms in enumerate(stage_ms or [])})
        self._scalars(scalars, it)
        gn = f" | gnorm {grad_norm:.3f}" if grad_norm is not None else ""
        st = " | stages " + "/".join(f"{x:.0f}" for x in stage_ms) + " ms" if stage_ms else ""
        sc = f" | loss scale {loss_scale:g}" if loss_scale is not None else ""
        sk = f" | skipped {skipped_steps}" if "skipped_steps" in out else ""
        sk += "".join(f" | {k} {v:.3f}" for k, v in (diagnostics or {}).items())
        self.print(
            f"iter {it:>6}/{self.cfg.train.iters} | loss {loss:.4f} | ppl {out['ppl']:.2f} | "
            f"lr {lr:.3e}{gn}{sc}{sk} | {tps:,.0f} tok/s | MFU {100 * out['mfu']:.1f}% | "
            f"mem {out['mem_gb']:.2f} GB{st}"
        )
        return out

    def val(self, it: int, loss: float, dataset: str = "") -> None:
        """Log a validation result: of the validation split, or of ``eval.extra_paths``'
        ``dataset`` (tensorboard ``val/<dataset>/loss``)."""
        ppl = math.exp(min(loss, 30.0))
        tag = f"val/{dataset}/" if dataset else "val/"
        self._scalars({tag + "loss": loss, tag + "ppl": ppl}, it)
        on = f" on {dataset}" if dataset else ""
        self.print(f"validation{on} at iter {it} | loss {loss:.4f} | ppl {ppl:.2f}")

    def alignment(self, it: int, rows: list[LayerAlignment]) -> None:
        """Log per-layer ``rho_block`` / ``rho_mlp`` (``eval.alignment``): a scalar per layer
        and a figure of both curves against depth."""
        scalars = {}
        for r in rows:
            scalars[f"alignment/rho_block/layer_{r.layer:03d}"] = r.rho_block
            scalars[f"alignment/rho_mlp/layer_{r.layer:03d}"] = r.rho_mlp
        self._scalars(scalars, it)
        if self.writer is not None:
            import matplotlib.pyplot as plt

            fig = alignment_figure(rows, f"{self.cfg.model.arch}, iteration {it}")
            self.writer.add_figure("alignment/rho", fig, it)
            plt.close(fig)
            self.writer.flush()
        block = " ".join(f"{r.rho_block:.2f}" for r in rows)
        mlp = " ".join(f"{r.rho_mlp:.2f}" for r in rows)
        self.print(f"alignment at iter {it} | rho_block by layer {block} | rho_mlp {mlp}")

    def close(self) -> None:
        """Flush and close the event file and finish the wandb run."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
