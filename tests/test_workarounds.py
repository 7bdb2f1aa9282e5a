"""Tests for `tpu_scale._workarounds`: each does what it claims, and the opt-in ones
(`tpu_scale.process`) apply only when asked for."""

import functools
import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale import _workarounds
from tpu_scale._workarounds import batch_scheduling

LINUX_POLICIES = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies only"
)


def _policies():
    result = set()
    for thread in os.listdir("/proc/self/task"):
        try:
            result.add(os.sched_getscheduler(int(thread)))
        except OSError:
            pass  # ended meanwhile
    return result


@LINUX_POLICIES
def test_batch_scheduling_switches_every_running_thread():
    try:
        batch_scheduling(enabled=False)
        assert _policies() == {os.SCHED_OTHER}
    finally:
        batch_scheduling()
    assert _policies() == {os.SCHED_BATCH}


@LINUX_POLICIES
def test_iterator_stalls_are_avoided_only_when_asked_for_by_name():
    batch_scheduling(enabled=False)
    tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")
    assert _policies() == {os.SCHED_OTHER}
    try:
        tpu_scale.process.avoid_iterator_stalls()
        assert _policies() == {os.SCHED_BATCH} and _workarounds.batch_scheduling_applied()
    finally:
        batch_scheduling(enabled=False)


def test_each_strategy_gets_its_own_key_range():
    first, second = _workarounds.next_collective_key_base(), _workarounds.next_collective_key_base()
    assert second - first == 100_000 and first >= 100_000


def test_local_device_type_from_device_names(strategy):
    assert _workarounds.local_device_type(strategy) == "CPU"


def test_reduce_nested_maps_structures_and_reduces_scalars_over_replicas(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(float(ctx.replica_id_in_sync_group)), tf.fill([2], 1.0))
    )
    calls = []

    def reduce_one(op, value, axis):
        calls.append(axis)
        return strategy.reduce(op, value, axis=axis)

    reduce = functools.partial(
        _workarounds.reduce_nested,
        reduce_one,
        tf.distribute.ReduceOp.MEAN,
        local_results=strategy.experimental_local_results,
        distribute_values=strategy.experimental_distribute_values_from_function,
    )
    mean, vector = reduce(values, 0)
    assert float(mean) == pytest.approx(3.5) and float(vector) == pytest.approx(1.0)
    assert calls == [None, 0]  # the scalar is reduced over replicas, the vector along its axis
    # Per-replica Python numbers (Keras 3.12's logs) are reduced as tensors.
    numbers = strategy.experimental_distribute_values_from_function(
        lambda ctx: float(ctx.replica_id_in_sync_group)
    )
    assert float(reduce(numbers, 0)) == pytest.approx(3.5)


def test_avoid_iterator_stalls_builds_replica_iterators_without_autotuning():
    from tensorflow.python.data.ops import multi_device_iterator_ops

    strategy = tpu_scale.create_strategy(num_cpu_replicas=4, gradient_reduction="native")
    _workarounds.replica_iterators_untuned()  # avoid_iterator_stalls' half for tf.data
    devices = strategy.extended.worker_devices
    iterator = multi_device_iterator_ops.OwnedMultiDeviceIterator(tf.data.Dataset.range(8), devices)
    for replica in iterator._device_iterators:
        assert replica._dataset.options().autotune.enabled is False
    # The distributed batches are still the right ones, replica by replica, epoch after epoch.
    data = strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(8))
    for _ in range(2):
        local = strategy.experimental_local_results
        batches = [[t.numpy().tolist() for t in local(batch)] for batch in data]
        assert batches == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [12, 13], [14, 15]]]


def test_per_replica_datasets_take_options_on_cpus_and_gpus_only():
    assert _workarounds.takes_dataset_options("/job:localhost/replica:0/task:0/device:CPU:3")
    assert _workarounds.takes_dataset_options("/job:worker/replica:0/task:1/device:GPU:0")
    assert _workarounds.takes_dataset_options("")  # no device scope: the host's CPU
    assert not _workarounds.takes_dataset_options("/job:worker/replica:0/task:0/device:TPU:7")


