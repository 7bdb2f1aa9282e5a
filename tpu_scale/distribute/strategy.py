"""`create_strategy`: find the hardware, initialize it, and return a `tf.distribute` strategy with a
  mesh.

One call for every platform:

* a TPU slice (a `tpu` name, `"local"`, or `TPU_NAME` in the environment): `TPUStrategy` with a
  device assignment built from the slice's topology; the mesh follows the physical torus;
* several hosts (a `cluster_resolver`, or `TF_CONFIG` or a Slurm step naming more than one worker,
  found by `tpu_scale.cluster`): `MultiWorkerMirroredStrategy`, optionally
  with several logical CPUs per worker; the mesh is workers x local replicas, so a mesh row never
  leaves a host;
* GPUs: `MirroredStrategy` over them;
* otherwise the CPU: `MirroredStrategy` over `num_cpu_replicas` logical CPU devices (virtual
  replicas).

The returned object is a real strategy (a thin subclass of the TensorFlow one) with extra
attributes: `mesh` (a `ReplicaMesh`), `gradient_reduction` (`"torus"` or `"native"`) and
`cross_device_ops` (the `tpu_scale.TorusAllReduce` that makes every sum of the strategy, or None
for TensorFlow's own). The fixes these classes carry for TensorFlow and Keras behaviour live in
`tpu_scale._workarounds`.
"""

import logging

import tensorflow as tf

from tpu_scale import _workarounds, keras_hook, tf_seam
from tpu_scale import cluster as cluster_lib
from tpu_scale.distribute.context import mesh_of  # noqa: F401  (tpu_scale.mesh_of)
from tpu_scale.distribute.mesh import ReplicaMesh, parse_mesh_shape
from tpu_scale.tf_seam import ag_ctx as autograph_ctx
from tpu_scale.tf_seam import autograph_api as autograph
from tpu_scale.torus import all_reduce as torus

logger = logging.getLogger(__name__)

GRADIENT_REDUCTIONS = keras_hook.GRADIENT_REDUCTIONS


# --------------------------------------------------------------------------- strategy classes


class _MeshMixin:
    """What our strategies add to TensorFlow's: the mesh and the gradient reduction."""

    def _attach(self, mesh, settings):
        if mesh.num_replicas != self.num_replicas_in_sync:
            raise ValueError(f"The mesh {mesh} holds {mesh.num_replicas} replicas but the strategy has {self.num_replicas_in_sync}.")
        self.mesh = mesh
        self.settings = settings  # as create_strategy declared them: keras_hook.Settings
        self.auto_algorithm = None
        sum_ops = self.cross_device_ops
        if sum_ops is not None:
            sum_ops.strategy = self

    @property
    def cross_device_ops(self):
        """The `tpu_scale.TorusAllReduce` that sums for this strategy, or None (TensorFlow's own)."""
        found = getattr(self.extended, "_cross_device_ops", None)
        return found if isinstance(found, torus.TorusAllReduce) else None

    @property
    def gradient_reduction(self):
        """`"torus"` or `"native"`: how the strategy sums, in `fit` and any other program
        (`settings.reduction`)."""
        return self.settings.reduction

    def run(self, fn, args=(), kwargs=None, options=None):
        """`tf.distribute.Strategy.run`; a replica whose batch holds no example (the last batch of
        a `predict` or `evaluate`) does not run a function that leaves it free to
        (`_workarounds.skip_empty_batches`), and a replica function that synchronizes the replicas
        inside a condition (Keras's own `gradient_accumulation_steps`) fails naming the fix."""
        # AutoGraph converts this method when a user's tf.function calls it; the work happens in
        # `_run`, which it leaves alone, with the caller's AutoGraph status for `fn`.
        return _run(self, fn, args, kwargs, options, autograph_ctx.control_status_ctx())

    def reduce(self, reduce_op, value, axis=None):
        """`tf.distribute.Strategy.reduce`; a mean of per-replica batches of different sizes is taken
        over the fullest replicas (`_workarounds.mean_of_partial_batches`)."""
        return _workarounds.mean_of_partial_batches(
            super().reduce, reduce_op, value, axis, self.experimental_local_results
        )


