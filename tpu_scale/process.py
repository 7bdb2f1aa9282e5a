"""Process-wide settings for TensorFlow's sake, that the package never makes by itself.

Importing `tpu_scale`, calling `create_strategy` and training with `fit` leave your process as they
found it: no environment variable, thread scheduling policy, file descriptor, `sys.modules` entry,
signal handler (outside `fit`'s callbacks) or method of a public Keras or TensorFlow class is
changed. Two fixes for TensorFlow behaviour can only work process-wide; each is yours to ask for,
by name, and each says when it can go:

  use_bfc_cpu_allocator   TensorFlow's default CPU allocator hands large buffers back to the
                          system after each use, so every training step faults its activations in
                          again; the BFC allocator keeps them for reuse.
  avoid_iterator_stalls   deleting a tf.data iterator can stall for seconds on CPU hosts, at the
                          end of every `evaluate` and `fit` (`_workarounds.batch_scheduling`).

    import tpu_scale.process
    tpu_scale.process.use_bfc_cpu_allocator()   # before TensorFlow runs its first op
    tpu_scale.process.avoid_iterator_stalls()
    strategy = tpu_scale.create_strategy(num_cpu_replicas=8)

Figures for both: `benchmarks/README.md`.
"""

import os

from tpu_scale import _workarounds

BFC_VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


def use_bfc_cpu_allocator():
    """Selects TensorFlow's BFC allocator for the CPU, in this process and those it starts.

    Sets `TF_CPU_ALLOCATOR_USE_BFC=1` unless the variable is already set (`0` keeps TensorFlow's
    default allocator). TensorFlow reads it when it first creates its CPU device, so call this
    before any TensorFlow op runs (before `create_strategy`); afterwards it has no effect on this
    process. Not a bug fix but a choice of allocator: TensorFlow's default returns large buffers
    to the system after each use, so a training step that allocates the same activations every
    time faults them in again, where BFC keeps them for reuse.

    Returns:
      The value the variable now has.
    """
    return os.environ.setdefault(BFC_VARIABLE, "1")


def avoid_iterator_stalls():
    """Makes the stall in deleting a tf.data iterator on CPU hosts rare.

    Two changes, both process-wide (see `tpu_scale._workarounds` for the mechanism, its upstream
    status and how to tell it can go):

    * every thread of the process, and those it starts later, runs under Linux's `SCHED_BATCH`
      policy (`_workarounds.batch_scheduling`; nothing happens where the policy does not exist);
    * the per-replica iterators of distributed datasets are built without tf.data autotuning
      (`_workarounds.replica_iterators_untuned`, which replaces TensorFlow's private
      `multi_device_iterator_ops._create_device_dataset`).

    Worth it when a run with several CPU replicas evaluates often (each `evaluate`, inside `fit`
    every epoch, deletes an iterator); on GPU and TPU hosts there is no need. Idempotent.
    """
    _workarounds.replica_iterators_untuned()
    _workarounds.batch_scheduling()
