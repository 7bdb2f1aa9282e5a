"""Workarounds for TensorFlow and Keras behaviour, in one place.

Each entry names the upstream report (or says none was found), the versions it was seen on, and how
to tell it can go. None of them changes anything outside the objects the package makes: the two
that change the whole process are opt-in, by name, through `tpu_scale.process`.

Opt-in (`tpu_scale.process.avoid_iterator_stalls()`):
  replica_iterators_untuned a distributed iterator's deletion waits on each replica's autotuning
  batch_scheduling          tf.data iterator deletion stalls up to 60 s per iterator on CPU hosts

Applied by the package's own strategy classes and functions, to their own objects:
  next_collective_key_base  every strategy in a process numbers its collective keys from 1
  multi_worker_extended     MultiWorkerMirroredStrategy uses one CPU device per worker
  reduce_nested             Keras 3 `fit` asks a multi-worker `reduce` for nested, scalar values
  mean_of_partial_batches   Keras 3 `evaluate` fails when replicas' first batches differ in size
                            (keras-team/keras#19246): the strategies' `reduce` takes the mean
                            over the fullest replicas
  local_device_type         which kind of device a multi-worker strategy's replicas run on
  convolution_drops_empty_batches  oneDNN convolutions give an empty batch the wrong shape on some
                            CPUs; the exact evaluation never hands a replica an empty batch
  skip_empty_batches        predict and evaluate of fewer examples than replicas leave replicas
                            empty: the strategies' `run` skips the model on them
  slurm_cluster_resolver    TensorFlow's SlurmClusterResolver fails on nodes without GPUs
  slurm_node_order          TensorFlow's SlurmClusterResolver sorts host names as strings (n10 < n9)
  tensor_seeds              a tensor seed fails after `tf.random.set_seed(0)`

One more lives in `keras_hook.py`, the only module that touches Keras's private API; it reads
Keras's source and says when Keras no longer has what it works around:

  accumulation_needs_phases Keras 3 `gradient_accumulation_steps` fails under a strategy
                            (keras-team/keras#20582: `merge_call` inside the update's `cond`);
                            `DistributedOptimizer` moves the condition to cross-replica context,
                            and the package's strategies name it when a plain optimizer fails
"""

import contextlib
import itertools
import os

# TensorFlow is imported inside the functions: the package's command-line tools that need none of
# it (the planner, the writer's argument parsing) import this module too.

# --------------------------------------------------------------------------- tf.data iterator
# deletion

_replica_iterators_untuned = False


def replica_iterators_untuned():
    """Builds the per-replica iterators of distributed datasets without tf.data autotuning.

    Why: deleting a tf.data iterator can stall for seconds (the mechanism is under
    `batch_scheduling`). A distributed dataset reads its source through one per-replica iterator
    for each local replica, and TensorFlow builds those with default options, whatever the
    dataset's own options say: eight replicas mean eight autotuning threads, and a deletion that
    waits for each in turn. These iterators only move finished batches into a fixed-size prefetch
    buffer, so autotuning has nothing to tune there. With their autotuning off, only the source
    iterator's own thread remains (the user's pipeline keeps its autotuned parallelism). Datasets
    placed on a TPU keep their defaults (`takes_dataset_options`).

    `python benchmarks/iterator_stall.py` measures how many deletions stall with it and without it
    (benchmarks/README.md).

    Upstream: no report found; seen with TF 2.21, whose `multi_device_iterator_ops.
    _create_device_dataset` applies no options. How to tell it can go: the `default` mode of
    `benchmarks/iterator_stall.py` shows no stalled deletion, or that function applies the source
    dataset's options.

    Opt-in, by name: `tpu_scale.process.avoid_iterator_stalls()`; once per process, idempotent.
    It replaces TensorFlow's private `multi_device_iterator_ops._create_device_dataset`.
    """
    global _replica_iterators_untuned
    if _replica_iterators_untuned:
        return
    import tensorflow as tf

    from tpu_scale.tf_seam import multi_device_iterator_ops

    build = multi_device_iterator_ops._create_device_dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    # Nothing to rewrite in a generator and a prefetch; this also drops TensorFlow's warning that
    # the generator "will not be optimized", logged once per process.
    options.experimental_optimization.apply_default_optimizations = False

    def build_untuned(*args, **kwargs):
        dataset = build(*args, **kwargs)
        if not takes_dataset_options(dataset._variant_tensor.device):
            return dataset
        return dataset.with_options(options)

    multi_device_iterator_ops._create_device_dataset = build_untuned
    _replica_iterators_untuned = True