@tf.autograph.experimental.do_not_convert
def _run(strategy, fn, args, kwargs, options, status):
    """TensorFlow's `run`, with `fn` converted by AutoGraph as the caller's `status` says (as
    TensorFlow's own `run` does), not as this unconverted frame's."""
    keras_hook.check_jit_compile(strategy)
    converted = autograph.tf_convert(fn, status, convert_by_default=False)
    run = super(_MeshMixin, strategy).run
    try:
        # A replica with no example does not run `fn` when `fn` lets it (predict, evaluate).
        return _workarounds.skip_empty_batches(run, strategy, fn, converted, args, kwargs, options)
    except RuntimeError as e:
        if "called while defining a new graph" not in str(e):
            raise
        raise RuntimeError("A replica function synchronized the replicas (a gradient sum or a variable update) inside a condition or a nested tf.function, which a tf.distribute strategy cannot do. Keras's own gradient_accumulation_steps does this under every strategy (keras-team/keras#20582): wrap the optimizer, tpu_scale.DistributedOptimizer(keras.optimizers.SGD(..., gradient_accumulation_steps=k)), and it accumulates under the strategy.") from None


class AutoAlgorithm:
    """What `"auto"` means on one strategy: `torus.resolve_algorithm`'s rule for its hardware.

    The strategy's `TorusAllReduce` (and `torus.all_reduce_sum(..., algorithm="auto")`) calls it
    with the gradient's tensors; the choice is logged once per mesh, and kept in `choices`. The
    planner (`tpu_scale.plan`) prices the options for `hardware` where asked
    (`plan.sharding_advice`); training never imports it.

    Args:
      hardware: what `create_strategy` found: `kind` ("cpu", "gpu", "tpu"), `hosts`,
        `replicas_per_host`, and `gpu`, `mesh_shape` or `tpu_slice_name` where known (the
        arguments of `tpu_scale.plan.hardware_cluster`).
    """

    def __init__(self, hardware):
        self.hardware = dict(hardware)
        self.choices = {}

    def __call__(self, mesh, tensors):
        key = (mesh, tuple(tensors))
        if key not in self.choices:
            hosts = self.hardware.get("hosts", 1)
            kind = self.hardware.get("kind")
            size = sum(num_bytes for num_bytes, _ in tensors)
            algorithm = torus.resolve_algorithm("auto", mesh, kind, hosts, size)
            if algorithm not in self.choices.values():
                logger.info(
                    "tpu_scale: gradient sum 'auto' -> %s (%s, %d host(s), mesh %dx%d)",
                    algorithm,
                    kind,
                    hosts,
                    *mesh.shape,
                )
            self.choices[key] = algorithm
        return self.choices[key]


