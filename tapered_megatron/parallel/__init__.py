"""Parallel mechanics in one package: topology and groups, TP mappings and layers, RNG.

Model files compose these and carry no process-group plumbing of their own. Everything works in
a single process without ``torch.distributed`` (TP = PP = 1).
"""

from tapered_megatron.parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy_mean,
)
from tapered_megatron.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPLayout,
    VocabParallelEmbedding,
    col_layout,
    column_input,
    init_parameters,
    row_layout,
    shard,
    unshard,
)
from tapered_megatron.parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from tapered_megatron.parallel.random import (
    get_rng_state,
    get_rng_tracker,
    model_parallel_seed,
    param_generator,
    param_seed,
    set_rng_state,
)
from tapered_megatron.parallel.topology import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_topology,
    init_model_parallel,
    model_parallel_is_initialized,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPLayout",
    "VocabParallelEmbedding",
    "col_layout",
    "column_input",
    "copy_to_tp_region",
    "destroy_model_parallel",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_rng_state",
    "get_rng_tracker",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_topology",
    "init_model_parallel",
    "init_parameters",
    "model_parallel_is_initialized",
    "model_parallel_seed",
    "param_generator",
    "param_seed",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "row_layout",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "set_rng_state",
    "shard",
    "unshard",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy_mean",
]