def takes_dataset_options(device_name):
    """Whether a dataset placed on `device_name` can take options: TensorFlow registers the
    `OptionsDataset` kernel for CPU and GPU devices only (a per-replica dataset on a TPU keeps its
    defaults)."""
    import tensorflow as tf

    return tf.DeviceSpec.from_string(device_name or "").device_type != "TPU"


_batch_scheduling_applied = False


def batch_scheduling(enabled=True):
    """Puts every thread of this process, and those it starts later, under SCHED_BATCH (Linux).

    Why: deleting a tf.data iterator can stall for seconds. Each iterator has an autotuning thread
    (`Model::OptimizeLoop`) that sleeps between optimizations for a period that doubles up to 60 s.
    The deletion cancels the iterator, and the cancellation callback wakes that thread, but
    TensorFlow's `CancellationManager` sets its "cancelled" flag only after the callbacks have run.
    A thread that wakes first sees no cancellation and sleeps for the rest of its period, and the
    deletion waits for it. So an iterator that lived for T seconds can stall for about T. A
    distributed dataset holds one such iterator per replica besides its source iterator
    (`replica_iterators_untuned` removes the per-replica ones' threads). Keras 3.15 drops the
    validation iterator at every `evaluate` (inside `fit` too) and the training iterator at the
    end of `fit`, so a run's epochs now and then stall for many times their length.

    Under SCHED_BATCH a woken thread does not preempt the deleting one, so the race is lost less
    often; with `replica_iterators_untuned` (`tpu_scale.process.avoid_iterator_stalls()` applies
    both) few deletions stall (figures: benchmarks/README.md). Threads that already run are
    switched too. Opt-in, by name: the package never applies it by itself.

    Upstream: no report found; seen with TF 2.16 to 2.21 on 2-core Linux hosts with 8 CPU replicas.
    How to tell it can go: `python benchmarks/iterator_stall.py` shows no stalled deletion in its
    `default` mode.

    A no-op where the policy does not exist (macOS, Windows) or is not allowed.

    Args:
      enabled: False switches every thread back to the default policy (SCHED_OTHER), e.g. around a
        measurement of step times.
    """
    global _batch_scheduling_applied
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")):
        return
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    policy = os.SCHED_BATCH if enabled else os.SCHED_OTHER
    for thread in threads:
        try:
            os.sched_setscheduler(thread, policy, os.sched_param(0))
        except OSError:
            pass  # the thread has ended, or the policy is not allowed here
    _batch_scheduling_applied = enabled


def batch_scheduling_applied():
    """True once `batch_scheduling()` has switched this process's threads."""
    return _batch_scheduling_applied


# --------------------------------------------------------------------------- collective keys

_strategies_created = itertools.count(1)


def next_collective_key_base():
    """A private range of collective group keys for each new strategy in this process.

    Why: TensorFlow numbers every strategy's group keys from 1: a second strategy over other devices
    (or the same devices in another order) then reuses key 1 for a different group and aborts the
    process's collective runtime ("joining a group with size 2, but that group has size 3"). Workers
    create their strategies in the same order, so the k-th strategy gets the same range on every
    worker.

    Upstream: tensorflow/tensorflow#61314 (a maintainer: strategies created in sequence "share the
    same collective key"); seen with TF 2.13 to 2.21. How to tell it can go:
    `tests/test_strategy.py::test_strategies_over_different_devices_coexist` passes with every
    strategy given key base 0.
    """
    return next(_strategies_created) * 100_000


# --------------------------------------------------------------------------- several CPUs per
# worker


_multi_worker_extended = None