class MirroredStrategy(_MeshMixin, tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` that knows its replica mesh."""

    def __init__(self, devices=None, cross_device_ops=None):
        self._collective_key_base = _workarounds.next_collective_key_base()
        super().__init__(devices, cross_device_ops)
        # What TensorFlow's MultiWorkerMirroredStrategy resolves on one process: TensorFlow's own
        # TF_CONFIG resolver, made when the strategy is.
        self._one_process_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()

    @property
    def cluster_resolver(self):
        """The cluster resolver TensorFlow's `MultiWorkerMirroredStrategy` has on one process.

        Why: a script written for several workers (TensorFlow's multi-worker tutorial, a chief
        test) reads `strategy.cluster_resolver.task_type` and `.task_id` wherever it runs.
        TensorFlow's `MirroredStrategy` has no resolver (None); its multi-worker strategy, on one
        process, has a `TFConfigClusterResolver`: `task_type` and `task_id` None and an empty
        `cluster_spec()` without `TF_CONFIG`, worker 0 of a one-worker `TF_CONFIG`. This strategy
        answers the same, with the same resolver, so one script runs on one process and on many.
        """
        return self._one_process_resolver

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """`tf.distribute.Strategy.distribute_datasets_from_function`; with one replica on the
        host's CPU and no `options` given, the replica reads its pipeline directly.

        Why: the default input (`PER_WORKER`) fans every batch out to the replicas through a
        `MultiDeviceIterator`, and Keras starts a new iterator for each `evaluate` (inside `fit`,
        every epoch). With one replica on the CPU that pipeline already produces, there is
        nothing to fan out or copy: `PER_REPLICA` input without fetching to a device gives the
        same batches from a plain iterator, with no device iterator to start at each evaluation.
        """
        if options is None and _one_host_cpu_replica(self):
            options = tf.distribute.InputOptions(
                experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
                experimental_fetch_to_device=False,
            )
        return super().distribute_datasets_from_function(dataset_fn, options)


def _one_host_cpu_replica(strategy):
    """Whether `strategy` runs one replica, on a CPU of this host."""
    devices = strategy.extended.worker_devices
    return len(devices) == 1 and tf.DeviceSpec.from_string(devices[0]).device_type == "CPU"


class TPUStrategy(_MeshMixin, tf.distribute.TPUStrategy):
    """`tf.distribute.TPUStrategy` that knows its replica mesh (the slice's torus)."""


class MultiWorkerMirroredStrategy(_MeshMixin, tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` with a mesh, several CPUs per worker, and a Keras
    fix.

    Several logical CPUs per worker: `_workarounds.multi_worker_extended`. Keras 3 `model.fit` with
    more than one worker: `_workarounds.reduce_nested` (keras-team/keras#20585).
    """

    def __init__(
        self,
        cluster_resolver=None,
        communication_options=None,
        num_local_cpus=None,
        cross_device_ops=None,
    ):
        communication_options = (
            communication_options or tf.distribute.experimental.CommunicationOptions()
        )
        self._collective_key_base = _workarounds.next_collective_key_base()
        # TensorFlow's __init__ would build its own extended, with one CPU per worker.
        extended = _workarounds.multi_worker_extended(
            self, cluster_resolver, communication_options, num_local_cpus
        )
        if cross_device_ops is not None:
            # TensorFlow's strategy takes no cross-device ops: they go on its extended, with
            # TensorFlow's own collective ops as their fallback (tpu_scale.tf_seam lists the name).
            cross_device_ops.fallback = extended._cross_device_ops
            extended._cross_device_ops = cross_device_ops
        tf.distribute.Strategy.__init__(self, extended)

    def reduce(self, reduce_op, value, axis=None):
        return _workarounds.reduce_nested(
            super().reduce,
            reduce_op,
            value,
            axis,
            self.experimental_local_results,
            self.experimental_distribute_values_from_function,
        )


# --------------------------------------------------------------------------- detection


def _configure_cpu_replicas(num_cpu_replicas):
    """Makes `num_cpu_replicas` logical CPU devices exist, without starting TensorFlow's runtime."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    have = len(configured) if configured else 1
    if have < num_cpu_replicas:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_replicas
            )
        except RuntimeError as e:
            raise RuntimeError(f"Asked for {num_cpu_replicas} CPU replicas but TensorFlow already started with {have} logical CPU device(s), and devices cannot be added after start-up. Call tpu_scale.create_strategy(num_cpu_replicas={num_cpu_replicas}) before any other TensorFlow op runs.") from e


def _connect_tpu(tpu, resolver=None):
    try:
        resolver = resolver or tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except Exception as e:  # resolver, connection and initialization each fail in their own way
        raise RuntimeError(f"Could not reach the TPU {tpu!r} ({type(e).__name__}: {e}). Check the TPU name and that this VM can reach it, or call create_strategy() without a TPU to use GPUs or CPUs.") from e
    return resolver, topology


def _gpu_type():
    """The catalog name of the first GPU (`"a100"`, ...), or None."""
    for gpu in tf.config.list_physical_devices("GPU")[:1]:
        name = tf.config.experimental.get_device_details(gpu).get("device_name", "").lower()
        for known in ("v100", "a100", "h100"):
            if known in name:
                return known
    return None


def _tpu_slice_name(topology):
    """`"v3-32"`-style name of the slice, when the TPU generation can be read; else None."""
    try:
        kind = tf.config.list_logical_devices("TPU") and tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("TPU")[0]
        ).get("device_kind", "")
    except (IndexError, ValueError, RuntimeError):
        kind = ""
    generation = next((g for g in ("v2", "v3", "v4") if g in str(kind).lower()), None)
    cores = topology.num_tasks * topology.num_tpus_per_task
    return f"{generation}-{cores}" if generation else None


