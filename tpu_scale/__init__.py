"""tpu_scale: supercomputer-scale image training techniques for TensorFlow/Keras.

The public surface:
  create_strategy   finds the hardware and returns a `tf.distribute` strategy with a `.mesh`
  ReplicaMesh       the 2-D grid of replicas (TPU torus, or hosts x local devices)

Subpackages: `tpu_scale.layers` (grouped batch norm), `tpu_scale.collectives` (group sums over the
mesh), `tpu_scale.torus` (2-D gradient summation), `tpu_scale.data` (the input builder),
`tpu_scale.optimizers`, `tpu_scale.schedules`, `tpu_scale.models`, `tpu_scale.plan` (the pod-scale
cost model).
"""

from tpu_scale.mesh import ReplicaMesh

__version__ = "0.1.0"


def __getattr__(name):
    # Importing TensorFlow takes seconds; the mesh geometry does not need it.
    if name in ("create_strategy", "mesh_of"):
        from tpu_scale import _workarounds

        with _workarounds.quiet_cuda_probe():  # this may be TensorFlow's first import
            from tpu_scale import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'tpu_scale' has no attribute {name!r}")


__all__ = ["ReplicaMesh", "create_strategy", "mesh_of"]