def test_convolution_empty_batch_fault_is_detected():
    # Where the detector finds the fault, Keras's own Conv2D fails on an empty batch (its bias
    # meets the input's shape); where it does not, it gives the right shape. When it turns False on a CPU that had the fault,
    # TensorFlow has fixed its kernel.
    import keras

    layer = keras.layers.Conv2D(4, 3, strides=2, padding="same")
    images = tf.random.stateless_uniform([2, 12, 12, 3], [0, 1])
    right = (0, 6, 6, 4)
    with tf.device("/CPU:0"):
        try:
            shape = tuple(layer(images[:0]).shape)
        except tf.errors.InvalidArgumentError:  # the bias added to the wrong shape
            shape = None
    assert (shape != right) == _workarounds.convolution_drops_empty_batches(), shape


class _Validation:
    """An evaluation input of its own: `(images, labels)` batches of the per-replica size."""

    is_training = False

    def __init__(self, images, labels, global_batch_size):
        self.images, self.labels, self.global_batch_size = images, labels, global_batch_size

    def dataset(self, context):
        batch = context.get_per_replica_batch_size(self.global_batch_size)
        return tf.data.Dataset.from_tensor_slices((self.images, self.labels)).batch(batch)


def test_exact_evaluation_of_convolutions_on_any_cpu(strategy):
    """14 examples, a global batch of 128 on 8 replicas: without padding 7 replicas would get an
    empty batch, which some CPUs' convolutions mishandle. The exact evaluation fills every replica's
    batch with zero-weight examples and counts each example once, on every CPU, with Keras's
    layers as they are."""
    import keras

    from tpu_scale import data

    images = tf.random.stateless_uniform([14, 12, 12, 3], [2, 3])
    labels = tf.constant([i % 3 for i in range(14)])
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input([12, 12, 3]),
                keras.layers.Conv2D(4, 3, strides=2, padding="same"),
                keras.layers.DepthwiseConv2D(3),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
    evaluation = data.exact_evaluation(_Validation(images, labels, 128), strategy, 14)
    result = model.evaluate(evaluation.dataset, steps=evaluation.steps, return_dict=True, verbose=0)
    expected = np.mean(np.argmax(model(images).numpy(), -1) == labels.numpy())
    assert result["accuracy"] == pytest.approx(expected)


def _evaluate_fewer_examples_than_replicas(strategy):
    """14 examples, a global batch of 128 on 8 replicas: replica 0 gets them all, the others empty
    batches. Returns evaluate's accuracy and the model's own outside the strategy."""
    import keras

    images = tf.random.stateless_uniform([14, 12, 12, 3], [2, 3])
    labels = tf.constant([i % 3 for i in range(14)])
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input([12, 12, 3]),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    def dataset(context):
        batch = context.get_per_replica_batch_size(128)
        return (
            tf.data.Dataset.from_tensor_slices((images, labels))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .batch(batch)
        )

    result = model.evaluate(
        strategy.distribute_datasets_from_function(dataset), return_dict=True, verbose=0
    )
    return result["accuracy"], np.mean(np.argmax(model(images).numpy(), -1) == labels.numpy())


def test_evaluate_a_validation_set_smaller_than_the_batch(strategy):
    """evaluate counts each example once and equals the model outside the strategy (a model
    without convolutions: see `test_exact_evaluation_of_convolutions_on_any_cpu`); the strategy's
    `reduce` takes Keras's first-batch mean over the fullest replicas (keras-team/keras#19246)."""
    accuracy, expected = _evaluate_fewer_examples_than_replicas(strategy)
    assert accuracy == pytest.approx(expected)


def test_tensorflows_own_strategy_still_fails_on_that_first_batch(cpu_devices):
    # When this stops failing, Keras or TensorFlow fixed keras-team/keras#19246, and
    # `_workarounds.mean_of_partial_batches` can go.
    plain = tf.distribute.MirroredStrategy(cpu_devices, tf.distribute.ReductionToOneDevice())
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="same size and shape|shape"):
        _evaluate_fewer_examples_than_replicas(plain)


