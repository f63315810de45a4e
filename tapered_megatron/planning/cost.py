"""Cost and memory model of pipeline units: the one cost model of the balancer and the planner.

A *unit* is one entry of the unit table :func:`tapered_megatron.models.units`: the embedding,
one block (``unit="layer"``) or one block half (token mixer or MLP slot, ``unit="sublayer"``),
and the final norm + LM head + loss. Parameters, forward FLOPs per token and activation bytes per
token are each unit's own counts (the counters' numbers); backward is 2x forward, so a unit's
training time for one micro-batch of ``b`` sequences of ``s`` tokens is::

    time = (3 + r) * (forward + launch)
           + (2 + r) * all_reduces[kind] * ring(b * s * d_model * element, tp)
    forward = b * s / tp * ((flops - core_flops) / (peak * efficiency)
                            + core_flops / (peak * core_efficiency)
                            + act_traffic * act_bytes / mem_bw)

with ``r = 1`` when the unit is recomputed (``train.recompute full``); under ``selective`` the
cores' FLOPs (:class:`~tapered_megatron.models.base.Counts` ``core_flops``) run once more, with no
extra all-reduce; an architecture's
first pass (Hope's teach signal: the record's ``first_pass_config``) adds one more forward of the
unit at the first-pass config's FLOPs, with its all-reduces. ``efficiency`` is the
achieved fraction of the device's dense peak per unit kind for the matrix products (mixer / MLP /
block / head / embedding), ``core_efficiency`` that of the cores (attention scores and weighted
sum, a memory module's inner updates), both scaled for mixers by the architecture record's
``mixer_efficiency``; ``act_traffic`` is the memory-bound work around them (norms, activation
functions, residual adds) as bytes moved per byte of saved activations, at HBM bandwidth. The GPU
presets' constants are fitted to published measured runs
(:mod:`tapered_megatron.planning.calibration`), the CPU ones calibrated here; ``launch`` is a
fixed per-pass overhead per
block half (on a GPU fitted too: eager PyTorch's launches and hooks; on a CPU PyTorch's per-op
cost). The last term is tensor-parallel
communication: ring all-reduces of the residual stream (one per sub-layer per pass) over NVLink
inside a node, the network beyond. Under sequence parallelism each becomes a reduce-scatter and an
all-gather (the same ring time); a half whose module runs on the whole sequence (the memory
architectures') adds one all-gather per pass. Alternatively the per-unit compute times (and the
bytes autograd really saves) are *profiled* on the actual device
(:mod:`tapered_megatron.planning.profile`), cached on disk keyed by config and device; both feed
the same solver.

Memory of stage ``j`` under 1F1B with ``M`` micro-batches (stage ``j`` of ``P`` keeps
``min(P - j, M)`` micro-batches of activations alive)::

    mem_j = overhead + sum(params) / tp * bytes_per_param(precision, zero, dp, pipeline)
            + min(P - j, M) * sum(saved activations of one micro-batch)
            + max(transient of a unit - saved activations of the units after it)

* parameters per rank: the unit's count / tp, except what every rank holds whole: the
  parameters no TP layout splits (RMSNorm gains, Hope's level rates) and the key/value
  projections when the TP size exceeds ``model.kv_heads`` (grouped-query attention).
* buffers (RoPE's tables) whole on every rank, in their own dtype (ZeRO-3's ``zero.Init``
  casts them to the model's), with the model state.
* bytes per parameter (ZeRO paper accounting, K = 12 for Adam's fp32 master + m + v):
  bf16 = 2 (weights) + 2 (grads) + 12 (optimizer), with gradients accumulated in fp32 as the
  shipped and planned ds_configs ask from ZeRO-1 up (``data_types.grad_accum_dtype``):
  DeepSpeed's BF16_Optimizer (ZeRO-1, pipeline runs) adds a full 4-byte fp32 gradient buffer,
  and under the pipeline engine (``immediate_grad_update``, as the planner writes it) holds
  no bf16 gradients; ZeRO-2/3 keep their gradient partition in fp32 (4 / dp instead of
  2 / dp);
  fp32 = 4 + 4 + 8 without ZeRO, 4 + 4 + 12 under ZeRO: DeepSpeed's ZeRO optimizers keep an
  fp32 master partition also in fp32 training (stage 1/2 clone it; stage 3's alias for an
  fp32 model compares a ``torch.device`` with a device-name string and never holds, in
  0.19.8).
  ZeRO-1 divides the optimizer term by ``dp``, ZeRO-2 also the gradients, ZeRO-3 everything.
* activations: the counted bytes per token x ``b * s``; tensor parallelism shards everything
  but each half's input, its norm's output and what the module counts as whole on every rank
  (``Counts.act_replicated``: tensors over ``d_model`` or over tokens only inside the TP
  region, such as Hope's level chain) (replicated). Sequence parallelism shards the norm's
  output too (and the dropout mask); the whole-sequence input the half's TP region
  multiplies stays replicated (the all-gathered tensor the column-parallel layer keeps). With
  ``full`` recompute a block/sub-block keeps only its input per micro-batch in flight (a
  sequence shard under sequence parallelism); with ``selective`` it keeps all but its cores'
  ``core_bytes`` (inside the TP region: sharded but ``core_replicated``). RoPE's rotation
  keeps one complex table per rotation (queries, keys) per micro-batch, whole on every rank
  (:func:`rope_table_bytes`; a core's, freed under ``selective``).
* transient: while one unit runs backward, its activation gradients and working buffers (what
  each half's module says its backward holds at its fullest moments, ``backward_peaks``: a
  share of what it saved, or counted from its shapes) live next to everything in flight but
  what the units after it on the stage saved for this micro-batch: they ran backward first and
  freed it; so do a block's halves, the MLP slot's before the mixer's; under checkpointing its
  recomputed activations live beside them (:func:`backward_transient`).
  The head's fused loss keeps its fp32 weight gradient per micro-batch in flight and works
  through one chunk of fp32 logits at a time; no logits-sized tensor exists. Its transient
  comes in forward (:func:`loss_forward_bytes`), beside every unit's activations, and before
  any gradient of the model's dtype where BF16_Optimizer drops them between steps
  (:func:`lp_grads_dropped`), or in backward, where it scales its two saved gradients
  (:func:`loss_backward_bytes`). Under ZeRO-3 a
  unit's transient also holds its full gradient (before DeepSpeed moves it into the reduce
  bucket), and the stage adds DeepSpeed's own buffers, the gathered weights and the optimizer
  step's temporaries (:func:`zero3_stage_bytes`, the steady state from the third step; within
  2.9 % of measured ranks at three 760M-derived shapes, docs/BENCHMARKS.md).
* after backward: the activations are gone and BF16_Optimizer's gradient reduce flattens the
  fp32 gradients and casts the flat copy (:func:`fallback_reduce_bytes`), at any DP size; a
  stage holds the larger of that and its forward/backward working set (a single stage in
  :func:`balance.analyse`'s fixed bytes, a pipeline stage per stage: :attr:`UnitCost.after`,
  :func:`stage_after`). AdamW's step temporaries come after it and are not counted: on a GPU
  (:attr:`Device.adam_temporaries`: one, 4 bytes a parameter of this rank's partition) they
  are the smaller but where a partition holds over 3/4 of :data:`FALLBACK_REDUCE_ELEMS`.

A published run of another code base (the calibration's) is costed as the planner's transformer
at its shape, with what that model lacks (:class:`StandIn`: a GeLU MLP's activations, a tied
head, attention without flash attention) and, for PyTorch FSDP, FSDP's model state and gathered
weights in place of ZeRO-3's (:class:`Fsdp`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tapered_megatron.config import Config
    from tapered_megatron.models.base import Counts
    from tapered_megatron.models.language_model import Unit
    from tapered_megatron.models.registry import Blocks

GiB = 1024**3


def gpu_efficiency(dense: float, core: float) -> dict[str, float]:
    """Achieved fraction of a GPU's dense peak per unit kind in bf16 training: ``dense`` for the
    matrix products (projections, MLP, head), ``core`` for the cores (attention scores and
    weighted sum: flash attention; a memory module's inner updates); the embedding is a gather
    (memory bound, its FLOPs ~0: the launch term dominates)."""
    return {"embedding": 0.05, "mixer": dense, "mlp": dense, "layer": dense, "head": dense,
            "core": core}  # fmt: skip


#: Efficiencies and overlap tax of the GPU presets, fitted on the fitting runs of the
#: calibration set (published measured runs: tapered_megatron/planning/calibration_runs.yaml,
#: ``python -m tapered_megatron.plan --calibrate --fit``); the held-out runs score them.
H100_EFFICIENCY = gpu_efficiency(0.66, 0.18)
A100_EFFICIENCY = gpu_efficiency(0.76, 0.38)
GPU_OVERLAP_TAX = 0.35
GPU_ACT_TRAFFIC = 2.25
GPU_LAUNCH_S = 750e-6


# Dense (no sparsity) bf16 peak TFLOP/s per accelerator product (vendor data sheets), keyed by a
# whole token of the product name (``accelerator.lookup``: A10 is not A10G, L40 is not L40S). The
# GPU presets of DEVICES and the training logger's MFU read their peaks here.
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10": 125.0,
    "A10G": 70.0,
    "L40": 181.0,
    "L40S": 362.0,
}


@dataclass(frozen=True)
class Device:
    """One accelerator type and its links. Bandwidths are per GPU, one direction, bytes/s.

    Defaults (public datasheets; peaks from :data:`PEAK_TFLOPS`): H100 SXM NVLink 4 450 GB/s per
    direction, 400 Gb/s NDR InfiniBand per GPU (50 GB/s); A100 SXM NVLink 3 300 GB/s, 200 Gb/s
    HDR per GPU (25 GB/s); H200 = H100 compute with 141 GB. ``cpu`` is this
    machine class: fp32, its peak measured by a matmul micro-benchmark (see profile.py).
    """

    name: str
    peak_flops: float
    mem_bytes: float
    intra_bw: float
    inter_bw: float
    precision: str = "bf16"
    gpus_per_node: int = 8
    mem_bw: float = 3.35e12  # HBM bytes/s (optimizer step is memory bound)
    overhead_bytes: float = 2.0 * GiB  # CUDA context, allocator slack, comm buffers
    launch_s: float = GPU_LAUNCH_S  # fixed per-pass cost of a block half or unit (launches, hooks)
    efficiency: dict[str, float] = field(default_factory=lambda: dict(H100_EFFICIENCY))
    # Compute time lost per second of communication overlapped with it (NCCL's kernels take
    # streaming multiprocessors and memory bandwidth from the compute they hide behind).
    overlap_tax: float = GPU_OVERLAP_TAX
    # Memory-bound traffic of a pass per byte of the activations a unit saves (forward_time).
    act_traffic: float = GPU_ACT_TRAFFIC
    # Full-size fp32 temporaries of torch's AdamW step: its multi-tensor (foreach) path, the
    # default on CUDA, holds one (``exp_avg_sq_sqrt``); the single-tensor path, the default on
    # a CPU, two at once (``exp_avg_sq.sqrt() / bias_correction2_sqrt``).
    adam_temporaries: int = 1
    # Whether only the written pages of an allocation are resident (a CPU: an untouched part of
    # a ``torch.empty`` buffer costs nothing) rather than the whole allocation (a GPU).
    lazy_pages: bool = False
    # Fixed seconds of one point-to-point send (its bytes go at intra_bw / inter_bw).
    p2p_latency_s: float = 0.0
    # Per pipeline schedule (``parallel.schedule``): what its runtime spends beyond the chunks'
    # compute, seconds per compute action (F, B, I, W). Unset in the presets;
    # scripts/bench_schedules.py measures it on the CPU.
    schedule_overhead: dict[str, float] = field(default_factory=dict)
    # torch's separate input and weight backward passes (the zero-bubble schedules) as fractions
    # of one whole backward; None: the weight pass costs a forward (a matmul's weight gradient)
    # and the input pass the rest. Unset in the presets; scripts/bench_schedules.py measures it
    # on the CPU.
    split_backward: tuple[float, float] | None = None


DEVICES: dict[str, Device] = {
    "h100": Device("h100", PEAK_TFLOPS["H100"] * 1e12, 80 * GiB, 450e9, 50e9),
    "h200": Device("h200", PEAK_TFLOPS["H200"] * 1e12, 141e9, 450e9, 50e9, mem_bw=4.8e12),
    "a100": Device(
        "a100",
        PEAK_TFLOPS["A100"] * 1e12,
        80 * GiB,
        300e9,
        25e9,
        mem_bw=2.0e12,
        efficiency=dict(A100_EFFICIENCY),
    ),
    "cpu": Device(
        "cpu",
        50e9,  # replaced by the measured value (profile.measure_cpu_peak)
        16 * GiB,
        5e9,
        1e9,
        precision="fp32",
        gpus_per_node=1,
        mem_bw=20e9,
        overhead_bytes=0.0,
        launch_s=0.75e-3,
        adam_temporaries=2,
        lazy_pages=True,
        overlap_tax=0.0,
        act_traffic=0.0,
        # calibrated on this machine class (fp32, one thread, thread CPU time, against its
        # measured matmul peak) from the profiled units of scripts/bench_balance.py's model:
        # time = 3 (flops / (peak eff) + launch_s per block half); the fixed 0.75 ms per pass is
        # PyTorch's per-op cost of a block half's few dozen ops, which dominates narrow units
        efficiency={"embedding": 0.05, "mixer": 0.6, "mlp": 0.8, "layer": 0.72, "head": 0.77},
    ),
}


#: HBM bandwidth (bytes/s) of a preset's other memory sizes, in GiB, where the product ships
#: with a slower memory (vendor data sheets): A100 SXM4 40GB, HBM2 at 1,555 GB/s (the preset,
#: 80GB, is HBM2e).
MEM_BW_BY_SIZE: dict[str, dict[int, float]] = {"a100": {40: 1.555e12}}


def get_device(name: str, **overrides: Any) -> Device:
    """A device preset by name with optional field overrides (``peak_flops=...``); a memory size
    listed in :data:`MEM_BW_BY_SIZE` brings its HBM bandwidth unless ``mem_bw`` is given."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    dev = replace(DEVICES[name], **given)
    size_bw = MEM_BW_BY_SIZE.get(name, {}).get(round(dev.mem_bytes / GiB))
    if size_bw is not None and "mem_bw" not in given:
        dev = replace(dev, mem_bw=size_bw)
    return dev


def resolve_device(name: str = "auto") -> Device:
    """``auto``: the CPU preset with its peak measured here (cached) when DeepSpeed's accelerator
    is the CPU, else the GPU preset whose name is a whole token of the accelerator's product name
    (``NVIDIA H200`` -> h200); an unknown GPU gets the h100 preset, with a notice naming
    ``--device``."""
    if name != "auto":
        dev = get_device(name)
    else:
        from tapered_megatron.accelerator import lookup, on_cpu, product_name

        if on_cpu():
            dev = get_device("cpu")
        else:
            label = product_name()
            preset = lookup(label, {k: k for k in DEVICES if k != "cpu"})
            if preset is None:
                print(
                    f"cost model: no device preset for {label!r}; using h100 (pass --device "
                    f"one of {', '.join(DEVICES)} or add a preset to planning/cost.py DEVICES)",
                    flush=True,
                )
            dev = get_device(preset or "h100")
    if dev.name == "cpu":
        from tapered_megatron.planning.profile import measure_cpu_peak

        dev = replace(dev, peak_flops=measure_cpu_peak())
    return dev


@dataclass(frozen=True)
class Zero3:
    """The DeepSpeed ZeRO-3 sizes (in elements) that set its buffers: ``reduce_bucket_size``,
    ``sub_group_size``, ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters`` and
    ``stage3_max_reuse_distance`` of the ``zero_optimization`` section. The defaults are
    ``ds_configs/zero3.json``'s (DeepSpeed's own for the last two)."""

    reduce_bucket_size: int = 50_000_000
    sub_group_size: int = 100_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000

    @classmethod
    def from_ds_config(cls, ds: Mapping[str, Any]) -> Zero3:
        """The sizes a DeepSpeed config sets; DeepSpeed 0.19's default for a key it lacks."""
        z = ds.get("zero_optimization", {})
        return cls(
            int(z.get("reduce_bucket_size", 5e8)),
            int(z.get("sub_group_size", 1e9)),
            int(z.get("stage3_prefetch_bucket_size", 5e7)),
            int(z.get("stage3_max_live_parameters", 1e9)),
            int(z.get("stage3_max_reuse_distance", 1e9)),
        )

    def ds_keys(self) -> dict[str, int]:
        """The ``zero_optimization`` keys of these sizes (for a written DeepSpeed config)."""
        return {
            "reduce_bucket_size": self.reduce_bucket_size,
            "sub_group_size": self.sub_group_size,
            "stage3_prefetch_bucket_size": self.prefetch_bucket_size,
            "stage3_max_live_parameters": self.max_live_parameters,
            "stage3_max_reuse_distance": self.max_reuse_distance,
        }


@dataclass(frozen=True)
class Fsdp:
    """PyTorch FSDP ``FULL_SHARD`` in place of DeepSpeed's ZeRO-3 (a published run of another
    code base, :mod:`~tapered_megatron.planning.calibration`; the planner's own layouts are
    DeepSpeed runs): every block a unit (llm-foundry's ``_fsdp_wrap_fn`` wraps each
    ``MPTBlock``, torchtitan each transformer block), the rest (embedding, final norm, head)
    the root, bf16 ``param_dtype``, the rate limiter on (``limit_all_gathers``: llm-foundry's
    benchmark script sets it, torch defaults to it; FSDP2, ``fully_shard``, prefetches one unit
    ahead). Its memory: :func:`fsdp_bytes_per_param`, :func:`fsdp_stage_bytes`.

    ``reduce_copy_bytes``: bytes per parameter of the reduce-scatter input FSDP makes from a
    unit's gradients while they exist: FSDP2 copies them into a new flat buffer of the reduce
    dtype (``foreach_reduce``; torchtitan reduces in fp32: 4); FSDP1 reduce-scatters the flat
    gradient itself, in bf16 under llm-foundry's ``mixed_precision: PURE`` (0)."""

    reduce_copy_bytes: int = 0


@dataclass(frozen=True)
class StandIn:
    """How a published run's model differs from the planner's transformer that stands in for
    it (:mod:`~tapered_megatron.planning.calibration`): ``gelu_expansion`` > 0, an MLP of two
    matrices of ``gelu_expansion x d_model`` with a GeLU between (GPT, MPT) where the stand-in
    has SwiGLU's three of the same parameters and FLOPs (:func:`gelu_mlp_act_bytes`);
    ``tied_head``, the head's weight is the embedding's; ``flash_attention`` false, attention
    that materialises its score matrix (:func:`materialised_scores_bytes`)."""

    gelu_expansion: int = 0
    tied_head: bool = False
    flash_attention: bool = True


@dataclass(frozen=True)
class RunShape:
    """How a run executes: everything besides the model that changes cost or memory (and,
    for a published run, how its model differs from the stand-in: ``stand_in``)."""

    micro_batch_size: int = 1
    seq_len: int = 2048
    micro_batches: int = 8  # gradient-accumulation steps per optimizer step (M)
    tp: int = 1
    dp: int = 1
    zero_stage: int = 1
    precision: str = "bf16"  # bf16 | fp32
    recompute: str = "none"  # train.recompute: none | selective | full
    sequence_parallel: bool = False  # parallel.sequence_parallel (with tp > 1)
    pipeline: bool = True  # DeepSpeed PipelineEngine (bf16 -> BF16_Optimizer fp32 grad buffer)
    zero3: Zero3 | Fsdp = Zero3()  # DeepSpeed's ZeRO-3 buffer sizes, or FSDP (zero_stage 3)
    stand_in: StandIn = StandIn()

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.micro_batch_size * self.seq_len


@dataclass(frozen=True)
class UnitCost:
    """One pipeline unit as the solver sees it (times in s, memory in bytes, one device)."""

    name: str
    kind: str  # embedding | layer | mixer | mlp | head
    layer: int | None  # global layer of a block unit (None: embedding, head)
    params: int  # full, un-sharded count
    flops_fwd: float  # forward FLOPs per token (full, un-sharded)
    time: float  # forward + backward (+ recompute) of one micro-batch, TP communication included
    tp_comm: float  # the part of ``time`` spent in tensor-parallel all-reduces
    local_params: float  # held by one TP rank (key/value heads replicated below the TP size)
    static: float  # weights + grads + optimizer state
    act: float  # saved activations of one micro-batch in flight
    peak: float  # transient working set (checkpointed recompute)
    # bytes beside the model state once the step's backward is done, instead of the activations
    # (a bf16 pipeline's gradient reduce: :func:`pipeline_reduce_bytes`)
    after: float = 0.0


def bytes_per_param(precision: str, zero: int, dp: int, pipeline: bool) -> float:
    """Model-state bytes per parameter on one device (see the module docstring)."""
    if precision == "bf16":
        weights, optim = 2.0, 12.0
        # fp32-accumulated partitions; a pipeline's BF16_Optimizer moves each bf16 gradient
        # into its fp32 buffer as it is made (immediate_grad_update) and holds none
        grads = 4.0 if zero >= 2 else 0.0 if pipeline else 2.0
        acc = 4.0 if pipeline or zero == 1 else 0.0  # BF16_Optimizer's full fp32 gradients
    elif precision == "fp32":
        weights, grads, optim, acc = 4.0, 4.0, 12.0 if zero >= 1 else 8.0, 0.0
    else:
        raise ValueError(f"unknown precision {precision!r}; use bf16 or fp32")
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights + grads + optim + acc


def activation_scale(precision: str) -> int:
    """Activation element size in bytes for ``precision``."""
    return 2 if precision == "bf16" else 4


def ring_all_reduce(nbytes: float, n: int, bw: float) -> float:
    """Ring all-reduce time of ``nbytes`` over ``n`` ranks with per-rank bandwidth ``bw``."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / bw


#: Tensor-parallel all-reduces of the residual stream per unit per pass (forward, backward and
#: recompute): one per row-parallel output (mixer, MLP) or vocab-parallel reduction (embedding,
#: the head's input gradient).
TP_ALL_REDUCES = {"embedding": 1, "layer": 2, "mixer": 1, "mlp": 1, "head": 1}


#: Bytes of a token id (int64): a micro-batch's input ids live with the embedding, its labels
#: with the head, until its backward.
TOKEN_ID_BYTES = 8


def tp_local_params(c: Counts, cfg: Config, tp: int, whole: int = 0) -> float:
    """Parameters of a unit with counts ``c`` on one of ``tp`` TP ranks: its shard, the
    ``whole`` parameters no TP layout splits (norm gains: :func:`whole_params`), and every
    key/value projection whole where ``tp`` exceeds ``model.kv_heads`` (replicated)."""
    kv = c.kv_params if tp > cfg.model.kv_heads else c.kv_params / tp
    return (c.params - c.kv_params - whole) / tp + whole + kv


#: Rotations a rotary embedding applies per forward: the queries and the keys (Titans' MAC also
#: rotates its memory tokens' keys, one window more; not counted).
ROPE_CALLS = 2
#: Bytes of an element of the complex rotation table (complex64).
ROPE_TABLE_ELEMENT = 8


@lru_cache(maxsize=4096)
def _built(cfg: Config, module: type, args: tuple) -> tuple[int, int, int]:
    """(parameters without a TP layout, buffer bytes, rotary table elements) of a unit built
    on the meta device."""
    import torch

    from tapered_megatron.models.layers import RotaryEmbedding

    with torch.device("meta"):
        built = module(cfg, *args)
    whole = sum(p.numel() for p in built.parameters() if getattr(p, "tp_layout", None) is None)
    rope = sum(m.cos.numel() for m in built.modules() if isinstance(m, RotaryEmbedding))
    return whole, sum(b.numel() * b.element_size() for b in built.buffers()), rope


def whole_params(unit: Unit) -> int:
    """Parameters of ``unit`` that every TP rank holds whole: those without a ``TPLayout``
    (RMSNorm gains, Hope's level rates), counted on the unit built on the meta device."""
    return _built(unit.cfg, unit.module, unit.args)[0]


def buffer_bytes(unit: Unit) -> int:
    """Bytes of ``unit``'s buffers (RoPE's fp32 tables), whole on every rank and kept in their
    own dtype (DeepSpeed casts the parameters only), from the unit built on the meta device."""
    return _built(unit.cfg, unit.module, unit.args)[1]


def rope_table_bytes(unit: Unit) -> float:
    """Bytes of rotation tables ``unit``'s forward keeps for backward per micro-batch, whole on
    every TP rank and for any micro-batch size: each rotation multiplies by a complex table
    made from the ``cos`` / ``sin`` buffers (``[seq_len, head_dim / 2]``, complex64), which
    autograd saves for the rotation's backward (:class:`~tapered_megatron.models.layers.
    RotaryEmbedding`), once for the queries and once for the keys."""
    return float(ROPE_CALLS * ROPE_TABLE_ELEMENT * _built(unit.cfg, unit.module, unit.args)[2])


def launch_time(device: Device, kind: str) -> float:
    """The fixed cost of one pass of a unit of ``kind``: ``launch_s`` per block half (a whole
    layer has two, the mixer's and the MLP slot's)."""
    return device.launch_s * (2 if kind == "layer" else 1)


def forward_time(c: Counts, tokens: float, device: Device, eff: float, core_eff: float) -> float:
    """One forward of a unit with counts ``c`` over ``tokens`` tokens (per TP rank): its core's
    FLOPs (attention scores and weighted sum, a memory module's inner updates) at ``core_eff``
    of the device's peak, the rest (the projections and MLP matrices) at ``eff``, and the
    memory-bound work around them (norms, activation functions, residual adds, casts):
    :attr:`Device.act_traffic` bytes of memory traffic per byte of activations the unit saves,
    at the memory bandwidth. That last term is why a narrow model, or a GPU with more FLOPs per
    byte of bandwidth (H100 against A100), reaches a smaller share of its peak."""
    dense = (c.flops - c.core_flops) / eff + c.core_flops / core_eff
    traffic = device.act_traffic * c.act_bytes / device.mem_bw
    return (dense / device.peak_flops + traffic) * tokens


def gelu_mlp_act_bytes(d_model: int, expansion: int, elem: int) -> float:
    """Bytes per token a GeLU MLP of ``expansion x d_model`` saves for backward: its input, the
    first matrix's output (GeLU's input) and GeLU's output (the second matrix's input)
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", section 4.1; no dropout)."""
    return float((1 + 2 * expansion) * d_model * elem)


def materialised_scores_bytes(cfg: Config, elem: int) -> float:
    """Bytes per token and layer an attention without flash attention saves of its score
    matrix (``heads x seq_len`` per token): the softmax output and the attention dropout's
    output in the activation dtype and the dropout mask, one byte each (Korthikanti et al.
    2022, section 4.1: ``5 a s`` in 16 bits)."""
    return float(cfg.model.heads * cfg.model.seq_len * (2 * elem + 1))


def stand_in_counts(u: Unit, shape: RunShape, elem: int) -> Counts:
    """``u``'s counts for the run the planner's model stands in for (:class:`StandIn`): a GeLU
    MLP's saved bytes for SwiGLU's; the materialised scores in a block's saved bytes (freed by
    selective recompute, as in Megatron-LM); a tied head without weights of its own outside
    a pipeline (under one, Megatron-LM's last stage holds a copy of the embedding)."""
    from tapered_megatron.models import blocks

    c, s, layer = u.counts(elem), shape.stand_in, u.kind in ("layer", "mixer", "mlp")
    if u.kind == "head" and s.tied_head and not shape.pipeline:
        c = replace(c, params=whole_params(u))
    if s.gelu_expansion and layer and u.kind != "mixer":
        swiglu = blocks(u.cfg.model.arch).mlp.counts(u.cfg, u.layer, elem).act_bytes
        gelu = gelu_mlp_act_bytes(u.cfg.model.d_model, s.gelu_expansion, elem)
        c = replace(c, act_bytes=c.act_bytes - swiglu + gelu)
    if not s.flash_attention and layer and u.kind != "mlp":
        scores = materialised_scores_bytes(u.cfg, elem)
        c = replace(c, act_bytes=c.act_bytes + scores, core_bytes=c.core_bytes + scores)
    return c


def block_halves(arch: Blocks, kind: str) -> tuple[type, ...]:
    """The modules (of an architecture's ``arch``) a unit of ``kind`` runs: a layer's mixer and
    MLP slot, a sub-layer's one; none for the embedding and the head."""
    return {"layer": (arch.mixer, arch.mlp), "mixer": (arch.mixer,), "mlp": (arch.mlp,)}.get(
        kind, ()
    )


def whole_sequence_halves(arch: Blocks, kind: str) -> int:
    """Halves of a unit of ``kind`` of an architecture (its modules ``arch``) whose module
    runs on the whole sequence under sequence parallelism (the block gathers its input and keeps
    this rank's part of its output)."""
    return sum(not m.takes_sequence_shards for m in block_halves(arch, kind))


def backward_transient(
    arch: Blocks, u: Unit, shape: RunShape, full: float, local: float, grads: bool
) -> float:
    """Unit ``u``'s transient in backward on one TP rank: ``full`` the activations one
    micro-batch of it saves without recompute, ``local`` its TP-local parameters, ``grads``
    whether their gradients count (ZeRO-3, a bf16 pipeline: autograd makes each before
    DeepSpeed moves it). Its halves run backward one after the other, the MLP slot's first;
    each half's module names the moments of its backward that may hold the most
    (:meth:`~tapered_megatron.models.base.BlockPart.backward_peaks`), given what the half saved
    (its ``Counts.act_bytes``' share of the unit's, of ``full``), and by then the halves after
    it have freed what they saved. Under selective recompute a half's cores run again in its
    backward: their activations (what the module's ``recomputed_core`` holds at once, RoPE's
    tables) live beside it. Without recompute the unit's whole gradient counts beside them; a
    checkpointed unit first re-creates all its activations (``full``), which live beside its
    backward, and the gradients count as made: the halves' after it and, of its own, those its
    module has made by that moment. ``full``, and the gradient, for a unit that is no block or
    half of one."""
    elem = activation_scale(shape.precision)
    grad_bytes = local * elem if grads else 0.0
    modules = block_halves(arch, u.kind)
    if not modules:
        return full + grad_bytes
    cfg, layer, total = u.cfg, u.layer, u.counts(elem).act_bytes
    checkpointed = shape.recompute == "full"
    most, freed, made = 0.0, 0.0, 0.0
    for m in reversed(modules):
        c = m.counts(cfg, layer, elem)
        saved = full * c.act_bytes / total
        peaks = m.backward_peaks(cfg, layer, elem, shape.micro_batch_size, shape.tp, saved)
        again = 0.0
        if shape.recompute == "selective":
            core = m.recomputed_core(cfg, layer, elem, shape.tp)
            again = core * shape.tokens + rope_table_bytes(u)
        half = 0.0
        if checkpointed and grads:
            half = tp_local_params(c, cfg, shape.tp, _built(cfg, m, (layer,))[0]) * elem
        most = max(most, *(b + share * half + again + made - freed for b, share in peaks))
        freed, made = freed + saved, made + half
    return most + (full if checkpointed else grad_bytes)


def unit_costs(
    cfg: Config,
    shape: RunShape,
    device: Device,
    unit: str | None = None,
    measured_times: Sequence[float] | None = None,
    measured_act: Sequence[float] | None = None,
) -> list[UnitCost]:
    """Solver inputs (time, static memory, activations, transient) of every entry of the unit
    table ``units(cfg, unit)``: the one cost model of the balancer and the planner.

    ``measured_times`` (profiled fwd+bwd seconds per unit for ``shape``) replace the analytic
    compute time and ``measured_act`` (saved bytes per token) the counted activations; a
    first pass (Hope's teach signal) is in the analytic time only (the profiler times each unit
    alone, where no first pass runs).
    """
    from tapered_megatron.architectures import resolve_architecture
    from tapered_megatron.models import blocks, units

    arch = resolve_architecture(cfg.model.arch)
    halves = blocks(arch)
    gathered = {k: whole_sequence_halves(halves, k) for k in TP_ALL_REDUCES}
    table = units(cfg, unit)
    first = arch.first_pass_config(cfg)  # a first pass's forward (Hope's teach signal)
    first_units = [None] * len(table) if first is None else units(first, unit)
    if isinstance(shape.zero3, Fsdp) and shape.zero_stage >= 3:
        bpp = fsdp_bytes_per_param(shape.dp)
    else:
        bpp = bytes_per_param(shape.precision, shape.zero_stage, shape.dp, shape.pipeline)
    # a bf16 pipeline holds no gradient of the model's dtype: each is moved as it is made
    grads_moved = shape.pipeline and shape.precision == "bf16"
    tok = shape.tokens
    elem = activation_scale(shape.precision)
    recompute_kinds = ("layer", "mixer", "mlp")
    tp_bw = device.intra_bw if shape.tp <= device.gpus_per_node else device.inter_bw
    tp_ar = ring_all_reduce(tok * cfg.model.d_model * elem, shape.tp, tp_bw)
    vocab_local = cfg.padded_vocab_size / shape.tp
    sp = shape.sequence_parallel and shape.tp > 1
    out = []
    for i, (u, f) in enumerate(zip(table, first_units, strict=True)):
        c = stand_in_counts(u, shape, elem)
        local = tp_local_params(c, cfg, shape.tp, whole_params(u))
        act_bytes = c.act_bytes if measured_act is None else float(measured_act[i])
        input_bytes = u.input_bytes(elem)
        eff = device.efficiency[u.kind]
        if u.kind in ("mixer", "layer"):
            eff *= arch.mixer_efficiency ** (1.0 if u.kind == "mixer" else 0.5)
        recompute = shape.recompute == "full" and u.kind in recompute_kinds
        passes = 4 if recompute else 3
        if measured_times is not None:
            t = float(measured_times[i])
        else:
            base = device.efficiency[u.kind]
            # without flash attention the scores are batched matrix products like the rest
            core = "core" if shape.stand_in.flash_attention else u.kind
            core_eff = device.efficiency.get(core, base) * eff / base
            fwd = forward_time(c, tok / shape.tp, device, eff, core_eff)
            t = passes * (fwd + launch_time(device, u.kind))
            if shape.recompute == "selective":
                t += c.core_flops * tok / (shape.tp * device.peak_flops * core_eff)
            if f is not None:  # the first pass's forward of this unit
                t += forward_time(f.counts(elem), tok / shape.tp, device, eff, core_eff)
                t += launch_time(device, u.kind)
        # all-reduces, or under sequence parallelism reduce-scatter + all-gather pairs (the same
        # ring time) and an all-gather more for each half that runs on the whole sequence
        per_pass = TP_ALL_REDUCES[u.kind] + (0.5 * gathered[u.kind] if sp else 0)
        comm = per_pass * (passes - 1 + (f is not None)) * tp_ar
        # Each half's input and its norm's output are replicated on every TP rank; under
        # sequence parallelism only the input its TP region multiplies (gathered) is, the
        # norm's output is a sequence shard. Inside the mixer / MLP / head everything is
        # sharded but what the module counts as whole on every rank (``act_replicated``).
        subunits = 2 if u.kind == "layer" else 1
        whole = (1 if sp else 2) * subunits * input_bytes + c.act_replicated
        resid = min(whole, act_bytes) * tok
        # RoPE's tables: per sequence, not per token (in the measured bytes already)
        rope = rope_table_bytes(u) if measured_act is None else 0.0
        full = resid + (act_bytes * tok - resid) / shape.tp + rope
        # While a unit runs backward, gradients of its activations (what its modules'
        # backward_peaks say) are alive next to what the micro-batches in flight hold (but the
        # units after it: units_transient); a checkpointed unit first re-creates its
        # activations, which live beside them.
        act = input_bytes * tok / (shape.tp if sp else 1) if recompute else full
        if shape.recompute == "selective" and measured_act is None:
            # the cores run again in backward, RoPE's rotation with them
            act -= c.local_core(shape.tp) * tok + rope
        # Under ZeRO-3 autograd makes each gradient before DeepSpeed copies it into the reduce
        # bucket, and a bf16 pipeline's before BF16_Optimizer's hooks move it into the fp32
        # buffer (the head's fp32 one is already in ``act``); ZeRO-3's gathered weights are
        # counted for the stage (zero3_stage_bytes).
        grads = (shape.zero_stage >= 3 or grads_moved) and u.kind != "head"
        peak = backward_transient(halves, u, shape, full, local, grads)
        if u.kind in ("embedding", "head"):
            act += TOKEN_ID_BYTES * tok  # the micro-batch's input ids / labels
        if u.kind == "embedding" and shape.tp > 1:
            # the vocabulary-parallel lookup keeps its slice's ids and the outside-slice mask
            act += (TOKEN_ID_BYTES + 1) * tok
        if u.kind == "head":
            # The fused loss keeps its fp32 weight gradient until the micro-batch's backward;
            # the head's transient is its working set in forward or in backward.
            act += 4.0 * vocab_local * cfg.model.d_model
            peak = max(
                loss_forward_bytes(cfg, shape, vocab_local),
                loss_backward_bytes(cfg, shape, vocab_local, cast=True),
            )
        # buffers keep their dtype (fp32), but zero.Init casts them to the model's
        buffers = buffer_bytes(u) * (elem / 4 if shape.zero_stage >= 3 else 1)
        out.append(
            UnitCost(
                name=u.name,
                kind=u.kind,
                layer=u.layer,
                params=int(c.params),
                flops_fwd=float(c.flops),
                time=t + comm,
                tp_comm=comm,
                local_params=local,
                static=local * bpp + buffers,
                act=act,
                peak=peak,
                after=pipeline_reduce_bytes(local, shape),
            )
        )
    if lp_grads_dropped(shape):
        # the loss runs in forward before any gradient of the step is made; in backward the
        # weight gradient's cast becomes the parameter's gradient (model state)
        held = elem * sum(c.local_params for c in out)
        forward = loss_forward_bytes(cfg, shape, vocab_local) - held
        scaled = loss_backward_bytes(cfg, shape, vocab_local, cast=False)
        out[-1] = replace(out[-1], peak=max(forward, scaled))
    return out


#: Bytes per token of the fused loss's statistics of one chunk (fp32 max, target logit and its
#: masked copy, row sum, loss; the int64 local target and the bool outside-slice mask).
LOSS_STAT_BYTES = 5 * 4 + 8 + 1


def loss_forward_bytes(cfg: Config, shape: RunShape, vocab_local: float) -> float:
    """The fused LM-head loss's working set in forward beyond what it keeps for backward
    (:class:`~tapered_megatron.parallel.cross_entropy._LinearCEMean`): the head's input and the
    loss's (the normed hidden states, whole in the TP region), the per-token weights, and per
    chunk of tokens the fp32 logits buffer (at most ``CHUNK_BYTES``) with its statistics; below
    fp32 also the chunk's logits product and its gradient cast to the model's dtype, and the
    weight-gradient product ``g^T h`` before it is added to the fp32 sum."""
    from tapered_megatron.parallel.cross_entropy import CHUNK_BYTES

    elem, tok, d = activation_scale(shape.precision), shape.tokens, cfg.model.d_model
    sp = shape.tp if shape.sequence_parallel and shape.tp > 1 else 1
    chunk = max(1.0, min(tok, CHUNK_BYTES // (4 * vocab_local)))
    out = (elem * d * (1 + 1 / sp) + 4.0) * tok + (4.0 * vocab_local + LOSS_STAT_BYTES) * chunk
    if elem != 4:
        out += elem * vocab_local * (chunk + d)
    return out


def loss_backward_bytes(cfg: Config, shape: RunShape, vocab_local: float, cast: bool) -> float:
    """The fused LM-head loss's working set in backward beyond what it kept
    (:class:`~tapered_megatron.parallel.cross_entropy._LinearCEMean`): its two saved gradients
    scaled into new tensors, the fp32 weight gradient and the input's, and with ``cast`` (below
    fp32) the weight gradient's cast to the model's dtype beside the fp32 one."""
    elem, d = activation_scale(shape.precision), cfg.model.d_model
    out = (4.0 * vocab_local + elem * shape.tokens / shape.tp) * d
    if cast and elem != 4:
        out += elem * vocab_local * d
    return out


def lp_grads_dropped(shape: RunShape) -> bool:
    """Whether no gradient of the model's dtype exists while a step's only micro-batch runs
    forward: DeepSpeed's BF16_Optimizer outside a pipeline (bf16, ZeRO 0-1) sets them to
    ``None`` after each step and makes them in backward (from the second micro-batch of a step
    on they are kept, zeroed)."""
    bf16_optimizer = shape.precision == "bf16" and shape.zero_stage <= 1
    return bf16_optimizer and not shape.pipeline and shape.micro_batches == 1


def pipeline_buffer_bytes(cfg: Config, shape: RunShape, stages: int) -> float:
    """Bytes of DeepSpeed's pipeline engine's buffers on a stage during a step: for each of its
    ``max(2, min(P - j, M))`` pipe buffers the received input, the output and the output's copy
    it sends, and one gradient buffer; each one micro-batch's residual stream
    (:func:`residual_bytes`). Counted at the first stage's buffer count, the most of any
    stage."""
    tensors = 3 * max(2, min(stages, shape.micro_batches)) + 1
    return tensors * residual_bytes(cfg, shape)


def pipeline_held_bytes(cfg: Config, shape: RunShape, stages: int, stage: int) -> float:
    """Bytes of the pipeline engine's buffers stage ``stage`` of ``stages`` still holds when the
    optimizer step begins. The first stage receives no activations and each micro-batch's
    backward releases its output and the copy it sent: what stays is the gradient receive
    buffer the engine reuses (``_grad_layer_buf``), one residual stream. A later stage keeps
    received inputs and its outputs' buffers (the last stage: the loss outputs and their
    graph's stash) up to :func:`pipeline_buffer_bytes`."""
    if stage == 0 and stages > 1:
        return residual_bytes(cfg, shape)
    return pipeline_buffer_bytes(cfg, shape, stages)


def residual_bytes(cfg: Config, shape: RunShape) -> float:
    """Bytes of one micro-batch's residual stream on one rank (a sequence shard under sequence
    parallelism): the tensor a pipeline stage sends, receives and gets the gradient of."""
    sp = shape.tp if shape.sequence_parallel and shape.tp > 1 else 1
    return shape.tokens * cfg.model.d_model * activation_scale(shape.precision) / sp


def zero3_gathered(params: Sequence[float], zero3: Zero3) -> float:
    """Most parameter elements ZeRO-3 holds gathered at once in a steady-state step (units in
    forward order, ``params`` TP-local): DeepSpeed 0.19's ``PartitionedParameterCoordinator``
    replayed at unit granularity.

    From the third step the coordinator has the trace of the step's module uses (forward, then
    backward) as a queue. Fetching a unit pops the queue up to its use, then prefetches: it pops
    further entries until ``stage3_prefetch_bucket_size`` elements of *not gathered* weights
    are being fetched, or as many as keep all gathered weights within
    ``stage3_max_live_parameters``, noting for every popped entry (gathered or not) the step of
    that later use. Every step thus fetches up to a bucket ahead, so the gathered weights grow
    up to the live-parameter cap (the whole model below it). Releasing a unit after its use
    (``__params_to_release``) keeps it gathered when a later use of it was already popped, or
    when its next use comes before ``stage3_max_reuse_distance`` elements of parameters are
    fetched (from a unit's forward to its backward: the forward and backward of every later
    unit). (The first step releases every unit after use and the second records the trace.)
    """
    n = len(params)
    later = [sum(params[u + 1 :]) for u in range(n)]
    order = [*range(n), *reversed(range(n))]
    queue = deque(enumerate(order))  # (step, unit) of every use in the step
    noted = [-1] * n  # the latest use of each unit popped so far
    held = [False] * n
    most = 0.0
    for step, u in enumerate(order):
        while queue and queue[0][0] <= step:
            t, v = queue.popleft()
            noted[v] = max(noted[v], t)
        held[u] = True
        fetching = 0.0
        live = sum(p for p, h in zip(params, held, strict=True) if h)
        budget = min(zero3.prefetch_bucket_size, zero3.max_live_parameters - live)
        while queue and fetching < budget:
            t, v = queue.popleft()
            noted[v] = max(noted[v], t)
            if not held[v]:
                held[v] = True
                fetching += params[v]
        most = max(most, sum(p for p, h in zip(params, held, strict=True) if h))
        reused = step < n and 2.0 * later[u] < zero3.max_reuse_distance
        if noted[u] <= step and not reused:
            held[u] = False
    return most


def zero3_stage_bytes(
    cfg: Config, costs: Sequence[UnitCost], shape: RunShape, device: Device
) -> float:
    """Per-rank bytes of a ZeRO-3 run (one pipeline stage: DeepSpeed runs ZeRO-3 without
    pipeline parallelism) besides ``static + act + max(peak)`` of its units, from how
    DeepSpeed 0.19's ``DeepSpeedZeroOptimizer_Stage3`` and torch's AdamW work:

    * the reduce bucket (:func:`zero3_held_bytes`): ``torch.empty(reduce_bucket_size)`` of the
      communication dtype (the model's), made once at start (``_setup_for_real_optimizer``);
      with ``contiguous_gradients`` every gradient that fits is copied into it until the next
      one would overflow it; and the first unit's gathered weights, held through the step;
    * the gathered weights: the most held at once in the steady state (:func:`zero3_gathered`:
      the running unit, those prefetched, those kept from forward to backward);
    * reducing the bucket: ``reduce_scatter_coalesced`` interleaves the rank chunks of the
      bucket's gradients into one new flat tensor (``torch.cat``) before the reduce-scatter;
    * the optimizer step, one sub-group (``sub_group_size`` elements of this rank's partition,
      plus the parameter that crosses the limit) at a time: ``_prepare_fp32_grad_for_sub_group``
      flattens its gradient partitions into a new tensor and casts it to fp32 (the 16-bit
      flat copy and the fp32 one exist together in bf16), then AdamW's temporaries
      (:attr:`Device.adam_temporaries`) sit next to that fp32 gradient. Activations and
      gathered weights are gone by then, so this phase and the forward/backward one are
      alternatives: the larger counts.

    Model state (fp32 master, Adam moments, the gradient partitions in the gradient-accumulation
    dtype: fp32 in the shipped and planned configs) is :func:`bytes_per_param`'s.
    """
    if isinstance(shape.zero3, Fsdp):
        return fsdp_stage_bytes(costs, shape)
    elem = activation_scale(shape.precision)
    params = [c.local_params for c in costs]
    total = sum(params)
    z = shape.zero3
    reduce_copy = min(z.reduce_bucket_size, total)
    fwd_bwd = (zero3_gathered(params, z) + reduce_copy) * elem
    largest = cfg.padded_vocab_size / shape.tp * cfg.model.d_model  # embedding / head weight
    sub = min(total / shape.dp, z.sub_group_size + largest / shape.dp)
    step = sub * 4.0 * (1 + device.adam_temporaries)
    if elem != 4:
        step = max(step, sub * (elem + 4.0))
    units = sum(c.act for c in costs) + units_transient(costs)
    first = params[0] * elem if params else 0.0  # gathered through the step
    return zero3_held_bytes(params, shape, device) + max(fwd_bwd - first, step - units)


def zero3_held_bytes(params: Sequence[float], shape: RunShape, device: Device) -> float:
    """What ZeRO-3 holds from step to step on a rank of units with ``params`` TP-local
    parameters (forward order), besides the model state: its reduce bucket, made once of the
    model's dtype (where only written pages are resident, a CPU, at most the model's size of
    it), and the first unit's gathered weights: its backward comes last and its next use is
    the next step's first, within any reuse distance, so it is never released."""
    z = shape.zero3
    total = sum(params)
    bucket = min(z.reduce_bucket_size, total) if device.lazy_pages else z.reduce_bucket_size
    return (bucket + (params[0] if params else 0.0)) * activation_scale(shape.precision)


def fsdp_bytes_per_param(dp: int) -> float:
    """Model-state bytes per parameter of FSDP ``FULL_SHARD``, all sharded over ``dp``: the
    flat parameter in the model's dtype, fp32 (mixed precision casts a ``param_dtype`` copy for
    each all-gather), its gradient cast back to that dtype after the reduce-scatter (torch's
    ``_cast_grad_to_param_dtype``, for the optimizer step to run in it) and Adam's two fp32
    moments: ``16 / dp``. DeepSpeed's bf16 ZeRO-3 holds a bf16 partition
    beside its fp32 master: ``18 / dp`` (:func:`bytes_per_param`)."""
    return 16.0 / dp


def fsdp_stage_bytes(costs: Sequence[UnitCost], shape: RunShape) -> float:
    """Per-rank bytes of an FSDP ``FULL_SHARD`` run besides ``static + act + max(peak)`` of its
    units (whose ``peak`` holds the unit's unsharded gradient until its reduce-scatter, as
    under ZeRO-3): the gathered weights, in ``param_dtype``.

    * the root's (embedding, final norm, an untied head) stay gathered from its forward to
      the end of backward: torch's ``_post_forward_reshard`` frees no root parameters after
      forward under ``FULL_SHARD``;
    * of the blocks at most two at once, the one computing and the next, whose all-gather is
      prefetched: ``limit_all_gathers`` holds the CPU thread back until then (the rate
      limiter of torch's ``FullyShardedDataParallel``); each is freed after its forward and
      after its backward.

    * the reduce-scatter input beside a block's gradients (:attr:`Fsdp.reduce_copy_bytes`).

    FSDP has no reduce bucket, and its optimizer step runs per parameter or flat shard
    (Composer's ``DecoupledAdamW`` loops over tensors; torchtitan's fused AdamW), one tensor's
    temporaries at a time, far below this forward/backward working set."""
    elem = activation_scale(shape.precision)
    root = sum(c.local_params for c in costs if c.kind in ("embedding", "head"))
    layers = sorted((c.local_params for c in costs if c.layer is not None), reverse=True)
    copy_bytes = shape.zero3.reduce_copy_bytes if isinstance(shape.zero3, Fsdp) else 0
    reduce_copy = layers[0] * copy_bytes if layers else 0.0
    return (root + sum(layers[:2])) * elem + reduce_copy


def model_unit_costs(
    cfg: Config, shape: RunShape, device: Device, unit: str = "layer", profiled: bool = False
) -> list[UnitCost]:
    """Unit costs of ``cfg`` for ``shape`` on ``device`` (analytic, or profiled here and cached)."""
    if not profiled:
        return unit_costs(cfg, shape, device, unit)
    from tapered_megatron.planning.profile import profile_units

    prof = profile_units(cfg, unit, shape.micro_batch_size, shape.recompute)
    # measured saved bytes win; under recompute autograd's hooks do not see what a
    # checkpointed region keeps, so the counted bytes stand
    act = None if shape.recompute != "none" else prof["act_bytes"]
    return unit_costs(cfg, shape, device, unit, prof["time"], act)


def units_transient(costs: Sequence[UnitCost]) -> float:
    """The most a stage of these units (in order) adds at once to the activations of its
    micro-batches in flight: a unit's transient beside the activations of the units before it
    (:func:`~tapered_megatron.planning.solver.stage_transient`)."""
    from tapered_megatron.planning.solver import stage_transient

    return stage_transient([c.act for c in costs], [c.peak for c in costs])


def inflight(stages: int, micro_batches: int) -> list[int]:
    """Micro-batches whose activations stage ``j`` holds at once under 1F1B: ``min(P - j, M)``."""
    return [min(stages - j, micro_batches) for j in range(stages)]


def stage_memory(
    costs: Sequence[UnitCost], parts: Sequence[int], micro_batches: int, overhead: float = 0.0
) -> list[float]:
    """Predicted bytes per stage for a ``parts`` boundary list."""
    p = len(parts) - 1
    fl = inflight(p, micro_batches)
    out = []
    for j in range(p):
        us = costs[parts[j] : parts[j + 1]]
        working = fl[j] * sum(u.act for u in us) + units_transient(us)
        out.append(overhead + sum(u.static for u in us) + max(working, stage_after(us)))
    return out


def p2p_time(nbytes: float, bw: float, device: Device) -> float:
    """One point-to-point send of ``nbytes`` at ``bw`` bytes/s: the device's fixed cost per send
    (:attr:`Device.p2p_latency_s`) and the bytes."""
    return device.p2p_latency_s + nbytes / bw


def optimizer_time(params: float, bpp: float, device: Device) -> float:
    """One optimizer step over ``params`` parameters holding ``bpp`` model-state bytes each
    (:func:`bytes_per_param`): memory bound, the state read and written once."""
    return 2 * params * bpp / device.mem_bw


def step_time(stage_times: Sequence[float], micro_batches: int, p2p: float = 0.0) -> float:
    """1F1B step time: fill + drain sum every stage once, the slowest stage repeats M - 1 times.

    ``p2p`` is the per-boundary, per-micro-batch send time (forward activation + backward grad).
    """
    p = len(stage_times)
    return sum(stage_times) + (micro_batches - 1) * max(stage_times) + 2 * (p - 1) * p2p


# ---------------------------------------------------------------- data-parallel communication
#: DeepSpeed's ZeRO-1/2 reduce bucket sizes the planner picks from (elements): at least 50M
#: (a message far above the latency-bound size), at most DeepSpeed's own default of 500M.
BUCKET_RANGE = (50_000_000, 500_000_000)
#: Buckets per stage's gradients the planner aims at: the last bucket, reduced after backward
#: ends, is the part of an overlapped reduce that stays exposed.
BUCKETS = 8


def reduce_bucket_elems(stage_params: float) -> int:
    """``reduce_bucket_size`` (= ``allgather_bucket_size``) the planner writes for ZeRO-1/2: a
    ``1 / BUCKETS`` share of the stage's TP-local parameters, in :data:`BUCKET_RANGE`, rounded
    to a million elements."""
    low, high = BUCKET_RANGE
    return int(min(high, max(low, round(stage_params / BUCKETS / 1e6) * 1e6)))


def overlap_bucket_bytes(stage_params: float, elem: int, zero_stage: int) -> float:
    """Bytes of DeepSpeed's ZeRO-1/2 gradient buckets under ``overlap_comm`` with contiguous
    gradients (``stage_1_and_2.py``): two ``reduce_bucket_size`` buffers of the reduction dtype
    (the fp32 accumulation dtype for ZeRO-1, the model's for ZeRO-2), made once at their full
    size. bf16 ZeRO-1 runs DeepSpeed's ``BF16_Optimizer``, which makes none (its reduce is
    :func:`fallback_reduce_bytes`); other stages and ZeRO-3 (counted in
    :func:`zero3_stage_bytes`): 0."""
    if zero_stage not in (1, 2) or (zero_stage == 1 and elem == 2):
        return 0.0
    dtype = 4 if zero_stage == 1 else elem
    return 2.0 * reduce_bucket_elems(stage_params) * dtype


#: Gradient elements DeepSpeed's engine flattens at once when it all-reduces them itself
#: (``MEMORY_OPT_ALLREDUCE_SIZE`` of ``deepspeed/runtime/engine.py``).
FALLBACK_REDUCE_ELEMS = 500_000_000


def pipeline_reduce_bytes(local_params: float, shape: RunShape) -> float:
    """What a unit of ``local_params`` adds to the gradient reduce after a bf16 pipeline
    stage's last backward: the engine's ``_bf16_reduce_grads`` runs the same flattening all-reduce
    as :func:`fallback_reduce_bytes` (at any data-parallel size), summed over the stage's units
    (at most :data:`AFTER_CAP` a stage). Outside a bf16 pipeline, 0 (a single stage's reduce
    is counted for the stage, :func:`balance.analyse`)."""
    if not (shape.pipeline and shape.precision == "bf16" and shape.zero_stage <= 1):
        return 0.0
    return fallback_reduce_bytes(local_params, activation_scale(shape.precision))


def stage_after(units: Sequence[UnitCost]) -> float:
    """What a stage of ``units`` holds beside its model state after its last backward
    (:attr:`UnitCost.after` summed, at most :data:`AFTER_CAP`)."""
    return min(sum(u.after for u in units), AFTER_CAP)


def fallback_reduce_bytes(stage_params: float, elem: int) -> float:
    """The transient of ``BF16_Optimizer``'s gradient reduce (bf16 with ZeRO-1): after the last
    backward the engine flattens the fp32 gradients, up to :data:`FALLBACK_REDUCE_ELEMS` of
    them at a time, and casts the flat copy to the model's dtype before the all-reduce. The
    activations are gone by then, so it is an alternative to the forward/backward working
    set, not an addition."""
    return min(stage_params, FALLBACK_REDUCE_ELEMS) * (4.0 + elem)


#: The most a stage holds after its last backward: a bf16 pipeline's reduce flattens at most
#: :data:`FALLBACK_REDUCE_ELEMS` gradients at a time (:func:`pipeline_reduce_bytes`).
AFTER_CAP = fallback_reduce_bytes(FALLBACK_REDUCE_ELEMS, 2)


def dp_bandwidth(device: Device, tp: int, dp: int) -> float:
    """Per-rank bandwidth of a ring collective over a data-parallel group of ``dp`` ranks whose
    neighbours are ``tp`` ranks apart (topology axes pipe, data, model).

    Inside one node: NVLink. Across nodes every GPU has its own network port (``inter_bw``) and
    NCCL runs one ring per port, so the group's ``k`` ranks on a node move the node's share of
    the ring over ``k`` ports at once: ``k x inter_bw`` per rank, at most NVLink (``k = 1`` for
    a group with one rank per node, e.g. under TP 8)."""
    if dp * tp <= device.gpus_per_node:
        return device.intra_bw
    k = max(1, min(dp, device.gpus_per_node // tp))
    return min(device.intra_bw, k * device.inter_bw)


@dataclass(frozen=True)
class DPComm:
    """Data-parallel communication of one optimizer step (seconds): ``total`` of it, the part
    ``overlapped`` with backward compute (DeepSpeed ``overlap_comm``), what each part is."""

    total: float
    overlapped: float
    how: str

    @property
    def exposed(self) -> float:
        """The part that adds to the step time."""
        return self.total - self.overlapped


def dp_comm(
    stage_params: float,
    dp: int,
    zero_stage: int,
    micro_batches: int,
    pipeline: bool,
    elem: float,
    bw: float,
    backward_s: float,
    compute_s: float,
    bf16_optimizer: bool = False,
) -> DPComm:
    """DP communication of a step for a stage of ``stage_params`` TP-local parameters, and how
    much of it DeepSpeed 0.19 overlaps with compute (``overlap_comm: true``, as the shipped and
    planned ZeRO configs set it). ``backward_s`` / ``compute_s``: one micro-batch's backward /
    forward + backward time on the stage.

    * the gradient reduce (reduce-scatter, ``(dp - 1) / dp`` of the bytes): ZeRO-2/3 reduce
      every micro-batch (the partitioned gradients cannot accumulate unreduced), ZeRO-0/1 once
      per step. With ``overlap_comm`` and no pipeline, a bucket is reduced on a side stream as
      soon as backward fills it: each reduce hides behind its micro-batch's backward except the
      last bucket (:func:`reduce_bucket_elems`), which is reduced after backward ends. ZeRO-0
      (the engine's all-reduce after backward) and the pipeline engine (gradients reduced after
      the 1F1B schedule) overlap nothing.
    * the parameter all-gather (``(dp - 1) / dp``): after the optimizer step under ZeRO-0/1/2
      (part of ZeRO-0's all-reduce), not overlapped; ZeRO-3 gathers every forward and backward
      with prefetching, hidden behind that micro-batch's compute where it is shorter.
    * ``bf16_optimizer``: bf16 ZeRO-1 with fp32 gradient accumulation runs DeepSpeed's
      BF16_Optimizer (what the shipped and planned configs give), which all-reduces the bf16
      gradients after backward (a reduce-scatter and an all-gather) and then all-gathers the
      updated parameters: three of the units above, none overlapped.
    """
    if dp <= 1:
        return DPComm(0.0, 0.0, "no data parallelism")
    one = (dp - 1) / dp * stage_params * elem / bw  # a reduce-scatter or all-gather
    if bf16_optimizer and zero_stage == 1:
        return DPComm(
            3 * one, 0.0, "not overlapped (BF16_Optimizer all-reduces after backward, then gathers)"
        )
    reduces = micro_batches if zero_stage >= 2 else 1
    reduce_s = reduces * one
    gather_s = 2 * micro_batches * one if zero_stage >= 3 else one
    total = reduce_s + gather_s
    if zero_stage == 0 or pipeline:
        where = "pipeline engine" if pipeline else "ZeRO-0"
        return DPComm(total, 0.0, f"not overlapped ({where} reduces after backward)")
    tail = one * min(1.0, reduce_bucket_elems(stage_params) / stage_params)
    if zero_stage >= 3:  # the reduce and both gathers share the links: all behind compute
        hidden = micro_batches * min(one - tail + 2 * one, compute_s)
        how = "gradient reduce and prefetched parameter gathers overlapped per micro-batch"
    else:
        hidden = reduces * min(one - tail, backward_s)
        which = "each" if reduces > 1 else "the last"
        how = f"gradient reduce overlapped with the backward of {which} micro-batch"
    return DPComm(total, hidden, how + " (overlap_comm), last bucket exposed")
