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
    # Unweighted metrics would count the padding: refused, naming the fix.
    with strategy.scope():
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"weighted_metrics=\['accuracy'\]"):
        model.evaluate(evaluation.dataset, steps=evaluation.steps, verbose=0)


def test_evaluate_a_validation_set_smaller_than_the_batch(strategy):
    """14 examples, a global batch of 128 on 8 replicas: replica 0 gets them all, the others empty
    batches. evaluate counts each example once and equals the model outside the strategy (a
    model without convolutions: see `test_exact_evaluation_of_convolutions_on_any_cpu`)."""
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
    expected = np.mean(np.argmax(model(images).numpy(), -1) == labels.numpy())
    assert result["accuracy"] == pytest.approx(expected)


def _counting_model_and_data(strategy, examples, global_batch):
    """A compiled model under `strategy`, a distributed dataset of `examples` and the variable that
    counts the examples its pipelines have produced."""
    import keras

    with strategy.scope():
        model = keras.Sequential(
            [keras.Input([4]), keras.layers.Dense(3), keras.layers.BatchNormalization()]
        )
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    produced = tf.Variable(0, dtype=tf.int64)

    def example(i):
        with tf.control_dependencies([produced.assign_add(1)]):
            return tf.cast(tf.fill([4], i), tf.float32), i % 3

    data = tf.data.Dataset.range(examples).map(example).batch(global_batch)
    return model, strategy.experimental_distribute_dataset(data), produced


@pytest.mark.parametrize("mode", ["fit", "evaluate"])
def test_the_model_is_built_without_reading_a_batch(strategy, mode, monkeypatch):
    """Keras's build before `fit`/`evaluate` takes the shapes from the dataset's element spec: each
    example is produced once, where reading a first batch started the pipeline twice, and one
    iterator is started, where looking at an unread one set a second one up."""
    model, data, produced = _counting_model_and_data(strategy, 96, 32)
    import keras

    started, at_first_batch = [], []
    iterate = type(data).__iter__
    monkeypatch.setattr(type(data), "__iter__", lambda self: started.append(1) or iterate(self))
    # Iterators started until the first batch (Keras starts the next epoch's at an epoch's end).
    first_batch = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: at_first_batch.append(len(started))
    )
    if mode == "fit":
        history = model.fit(data, epochs=1, verbose=0, callbacks=[first_batch])
        assert np.isfinite(history.history["loss"][0])
    else:
        first_batch.on_test_batch_begin = first_batch.on_train_batch_begin
        model.evaluate(data, verbose=0, callbacks=[first_batch])
    assert int(produced.numpy()) == 96
    assert at_first_batch[0] == 1


def test_a_ragged_input_still_builds_from_a_first_batch(strategy):
    """An input that is not one dense tensor per replica falls back to the first batch."""
    from tpu_scale import keras_hook

    ragged = tf.RaggedTensorSpec([None, None], tf.float32, 1)
    assert keras_hook._replica_specs(strategy, (ragged, tf.TensorSpec([None], tf.int64))) is None
    dense = keras_hook._replica_specs(strategy, (tf.TensorSpec([8, 5, 3], tf.uint8),))
    assert dense == (tf.TensorSpec([None, 5, 3], tf.uint8),)


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
