"""DeepSpeed's own estimate of ZeRO-3's model-state memory, reproduced: the plan puts it beside its own figures
(:class:`aidaptiv_ds.planner.memory.BackendPlan`'s ``deepspeed_estimate``), and a test compares the two formulas.
Kept apart from the planner's model because it is DeepSpeed's arithmetic, not ours."""

from __future__ import annotations

ADDITIONAL_BUFFER_FACTOR = 1.5  # estimate_zero3_model_states_mem_needs's default


def deepspeed_estimate(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR,
):
    """(cpu bytes per node, gpu bytes per GPU, largest layer bytes): DeepSpeed 0.19's
    ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, the same formula."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory
