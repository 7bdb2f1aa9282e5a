"""What is running here: the mesh of a strategy, the mesh collectives run over, their backend, and
which task of its cluster this process is.

Look-ups of the running `tf.distribute` context, shared by the collectives, the layers, the
gradient sum and the checkpointing, so that none of them reaches up into the strategy factory:

  task_of(strategy)   this process's task and its cluster's chief and worker tasks, in order
  mesh_of(strategy)   the `ReplicaMesh` of a strategy (ours carry one; any other gets a derived one)
  current_mesh()      the mesh of the current replica context, or None with nothing to talk to
  backend()           the collective implementation here: "tpu", "collective", "eager", "single"
  tpu_graph(mesh)     build TPU ops for `mesh` in a graph with no TPU present (to inspect them)
"""

import contextlib
import threading

import tensorflow as tf

from tpu_scale.distribute.mesh import ReplicaMesh

_forced = threading.local()

BACKENDS = ("tpu", "collective", "eager", "single")


def is_tpu_strategy(strategy):
    """True for TensorFlow's TPU strategies (and ours, which subclass them)."""
    return isinstance(strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy))


def task_of(strategy):
    """Which task of its cluster this process is, and the cluster's chief and worker tasks.

    The one reading of a strategy's `cluster_resolver` for "which task am I": the collectives'
    process order, the chief that writes a run's files and the checkpointing's peers all use it.

    Args:
      strategy: a `tf.distribute` strategy (or anything with a `cluster_resolver`, or without one).

    Returns:
      `(me, tasks)`. `tasks`: the `(job, index)` of the cluster's chief (if it has one), then of its
      workers by index: the order of the strategy's replica ids. `me`: this process's
      `(job, index)` (an evaluator's is not in `tasks`); None when there is no cluster (no
      resolver, or an empty cluster spec: one process).
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec:
        return None, ()
    tasks = []
    for job in ("chief", "worker"):
        jobs = spec.get(job, ())  # a list, or a dict of index -> address when sparse
        indices = sorted(jobs) if isinstance(jobs, dict) else range(len(jobs))
        tasks += [(job, int(i)) for i in indices]
    index = resolver.task_id
    return (resolver.task_type, None if index is None else int(index)), tuple(tasks)


def task_name(task):
    """The runtime's name of a `(job, index)` task, e.g. `"/job:worker/replica:0/task:1"`."""
    job, index = task
    return f"/job:{job}/replica:0/task:{index}"


def mesh_of(strategy=None):
    """The `ReplicaMesh` of a strategy (the current one by default).

    Strategies from `create_strategy` carry their mesh; for any other strategy it is derived: one
    row per worker for multi-worker strategies, a single row of replicas otherwise.

    Args:
      strategy: a `tf.distribute.Strategy`; defaults to `tf.distribute.get_strategy()`.

    Returns:
      A `ReplicaMesh`.
    """
    strategy = strategy or tf.distribute.get_strategy()
    mesh = getattr(strategy, "mesh", None)
    if isinstance(mesh, ReplicaMesh):
        return mesh
    n = strategy.num_replicas_in_sync
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        local = len(strategy.extended.worker_devices)
        return ReplicaMesh.for_workers(n // local, local)
    return ReplicaMesh.for_devices(n)


@contextlib.contextmanager
def tpu_graph(mesh):
    """Builds TPU ops for `mesh` in the current graph, with no TPU present.

    Used to inspect the graph a TPU training step would run (op types, group assignments) on a
    machine without TPUs: inside this context `current_mesh()` is `mesh` and `backend()` is `"tpu"`,
    so every collective builds its TPU op. The graph cannot run on CPU.

    Args:
      mesh: the `ReplicaMesh` the TPU ops are built for.
    """
    previous = getattr(_forced, "mesh", None)
    _forced.mesh = mesh
    try:
        yield
    finally:
        _forced.mesh = previous


def forced_mesh():
    """The mesh of an enclosing `tpu_graph`, or None."""
    return getattr(_forced, "mesh", None)


def current_mesh():
    """The mesh collectives run over here, or None when there is nothing to communicate with.

    None outside replica context (e.g. a model called under `strategy.scope()` but outside
    `strategy.run`), under the default strategy, and with a single replica.
    """
    forced = forced_mesh()
    if forced is not None:
        return forced
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return None
    return mesh_of(ctx.strategy)


def backend():
    """Which collective implementation runs in the current replica context; one of `BACKENDS`.

    Raises:
      RuntimeError: in cross-replica context, where no replica could take part in a collective.
    """
    if forced_mesh() is not None:
        return "tpu"
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("tpu_scale collectives run in replica context: call them inside strategy.run(...), a Keras train_step or a layer's call, not in cross-replica context.")
    if ctx.num_replicas_in_sync == 1:
        return "single"
    if is_tpu_strategy(ctx.strategy):
        return "tpu"
    if tf.executing_eagerly():
        return "eager"
    return "collective"