def test_the_partial_batch_mean_is_tensorflows_elsewhere(strategy):
    """Only values of different shapes take the fullest replicas' mean; every other reduction is
    TensorFlow's own."""
    ragged = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([2 if ctx.replica_id_in_sync_group < 3 else 1, 2])
        * tf.cast(ctx.replica_id_in_sync_group, tf.float32)
    )
    mean = strategy.reduce("MEAN", {"x": ragged}, axis=None)["x"]
    np.testing.assert_allclose(mean.numpy(), np.full([2, 2], 1.0))  # replicas 0, 1 and 2
    even = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([2], tf.cast(ctx.replica_id_in_sync_group, tf.float32))
    )
    np.testing.assert_allclose(strategy.reduce("MEAN", even, axis=None).numpy(), [3.5, 3.5])
    np.testing.assert_allclose(strategy.reduce("SUM", even, axis=None).numpy(), [28.0, 28.0])


def _slurm_step(monkeypatch, tmp_path, nodes, tasks_per_node, procid):
    """A Slurm step's variables, on a PATH without nvidia-smi and with no CUDA_VISIBLE_DEVICES."""
    tasks = sum(tasks_per_node)
    per_node = ",".join(str(n) for n in tasks_per_node)
    for name, value in {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "PATH": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_slurm_cluster_resolver_on_cpu_nodes(monkeypatch, tmp_path):
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm_lib

    _slurm_step(monkeypatch, tmp_path, "cpu[1-2]", [1, 1], procid=1)
    # TensorFlow's own resolver: counting GPUs runs nvidia-smi; zero GPUs breaks its task layout.
    with pytest.raises(FileNotFoundError, match="nvidia-smi"):
        slurm_lib.SlurmClusterResolver()
    with pytest.raises(ValueError, match="range"):
        slurm_lib.SlurmClusterResolver(gpus_per_node=0).cluster_spec()

    resolver = _workarounds.slurm_cluster_resolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["cpu1:8888", "cpu2:8888"]}
    assert resolver.get_task_info() == ("worker", 1)
    assert resolver.num_accelerators() == {"GPU": 0}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    # Two tasks on one node get consecutive ports, as TensorFlow lays them out.
    _slurm_step(monkeypatch, tmp_path, "localhost", [2], procid=0)
    resolver = _workarounds.slurm_cluster_resolver(port_base=5000)
    assert resolver.cluster_spec().as_dict() == {"worker": ["localhost:5000", "localhost:5001"]}
    assert resolver.get_task_info() == ("worker", 0)


def test_slurm_cluster_resolver_with_gpus_is_tensorflows(monkeypatch, tmp_path):
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm_lib

    _slurm_step(monkeypatch, tmp_path, "gpu[1-2]", [2, 2], procid=3)
    try:
        ours = _workarounds.slurm_cluster_resolver(gpus_per_node=4)
        theirs = slurm_lib.SlurmClusterResolver(gpus_per_node=4)
        assert ours.cluster_spec().as_dict() == theirs.cluster_spec().as_dict()
        assert ours.get_task_info() == theirs.get_task_info() == ("worker", 3)
        assert ours.num_accelerators() == {"GPU": 2}
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # the node's second pair of GPUs
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)


def test_tensor_seeds_after_a_global_seed_of_zero():
    from tensorflow.python.eager import context as tf_context

    from tpu_scale.data import sources

    numbers = tf.data.Dataset.range(20)

    def epochs(seed):
        return list(sources.shuffle_each_epoch(numbers, 20, seed).take(60).as_numpy_iterator())

    previous = tf_context.global_seed()  # other tests in this process may have set one
    try:
        tf.random.set_seed(None)
        unseeded = epochs(3)
        tf.random.set_seed(0)  # as keras.utils.set_random_seed(0) does
        # TensorFlow's own: a tensor seed under a global seed of 0 fails while tracing.
        with pytest.raises(tf.errors.OperatorNotAllowedInGraphError, match="as a Python `bool`"):
            numbers.flat_map(lambda e: numbers.shuffle(20, seed=3 + e))
        # The package's: the stream it has with no global seed, each epoch another order.
        assert epochs(3) == unseeded
        tf.random.set_seed(2**31 - 1)  # TensorFlow takes seeds modulo 2**31 - 1
        assert epochs(3) == unseeded
    finally:
        tf.random.set_seed(previous)
    assert sorted(unseeded[:20]) == list(range(20)) and unseeded[:20] != unseeded[20:40]
