"""The optimizer update's cost per step, every replica updating every weight against each replica
updating 1/N of them (`DistributedOptimizer(..., weight_update_sharding=True)`).

The update is priced as memory traffic: per parameter it reads and writes a fixed number of
float32 values (`UPDATE_BYTES_PER_PARAM`), at the bandwidth of the memory one replica's update
runs on (`Hardware.memory_bandwidth`). Replicated, every replica moves all of them; sharded, each
of the N replicas moves its `ceil(params / N)`, N being every replica of the hardware: on CPU and
GPU hosts as the package shards (across workers too), on a TPU slice as XLA shards (Xu et al.
2020), which `create_strategy` does not do on TPUs yet. The gradient sum costs the same bytes
either way: the torus sum is already a reduce-scatter and an all-gather around an all-reduce of
the shard down the mesh's columns, and the sharded update splits that all-reduce into its own
reduce-scatter and all-gather with the update between them, so only the update's own time
changes. The optimizer state per replica shrinks the same way (`SLOTS`).

Reference:
  Xu et al., "Automatic Cross-Replica Sharding of Weight Update in Data-Parallel Training", 2020
  (arXiv:2004.13336).
"""

import math

# Bytes each parameter's update reads and writes, all float32: SGD with momentum reads the weight,
# the gradient and the momentum and writes the momentum and the weight (5 x 4); LARS also reads
# the weight and the gradient once more for their norms (7 x 4); Adam reads the weight, the
# gradient and two moments and writes the moments and the weight (7 x 4); AdamW's decoupled decay
# reads and writes the weight once more (9 x 4).
UPDATE_BYTES_PER_PARAM = {"sgd": 20, "lars": 28, "adam": 28, "adamw": 36}
SLOTS = {"sgd": 1, "lars": 1, "adam": 2, "adamw": 2}  # float32 state values per parameter
OPTIMIZERS = tuple(UPDATE_BYTES_PER_PARAM)

SOURCES = (
    "Optimizer update priced as memory traffic of float32 values per parameter (SGD momentum 20 B, "
    "LARS 28 B, Adam 28 B, AdamW 36 B: the reads and writes of weight, gradient and state, counted "
    "from the update rules) at the replica's memory bandwidth, compute and launch costs ignored: "
    "assumption.",
    "Sharded update: each replica updates ceil(params / N) parameters; the gradient sum's bytes "
    "are unchanged (its reduce-scatter and all-gather are the torus sum's own phases; Xu et al. "
    "2020, arXiv:2004.13336).",
)


def weight_update(hardware, num_params, optimizer="lars", step_seconds=None):
    """The update's time per step and state per replica, replicated and sharded.

    Args:
      hardware: a `Hardware` with a `memory_bandwidth`.
      num_params: parameters the optimizer updates.
      optimizer: one of `OPTIMIZERS`.
      step_seconds: the step's time, for the update's share of it; None to leave the shares out.

    Returns:
      A JSON-ready dict: `optimizer`, `bytes_per_param`, `memory_bandwidth_per_replica`,
      `sharded_over` (the N above), `in_package` (False on TPU), `replicated_seconds`,
      `sharded_seconds`, `saved_seconds`, `state_bytes_per_replica`
      (`replicated`, `sharded`), and with `step_seconds`: `share_of_step` (`replicated`,
      `sharded`) and `step_speedup` (the step's time replicated over its time sharded). None when
      the hardware's memory bandwidth is unknown.

    Raises:
      ValueError: for an unknown optimizer or a non-positive parameter count.
    """
    if optimizer not in UPDATE_BYTES_PER_PARAM:
        raise ValueError(f"Unknown optimizer {optimizer!r}; choose one of {list(OPTIMIZERS)}.")
    if not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"num_params must be a positive integer, got {num_params!r}.")
    bandwidth = hardware.memory_bandwidth
    if not bandwidth:
        return None
    per_param = UPDATE_BYTES_PER_PARAM[optimizer]
    shard = math.ceil(num_params / hardware.num_replicas)
    replicated = num_params * per_param / bandwidth
    sharded = shard * per_param / bandwidth
    result = {
        "optimizer": optimizer,
        "bytes_per_param": per_param,
        "memory_bandwidth_per_replica": bandwidth,
        "sharded_over": hardware.num_replicas,
        "in_package": hardware.kind != "tpu",
        "replicated_seconds": replicated,
        "sharded_seconds": sharded,
        "saved_seconds": replicated - sharded,
        "state_bytes_per_replica": {
            "replicated": num_params * SLOTS[optimizer] * 4,
            "sharded": shard * SLOTS[optimizer] * 4,
        },
        "share_of_step": None,
        "step_speedup": None,
    }
    if step_seconds:
        result["share_of_step"] = {
            "replicated": replicated / step_seconds,
            "sharded": sharded / step_seconds,
        }
        result["step_speedup"] = step_seconds / (step_seconds - replicated + sharded)
    return result
