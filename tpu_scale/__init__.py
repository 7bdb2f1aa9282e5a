"""tpu_scale: supercomputer-scale image training techniques for TensorFlow/Keras.

The public surface:
  create_strategy   finds the hardware and returns a `tf.distribute` strategy with a `.mesh`
  mesh_of           the `ReplicaMesh` of a strategy
  ReplicaMesh       the 2-D grid of replicas (TPU torus, or hosts x local devices)
  TorusAllReduce    the torus gradient sum as a `tf.distribute.CrossDeviceOps`: every sum a
                    strategy makes (`create_strategy`'s strategies use it)
  DistributedOptimizer  wraps a Keras optimizer for what a strategy needs of it: the update sharded
                    over the replicas, Keras's gradient accumulation under a strategy

Subpackages and modules, imported on first use (`tpu_scale.data`, or `from tpu_scale import data`):
`layers` (grouped batch norm), `collectives` (group sums over the mesh), `torus` (2-D gradient
summation), `data` (records to inputs, exact evaluation, the input pipeline), `optimizers`,
`schedules` (learning-rate schedules), `recipe` (a run's settings from its batch and data),
`losses`, `callbacks`, `training` (a run's callbacks and folder), `checkpointing`, `models`,
`plan` (the pod-scale cost model), `cluster` (where a run's cluster comes from: TPU, `TF_CONFIG`,
Slurm), `launch` (`python -m tpu_scale.launch`, local workers), `process` (process-wide settings
for TensorFlow's sake, opt-in by name), `testing`.

Importing the package registers its Keras classes (layers, losses, optimizers, schedules) with
Keras, so that `keras.models.load_model` reads a model saved with them; that imports Keras and
TensorFlow where they are installed (without them, the planner and the mesh still import).
Otherwise importing the package, and `create_strategy`, change nothing global in your process
(`tpu_scale.process` says what stays untouched and what you can ask for).
"""

import importlib

from tpu_scale import _lazy
from tpu_scale.mesh import ReplicaMesh

__version__ = "0.1.0"

__getattr__ = _lazy.attributes(
    __name__,
    {
        "create_strategy": "tpu_scale.strategy",
        "mesh_of": "tpu_scale.strategy",
        "TorusAllReduce": "tpu_scale.torus",
        "DistributedOptimizer": "tpu_scale.keras_hook",
    },
    submodules=(
        "callbacks",
        "checkpointing",
        "cluster",
        "collectives",
        "data",
        "launch",
        "layers",
        "losses",
        "models",
        "optimizers",
        "plan",
        "process",
        "recipe",
        "schedules",
        "testing",
        "torus",
        "training",
    ),
)

__all__ = ["DistributedOptimizer", "ReplicaMesh", "TorusAllReduce", "create_strategy", "mesh_of"]


# Keras finds a saved model's custom classes ("tpu_scale>DistributedBatchNormalization") only in its
# registry, which each of these modules fills when imported; Keras itself imports no module of a
# package outside its own.
_KERAS_CLASSES = (
    "tpu_scale.layers",
    "tpu_scale.losses",
    "tpu_scale.optimizers",
    "tpu_scale.schedules",
    "tpu_scale.keras_hook",
)


def _register_keras_classes():
    try:
        import keras  # noqa: F401
    except ImportError:  # no Keras (or no backend for it): nothing could load a model anyway
        return
    for module in _KERAS_CLASSES:
        importlib.import_module(module)


_register_keras_classes()