def create_strategy(
    tpu=None,
    *,
    cluster_resolver=None,
    num_cpu_replicas=None,
    mesh_shape=None,
    gradient_reduction="torus",
    gradient_algorithm=torus.DEFAULT_ALGORITHM,
    gradient_pack_bytes=torus.DEFAULT_PACK_BYTES,
    gradient_dtype=None,
    weight_update_sharding=False,
):
    """Finds the hardware and returns a `tf.distribute` strategy that knows its replica mesh.

    Args:
      tpu: a TPU name or address, or `"local"` on a TPU VM. Defaults to `TPU_NAME` from the
        environment; with neither, no TPU is used. A TPU that was asked for and cannot be reached is
        an error, never a silent fall-back to CPU.
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver` naming the cluster;
        default: found from the environment (`TF_CONFIG`, a Slurm step), in the order and with the
        errors of `tpu_scale.cluster`. The source is logged.
      num_cpu_replicas: virtual replicas on the CPU (when there is no GPU), or logical CPUs per
        worker of a multi-worker cluster (default there: `TPU_SCALE_CPUS_PER_WORKER`, which
        `python -m tpu_scale.launch --num_cpu_replicas` sets, else 1). Creating them must happen
        before TensorFlow starts; later calls with the same or a smaller count reuse the devices.
      mesh_shape: `(rows, cols)` for a single host's replicas; default `(1, n)`; `"squarest"`: the
        most nearly square grid of one host's replicas (2x4 for 8), and the natural mesh on a TPU
        or several workers, so one script runs anywhere. Multi-host meshes are workers x local
        replicas and TPU meshes follow the torus.
      gradient_reduction: `"torus"` (the 2-D reduction of `tpu_scale.torus.all_reduce`, as the strategy's
        cross-device ops, `tpu_scale.TorusAllReduce`: every sum of every program under it) or
        `"native"` (TensorFlow's own all-reduce).
      gradient_algorithm: with `"torus"`: one of `tpu_scale.torus.all_reduce.GRADIENT_ALGORITHMS`: `"auto"`,
        `"native"` or one of `tpu_scale.torus.all_reduce.ALGORITHMS`. `"auto"` is
        `tpu_scale.torus.all_reduce.resolve_algorithm`'s rule for this hardware (one host, or a gradient
        under 64 KiB: "flat"; several hosts: "torus_2d"; GPUs: "native"), logged once.
      gradient_pack_bytes: with `"torus"`: gradients are fused into buffers of about this many
        bytes; `None` or 0 fuses each dtype into one buffer.
      gradient_dtype: with `"torus"`: `"bfloat16"` carries the phases between hosts in bfloat16
        (half the bytes on the network; sums within a host stay float32); None keeps the gradients'
        dtype.
      weight_update_sharding: no longer a setting of the strategy: True fails, naming the optimizer
        wrapper that shards the update, `tpu_scale.DistributedOptimizer(optimizer,
        weight_update_sharding=True)`.

    Returns:
      A strategy with `.mesh` (`ReplicaMesh`), `.gradient_reduction` and `.cross_device_ops` (the
      `tpu_scale.TorusAllReduce` every sum of the strategy goes through, or None). A Keras
      optimizer's `gradient_accumulation_steps=k` trains under it wrapped in
      `tpu_scale.DistributedOptimizer`; unwrapped it fails while the step is traced, naming the
      wrapper. `compile(jit_compile=
      True)` on several CPU replicas fails before the first step, naming what works.
    """
    if weight_update_sharding:
        raise ValueError("Weight-update sharding is asked of the optimizer: create the strategy without weight_update_sharding and compile with tpu_scale.DistributedOptimizer(optimizer, weight_update_sharding=True) under strategy.scope().")
    keras_hook.check_keras()  # an unsupported Keras fails here, naming the range and the fix
    tf_seam.check_tensorflow()  # so does a TensorFlow without a private name the package uses
    settings = keras_hook.Settings(
        gradient_reduction, gradient_algorithm, gradient_pack_bytes, gradient_dtype
    )
    if num_cpu_replicas is not None and (
        not isinstance(num_cpu_replicas, int) or num_cpu_replicas < 1
    ):
        raise ValueError(f"num_cpu_replicas must be a positive int, got {num_cpu_replicas!r}.")

    # The torus sum is the strategies' cross-device ops: every sum they make goes through it.
    sum_ops = (
        torus.TorusAllReduce(
            algorithm=settings.algorithm,
            pack_bytes=settings.pack_bytes,
            gradient_dtype=settings.gradient_dtype,
        )
        if settings.torus_sum
        else None
    )
    found = cluster_lib.discover(tpu, cluster_resolver)
    squarest = isinstance(mesh_shape, str) and mesh_shape == "squarest"
    if squarest and (found.is_tpu or found.is_multi_worker):
        mesh_shape = None
    elif isinstance(mesh_shape, str) and not squarest:
        raise ValueError(f"mesh_shape={mesh_shape!r}: give (rows, cols) or 'squarest'.")
    if found.is_tpu:
        if mesh_shape is not None:
            raise ValueError(
                "mesh_shape cannot be set on a TPU: the mesh follows the slice's torus."
            )
        resolver, topology = _connect_tpu(found.tpu, found.resolver)
        device_assignment = tf.tpu.experimental.DeviceAssignment.build(
            topology, num_replicas=topology.num_tasks * topology.num_tpus_per_task
        )
        strategy = TPUStrategy(resolver, experimental_device_assignment=device_assignment)
        mesh = ReplicaMesh.from_topology(topology, device_assignment)
        kind = f"TPU {found.tpu or type(found.resolver).__name__}"
        hardware = dict(kind="tpu", tpu_slice_name=_tpu_slice_name(topology))
    elif found.is_multi_worker:
        if mesh_shape is not None:
            raise ValueError(f"mesh_shape cannot be set with several workers ({found.source}): the mesh is workers x local replicas.")
        num_cpu_replicas = num_cpu_replicas or cluster_lib.cpus_per_worker()
        if num_cpu_replicas and not tf.config.list_physical_devices("GPU"):
            _configure_cpu_replicas(num_cpu_replicas)
        strategy = MultiWorkerMirroredStrategy(
            found.resolver, num_local_cpus=num_cpu_replicas, cross_device_ops=sum_ops
        )
        local = len(strategy.extended.worker_devices)
        mesh = ReplicaMesh.for_workers(strategy.num_replicas_in_sync // local, local)
        kind = f"{mesh.shape[0]} workers x {local} {_workarounds.local_device_type(strategy)}"
        hardware = dict(
            kind=_workarounds.local_device_type(strategy).lower(),
            hosts=mesh.shape[0],
            replicas_per_host=local,
            gpu=_gpu_type(),
        )
    elif tf.config.list_physical_devices("GPU"):
        gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
        strategy = MirroredStrategy(gpus, cross_device_ops=sum_ops)
        mesh = ReplicaMesh.for_devices(len(gpus), parse_mesh_shape(None, len(gpus)) if squarest else mesh_shape)
        kind = f"{len(gpus)} GPU(s)"
        hardware = dict(kind="gpu", replicas_per_host=len(gpus), gpu=_gpu_type())
    else:
        if squarest:
            mesh_shape = parse_mesh_shape(None, num_cpu_replicas or 1)
        if num_cpu_replicas is None and mesh_shape is not None:
            num_cpu_replicas = int(mesh_shape[0]) * int(mesh_shape[1])
        _configure_cpu_replicas(num_cpu_replicas or 1)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][: num_cpu_replicas or 1]
        mesh = ReplicaMesh.for_devices(len(devices), mesh_shape)
        strategy = MirroredStrategy(devices, cross_device_ops=sum_ops)
        kind = f"{len(devices)} CPU replica(s)"
        hardware = dict(kind="cpu", replicas_per_host=len(devices), mesh_shape=mesh.shape)

    strategy._attach(mesh, settings)
    strategy.auto_algorithm = AutoAlgorithm(hardware)
    if found.is_tpu:
        # TPUStrategy sums with XLA's all-reduce, which the TPU runtime already runs in two phases
        # on the torus; grouped batch norm still uses the mesh's group assignments.
        reduction = "the TPU runtime's (XLA's all-reduce on the torus)"
    elif settings.torus_sum:
        # Which algorithm runs ("auto": the rule for this hardware, e.g. one flat sum on one host)
        # is logged at the first sum.
        reduction = f"tpu_scale.TorusAllReduce, algorithm {settings.algorithm!r}"
    else:
        reduction = "TensorFlow's own"
    logger.info(
        "tpu_scale: cluster from %s (%s): %s, %d replicas, mesh %dx%d, gradient sum %s",
        found.source,
        found.description,
        kind,
        strategy.num_replicas_in_sync,
        mesh.shape[0],
        mesh.shape[1],
        reduction,
    )
    return strategy