def multi_worker_extended(
    container_strategy, cluster_resolver, communication_options, num_local_cpus
):
    """A multi-worker extended that can give each worker several logical CPU devices.

    Why: TensorFlow's `CollectiveAllReduceExtended._initialize_local_devices` uses exactly one CPU
    per worker when there is no GPU; virtual replicas let a multi-host mesh be built and tested on
    CPUs. The strategy class builds this extended itself instead of calling TensorFlow's `__init__`,
    which would build its own.

    Upstream: a design limit, not a reported bug; seen with TF 2.16 to 2.21. How to tell it can go:
    `tf.distribute.MultiWorkerMirroredStrategy` gains an argument for local CPU devices (it has none
    in 2.21).
    """
    global _multi_worker_extended
    if _multi_worker_extended is None:
        from tpu_scale.tf_seam import collective_all_reduce_strategy as collective_lib

        class MultiWorkerExtended(collective_lib.CollectiveAllReduceExtended):
            def __init__(self, container, resolver, options, local_cpus):
                self._num_local_cpus = local_cpus
                super().__init__(container, resolver, options)

            def _initialize_local_devices(self, cluster_resolver, worker_device):
                devices, device_type = super()._initialize_local_devices(
                    cluster_resolver, worker_device
                )
                if device_type == "CPU" and self._num_local_cpus:
                    devices = tuple(
                        f"{worker_device}/device:CPU:{i}" for i in range(self._num_local_cpus)
                    )
                return devices, device_type

        _multi_worker_extended = MultiWorkerExtended
    return _multi_worker_extended(
        container_strategy, cluster_resolver, communication_options, num_local_cpus
    )


def local_device_type(strategy):
    """The kind of device ("CPU", "GPU", "TPU") of `strategy`'s local replicas, from their names."""
    import tensorflow as tf

    name = strategy.extended.worker_devices[0]
    return tf.DeviceSpec.from_string(name).device_type or "CPU"


# --------------------------------------------------------------------------- Keras fit, several
# workers


def reduce_nested(reduce_one, reduce_op, value, axis, local_results, distribute_values):
    """`Strategy.reduce` over nested values, reducing per-replica scalars across replicas.

    Why: Keras 3 `model.fit` breaks under `MultiWorkerMirroredStrategy` with more than one worker:
    while building the model it asks `reduce` for the mean of a nested `(x, y)` batch ("Attempt to
    convert a value (PerReplica...) to a Tensor"), and it reduces scalar metrics along axis 0
    ("Invalid reduction dimension 0").

    Upstream: keras-team/keras#20585; seen with Keras 3.6 to 3.15 on TF 2.18 to 2.21. How to tell it
    can go: `tests/test_strategy.py::test_two_workers_keras_fit_agree` passes with TensorFlow's own
    `reduce`.

    Args:
      reduce_one: TensorFlow's `reduce(reduce_op, value, axis)` for one value.
      reduce_op: as for `Strategy.reduce`.
      value: a (nested) per-replica value.
      axis: as for `Strategy.reduce`.
      local_results: the strategy's `experimental_local_results`.
      distribute_values: the strategy's `experimental_distribute_values_from_function`.

    Returns:
      The reduced (nested) value.
    """

    import tensorflow as tf

    def one(v):
        if not hasattr(local_results(v)[0], "shape"):
            # Keras 3.12 also hands over per-replica Python numbers: made tensors, one per replica.
            numbers = iter(local_results(v))
            v = distribute_values(lambda _: tf.constant(next(numbers)))
        if axis is not None and local_results(v)[0].shape.rank == 0:
            # A scalar per replica has no axis 0: its mean over examples is its mean over replicas.
            return reduce_one(reduce_op, v, None)
        return reduce_one(reduce_op, v, axis)

    return tf.nest.map_structure(one, value, expand_composites=False)


# --------------------------------------------------------------------------- Keras's first batch


