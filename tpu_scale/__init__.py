"""tpu_scale: supercomputer-scale image training techniques for TensorFlow/Keras.

The public surface:
  create_strategy   finds the hardware and returns a `tf.distribute` strategy with a `.mesh`
  mesh_of           the `ReplicaMesh` of a strategy
  ReplicaMesh       the 2-D grid of replicas (TPU torus, or hosts x local devices)
  TorusAllReduce    the torus gradient sum as a `tf.distribute.CrossDeviceOps`: every sum a
                    strategy makes (`create_strategy`'s strategies use it)
  DistributedOptimizer  wraps a Keras optimizer for what a strategy needs of it: the update sharded
                    over the replicas, Keras's gradient accumulation under a strategy

The package, imported on first use (`tpu_scale.data`, or `from tpu_scale import data`). Four
concepts, each one place:
  distribute        the mesh and the strategy: the grid of replicas, `create_strategy`, the group
                    sums over the mesh
  layers            batch norm over groups of replicas (and the image layers that feed it)
  data              the input pipeline: records or a folder of images to batches, exact evaluation
  torus             the torus gradient sum and the sharded weight update it feeds
Around them:
  the recipe        `recipe` (a run's settings from its batch and data), `schedules`,
                    `optimizers`, `losses`, `models`
  the run           `training` (a run's callbacks and folder), `callbacks`, `checkpointing`
  cluster, launch   `cluster` (where a run's cluster comes from: TPU, `TF_CONFIG`, Slurm),
                    `launch` (`python -m tpu_scale.launch`), `process` (process-wide settings for
                    TensorFlow's sake, opt-in by name)
  the planner       `plan` (the pod-scale cost model; no training run imports it)
  the seams         `keras_hook` and `tf_seam` (every Keras and TensorFlow internal the package
                    touches), `_workarounds` (fixes for upstream bugs); `testing` (test helpers)

Importing the package registers its Keras classes (layers, losses, optimizers, schedules) with
Keras, so that `keras.models.load_model` reads a model saved with them; that imports Keras and
TensorFlow where they are installed (without them, the planner and the mesh still import).
Otherwise importing the package, and `create_strategy`, change nothing global in your process
(`tpu_scale.process` says what stays untouched and what you can ask for).
"""

import importlib

from tpu_scale import _lazy
from tpu_scale.distribute.mesh import ReplicaMesh

__version__ = "0.1.0"

__getattr__ = _lazy.attributes(
    __name__,
    {
        "create_strategy": "tpu_scale.distribute.strategy",
        "mesh_of": "tpu_scale.distribute.strategy",
        "TorusAllReduce": "tpu_scale.torus.all_reduce",
        "DistributedOptimizer": "tpu_scale.keras_hook",
    },
    submodules=(
        "callbacks",
        "checkpointing",
        "cluster",
        "distribute",
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
    moved={
        "mesh": "tpu_scale.distribute.mesh",
        "strategy": "tpu_scale.distribute.strategy",
        "context": "tpu_scale.distribute.context",
        "collectives": "tpu_scale.distribute.collectives",
        "collective_launch": "tpu_scale.distribute.collective_launch",
        "torus_schedule": "tpu_scale.torus.schedule",
        "weight_update": "tpu_scale.torus.weight_update",
        "sharded_update": "tpu_scale.torus.sharded_update",
    },
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
