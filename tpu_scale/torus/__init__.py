"""The torus gradient sum: a 2-D schedule, its executor as a strategy's `CrossDeviceOps`, and the
sharded weight update it feeds.

schedule        the plan of a sum: its phases (ring, 2-D torus, bidirectional, flat) over the mesh
                and the rule of "auto" (pure Python, shared by the executor and the planner)
all_reduce      `TorusAllReduce`, every sum of a strategy; `all_reduce_sum` in replica context
weight_update   the sharded update's layout and state (what `DistributedOptimizer` calls)
sharded_update  its steps: the gradients' reduce-scatter, each replica's share updated, the
                weights' all-gather
"""

from tpu_scale import _lazy

__getattr__ = _lazy.attributes(
    __name__,
    {
        "TorusAllReduce": "tpu_scale.torus.all_reduce",
        "all_reduce_sum": "tpu_scale.torus.all_reduce",
        "ALGORITHMS": "tpu_scale.torus.schedule",
        "GRADIENT_ALGORITHMS": "tpu_scale.torus.schedule",
    },
    submodules=("schedule", "all_reduce", "weight_update", "sharded_update"),
)

__all__ = ["ALGORITHMS", "GRADIENT_ALGORITHMS", "TorusAllReduce", "all_reduce_sum"]
