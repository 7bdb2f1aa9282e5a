"""The mesh and the strategy: where the replicas are, and how a group of them sums.

mesh               `ReplicaMesh`: the 2-D grid of replicas, its rows, columns and groups (pure
                   Python, shared by the executor and the planner)
strategy           `create_strategy`: the hardware found and initialized, a `tf.distribute` strategy
                   with a `.mesh`
context            where code runs: the strategy's mesh, the backend, this process's task
collectives        group sums over the mesh (in the step graph, collective ops, TPU ops): what
                   grouped batch norm, the torus sum and the sharded update are built from
collective_launch  one launch order of collectives across workers
"""

from tpu_scale import _lazy

__getattr__ = _lazy.attributes(
    __name__,
    {
        "ReplicaMesh": "tpu_scale.distribute.mesh",
        "create_strategy": "tpu_scale.distribute.strategy",
        "mesh_of": "tpu_scale.distribute.context",
    },
    submodules=("mesh", "strategy", "context", "collectives", "collective_launch"),
)

__all__ = ["ReplicaMesh", "create_strategy", "mesh_of"]