def mean_of_partial_batches(reduce_one, reduce_op, value, axis, local_results):
    """`Strategy.reduce`, with the mean of per-replica values of different shapes taken over the
    replicas that hold the largest.

    Why: before training, evaluating or predicting under a strategy, Keras 3 takes the first
    distributed batch and asks the strategy for its mean over the replicas
    (`strategy.reduce("MEAN", batch, axis=None)`), only to learn the input shapes. When the data
    end within the first global batch (a validation set smaller than the global batch), the
    replicas' batches differ in size, some empty, and TensorFlow's mean fails: "Inputs to operation
    AddN of type AddN must have the same size and shape". Values of different shapes have no
    element-wise mean: here it is the mean of the replicas whose value is largest (a full replica
    batch), so Keras builds from a full batch's shape. Every other reduction is TensorFlow's, and
    so is this one wherever TensorFlow's would not fail (values of one shape, `axis` given, SUM).

    Upstream: keras-team/keras#19246; seen with Keras 3.12.4, 3.15.1 and 3.16.0.dev2026102704 on
    TF 2.21. It acts only where TensorFlow's reduce would fail, so it needs no switch; how to tell
    it can go: `tests/test_workarounds.py::test_evaluate_a_validation_set_smaller_than_the_batch`
    passes under `tf.distribute.MirroredStrategy`.

    Args:
      reduce_one: TensorFlow's `reduce(reduce_op, value, axis)`.
      reduce_op: as for `Strategy.reduce`.
      value: a (nested) per-replica value.
      axis: as for `Strategy.reduce`.
      local_results: the strategy's `experimental_local_results`.
    """
    import tensorflow as tf

    op = tf.distribute.ReduceOp(reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
    if axis is not None or op != tf.distribute.ReduceOp.MEAN:
        return reduce_one(reduce_op, value, axis)

    def shapes(v):
        parts = local_results(v) if isinstance(v, tf.distribute.DistributedValues) else ()
        return {tuple(p.shape) for p in parts if isinstance(p, tf.Tensor)}

    flat = tf.nest.flatten(value, expand_composites=False)
    if all(len(shapes(v)) < 2 for v in flat):
        return reduce_one(reduce_op, value, axis)

    def one(v):
        if len(shapes(v)) < 2:
            return reduce_one(reduce_op, v, axis)
        parts = local_results(v)
        largest = max(parts, key=lambda p: p.shape.num_elements() or 0)
        fullest = [p for p in parts if p.shape == largest.shape]
        return tf.add_n(fullest) / len(fullest)

    return tf.nest.map_structure(one, value, expand_composites=False)


# --------------------------------------------------------------------------- empty batches


def convolution_drops_empty_batches():
    """Whether this process's CPU convolution gives an empty batch the wrong output shape.

    Why it matters: an evaluation or prediction pass whose last global batch is partial can hand
    some replicas an empty batch (TensorFlow splits a partial batch that way). On some CPUs,
    TensorFlow's oneDNN convolution kernels (`Conv2D` and the 1-D, 3-D, depthwise and separable
    convolutions built on them) return a tensor of the *input's* shape for an empty batch:
    `tf.nn.conv2d(tf.zeros([0, 64, 64, 3]), tf.zeros([3, 3, 3, 16]), 2, "SAME")` has shape
    `(0, 64, 64, 3)`, not `(0, 32, 32, 16)`, and the next layer fails ("Incompatible shapes").
    With `TF_ENABLE_ONEDNN_OPTS=0` the shape is right.

    How the package avoids it, on every CPU: its exact evaluation (`data.exact_evaluation`) pads
    the last global batch with zero-weight examples, so every replica's batch is full, and
    training batches are whole (`drop_remainder=True`). Keras's layers are left as they are. A
    dataset of the user's own whose last batch is smaller than the number of replicas, in
    `predict` or `evaluate`, runs the model only on the replicas that hold examples
    (`skip_empty_batches`); a training step runs on every replica and meets the fault on such a
    CPU, as it does under TensorFlow's own `MirroredStrategy`.

    Upstream: no report found; seen with TF 2.21.0 (oneDNN on) on AMD EPYC and Intel Xeon CPUs
    with AVX-512 (the same TF on another x86-64 CPU gave the right shape). How to tell it can go:
    this function is False on such a CPU
    (`tests/test_workarounds.py::test_convolution_empty_batch_fault_is_detected`).

    Runs one tiny convolution eagerly on the CPU (the runtime must be initialized: call it after
    the devices are configured). True where the kernel hands back its input's shape.
    """
    import tensorflow as tf

    with tf.init_scope(), tf.device("/CPU:0"):
        output = tf.nn.conv2d(tf.zeros([0, 2, 2, 1]), tf.zeros([1, 1, 1, 2]), 1, "VALID")
    return tuple(output.shape) != (0, 2, 2, 2)


_synchronizing = None  # weakref.WeakSet of the replica functions found to synchronize


class _Synchronizes(Exception):
    """A replica function that no replica may skip: it holds collective ops."""


def skip_empty_batches(run, strategy, fn, converted, args, kwargs, options):
    """`Strategy.run`, where a replica whose batch holds no example does not run `fn`.

    Why: the last batch of a `predict` or `evaluate` (a numpy array, a dataset without
    `drop_remainder`) is split over the replicas by TensorFlow, and a batch smaller than the
    replica count leaves replicas with no example: one image on 4 replicas is 1, 0, 0, 0 rows,
    5 images are 2, 2, 1, 0. On such a CPU the convolution of an empty batch has the wrong shape
    (`convolution_drops_empty_batches`) and the model fails ("Shape must be rank 1 but is rank 2
    ... BiasAdd"), under TensorFlow's own `MirroredStrategy` too. A replica with an empty batch
    now does not run the replica function: its outputs are empty (no rows; zero for a scalar) and
    nothing the function would have updated changes. Predictions have one row per example and
    every metric counts each example once, as on one device, with no padding to remove.

    A replica may skip only a function that does not synchronize the replicas (a training step's
    gradient sum, a collective): the others would wait for it. Such a function is found when it
    is traced (TensorFlow refuses a merge call inside the condition; a collective or NCCL op is
    seen in it), and it is traced again as TensorFlow traces it, and so from then on. On one
    process only: across workers such a first trace would leave them waiting on each other.

    Upstream: the convolution's: none found (see `convolution_drops_empty_batches`); TensorFlow's
    split that leaves replicas empty is by design. Seen with TF 2.21.0 and Keras 3.15.1. How to
    tell it can go: `tests/test_strategy.py::test_predict_and_evaluate_any_number_of_examples_as_
    on_one_device` passes under `tf.distribute.MirroredStrategy` on such a CPU.

    Args:
      run: TensorFlow's `run(fn, args, kwargs, options)` of the strategy.
      strategy: the strategy (for its replicas' inputs).
      fn: the replica function as the caller gave it (what is remembered to synchronize).
      converted: `fn` as it runs (converted by AutoGraph as the caller's status says).
      args, kwargs, options: as for `Strategy.run`.
    """
    global _synchronizing
    import weakref

    if _synchronizing is None:
        _synchronizing = weakref.WeakSet()
    code = getattr(fn, "__func__", fn)  # a bound method's function: its code decides
    if _may_skip(strategy, code, args, kwargs):
        try:
            return run(_skipping_empty(converted), args, kwargs, options)
        except _Synchronizes:
            pass
        except RuntimeError as e:
            if "called while defining a new graph" not in str(e):
                raise
        try:
            _synchronizing.add(code)
        except TypeError:  # not weakly referable: found again at each trace
            pass
    return run(converted, args, kwargs, options)


def _may_skip(strategy, code, args, kwargs):
    """Whether a replica's batch may be empty and the function is not known to synchronize."""
    import tensorflow as tf

    if tf.executing_eagerly() or isinstance(strategy, tf.distribute.TPUStrategy):
        return False  # eagerly: TensorFlow's run; a TPU's shapes are static
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # Across workers a training step's first trace inside the condition builds the package's
        # collective ops (a grouped batch norm's) before the merge call that gives it away, and
        # the workers then wait on each other for good: left to TensorFlow's run.
        return False
    try:
        if code in _synchronizing:
            return False
    except TypeError:
        pass
    for value in tf.nest.flatten((args, kwargs or {})):
        if isinstance(value, tf.distribute.DistributedValues):
            parts = strategy.experimental_local_results(value)
        elif isinstance(value, tf.Tensor):
            parts = [value]
        else:
            continue
        if all(isinstance(p, tf.Tensor) and p.shape.rank for p in parts):
            return any(not p.shape[0] for p in parts)  # unknown (None) or 0 rows
    return False


def _leading_batch(args, kwargs):
    """The first tensor of a replica's inputs with a batch dimension, or None."""
    import tensorflow as tf

    for value in tf.nest.flatten((args, kwargs or {})):
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return value
    return None


def _skipping_empty(fn):
    """`fn`, run only when the replica's batch holds at least one example."""
    import tensorflow as tf

    def replica_fn(*args, **kwargs):
        batch = _leading_batch(args, kwargs)
        if batch is None or batch.shape[0]:  # examples known to be there
            return fn(*args, **kwargs)
        traced = {}

        def run():
            traced["graph"] = tf.compat.v1.get_default_graph()
            traced["outputs"] = fn(*args, **kwargs)
            return traced["outputs"]

        def skip():
            # Traced after `run`: its outputs' structure and its ops are known.
            if _holds_collectives(traced["graph"]):
                raise _Synchronizes()
            return tf.nest.map_structure(_empty_like, traced["outputs"])

        return tf.cond(tf.shape(batch)[0] > 0, run, skip)

    return replica_fn


def _holds_collectives(graph):
    """Whether `graph` or a function it calls holds a collective or NCCL op."""
    definition = graph.as_graph_def()
    nodes = list(definition.node)
    for function in definition.library.function:
        nodes.extend(function.node_def)
    return any(node.op.startswith(("Collective", "Nccl")) for node in nodes)


def _empty_like(value):
    """What a replica with no example gives for `value`: no rows, or zero for a scalar."""
    import tensorflow as tf

    if not isinstance(value, tf.Tensor):
        if tf.is_tensor(value):  # sparse, ragged: no empty form here; run as TensorFlow does
            raise _Synchronizes()
        return value
    if value.shape.rank is None:
        raise _Synchronizes()
    if value.shape.rank == 0:
        return tf.zeros([], value.dtype)
    return tf.zeros([0] + [d or 0 for d in value.shape[1:]], value.dtype)


# --------------------------------------------------------------------------- Slurm, CPU-only
# nodes

_slurm_resolver_class = None


def slurm_cluster_resolver(port_base=8888, gpus_per_node=None, gpus_per_task=None):
    """TensorFlow's `SlurmClusterResolver` for the current step, on GPU and CPU-only nodes.

    Why: on a node without GPUs TensorFlow's resolver cannot build a cluster. Left to count the
    GPUs itself it runs `nvidia-smi`, which a CPU node does not have (`FileNotFoundError`); told
    `gpus_per_node=0`, its `cluster_spec()` pairs each task with a GPU slot through
    `range(0, gpus_per_node, gpus_per_task)` and fails ("range() arg 3 must not be zero"). Here
    the count is 0 where `CUDA_VISIBLE_DEVICES` is empty, or unset without `nvidia-smi`, and a node
    without GPUs gets TensorFlow's own task layout (hosts sorted, ports from `port_base`) with no
    GPU per task and `CUDA_VISIBLE_DEVICES` left alone. With GPUs, TensorFlow's resolver runs
    unchanged.

    Upstream: tensorflow/tensorflow#56894 ("SlurmClusterResolver cannot be configured to use no
    GPUs", closed without a fix); seen with TF 2.9 to 2.21. How to tell it can go:
    `tests/test_workarounds.py::test_slurm_cluster_resolver_on_cpu_nodes` fails at its check that
    TensorFlow's own resolver fails there.

    Args:
      port_base: the first worker port on each node.
      gpus_per_node: GPUs on each node; None counts them as TensorFlow does, 0 where it cannot.
      gpus_per_task: GPUs per task; None shares a node's GPUs among its tasks.

    Returns:
      A `tf.distribute.cluster_resolver.SlurmClusterResolver`.
    """
    global _slurm_resolver_class
    import shutil

    import tensorflow as tf

    if _slurm_resolver_class is None:

        class SlurmClusterResolver(tf.distribute.cluster_resolver.SlurmClusterResolver):
            def cluster_spec(self):
                return slurm_node_order(self, self._sorted_cluster_spec())

            def _sorted_cluster_spec(self):
                if self._gpus_per_task:
                    return super().cluster_spec()
                # One pretend GPU slot per task lets TensorFlow's loop lay out every task; the
                # slots are never applied (auto_set_gpu off) and the count stays 0.
                tasks = max(self._task_configuration.values())
                saved = self._gpus_per_node, self._gpus_per_task, self._auto_set_gpu
                self._gpus_per_node, self._gpus_per_task, self._auto_set_gpu = tasks, 1, False
                try:
                    return super().cluster_spec()
                finally:
                    self._gpus_per_node, self._gpus_per_task, self._auto_set_gpu = saved

        _slurm_resolver_class = SlurmClusterResolver
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus_per_node is None and not visible and (visible == "" or not shutil.which("nvidia-smi")):
        gpus_per_node = 0  # TensorFlow would count "" as one GPU, and run a missing nvidia-smi
    return _slurm_resolver_class(
        port_base=port_base, gpus_per_node=gpus_per_node, gpus_per_task=gpus_per_task
    )


def slurm_node_order(resolver, spec):
    """`resolver`'s cluster spec with its tasks in Slurm's order: task i is `SLURM_PROCID` i.

    Why: Slurm numbers a step's tasks node by node in the order of its node list
    (`SLURM_STEP_NODELIST`, e.g. `n[9-10]`: tasks 0.. on n9, then n10; the default block
    distribution), and TensorFlow's resolver makes `SLURM_PROCID` the task index. But its
    `cluster_spec()` lays the tasks out over the hosts sorted as strings: n10 before n9, and
    `n[1-2,10]` as n1, n10, n2. Task 0, on n9, is then given n10's address: two workers claim the
    same address, the cluster never forms, and the GPUs it gives a task are another task's. Here
    the tasks keep TensorFlow's ports and GPUs per node (port base + k and the k-th GPUs for a
    node's k-th task) but follow the node list's order, in every job of the spec, and
    `CUDA_VISIBLE_DEVICES` is set from that order where TensorFlow sets it. Where TensorFlow's
    order already is the node list's (names of one width, one node, or a fixed TensorFlow), the
    spec is returned as TensorFlow made it.

    Upstream: no report found; seen with TF 2.21 (`sorted(self._task_configuration.items())` in
    `SlurmClusterResolver.cluster_spec`). How to tell it can go:
    `tests/test_cluster.py::test_tensorflows_slurm_resolver_sorts_hosts_as_strings` fails at its
    check that TensorFlow's own resolver puts n10 first.

    Args:
      resolver: a `SlurmClusterResolver` whose `cluster_spec()` just returned `spec`.
      spec: that `tf.train.ClusterSpec`.

    Returns:
      A `tf.train.ClusterSpec`.
    """
    import tensorflow as tf

    config = resolver._task_configuration  # {host: tasks}, in the node list's order
    port = resolver._port_base
    ordered = [f"{host}:{port + k}" for host, tasks in config.items() for k in range(tasks)]
    jobs = sorted(resolver._jobs.items())  # TensorFlow's order of jobs, its tasks from rank 0
    theirs = [address for job, _ in jobs for address in spec.as_dict().get(job, [])]
    if theirs == ordered:
        return spec
    gpus = dict(zip(theirs, resolver._gpu_allocation))
    resolver._gpu_allocation = [gpus[address] for address in ordered]
    start = 0
    for job, tasks in jobs:
        resolver._cluster_allocation[job] = ordered[start : start + tasks]
        start += tasks
    if resolver._auto_set_gpu and resolver._gpus_per_task:
        os.environ["CUDA_VISIBLE_DEVICES"] = resolver._gpu_allocation[resolver._rank]
    return tf.train.ClusterSpec(resolver._cluster_allocation)


# --------------------------------------------------------------------------- tensor seeds


@contextlib.contextmanager
def tensor_seeds():
    """Lets random ops built inside take a tensor seed when the global seed is 0.

    Why: TensorFlow turns an op's seed into a pair with `random_seed.get_seed`, which then tests
    `seeds == (0, 0)` in Python. With a global seed of 0 (`tf.random.set_seed(0)`,
    `keras.utils.set_random_seed(0)`, or any multiple of 2**31 - 1) the comparison reaches the op
    seed; a tensor there (the input pipeline's `dataset.shuffle(..., seed=seed + epoch)` inside
    `flat_map`) fails with "OperatorNotAllowedInGraphError: Using a symbolic `tf.Tensor` as a
    Python `bool` is not allowed". Inside this context, in a graph whose seed is 0 (modulo
    2**31 - 1), the graph's seed reads as unset while the ops are built: each op then takes
    TensorFlow's default graph seed and its own seed, as it would with no global seed. Elsewhere
    it changes nothing.

    Upstream: tensorflow/tensorflow#17284 (tensor seeds under a graph seed of 0; closed, and the
    Python test still compares the tensor); seen with TF 2.21. How to tell it can go:
    `tests/test_workarounds.py::test_tensor_seeds_after_a_global_seed_of_zero` fails at its check
    that TensorFlow's own shuffle still raises.
    """
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    seed = graph.seed
    # TensorFlow reduces seeds modulo 2**31 - 1 before the comparison.
    if tf.executing_eagerly() or seed is None or seed % (2**31 - 1):
        yield
        return
    graph.seed = None
    try:
        yield
    finally:
        graph.seed = seed
