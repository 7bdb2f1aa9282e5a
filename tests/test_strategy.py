"""create_strategy: CPU replicas, errors, and a real two-process MultiWorkerMirroredStrategy."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale.distribute import collectives
from tpu_scale.testing import run_workers
from tpu_scale.testing.multiworker import free_ports


def test_cpu_strategy_has_a_mesh(cpu_devices):
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=8, mesh_shape=(2, 4), gradient_reduction="native"
    )
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 8
    assert strategy.mesh.shape == (2, 4)
    assert strategy.gradient_reduction == "native"
    assert tpu_scale.mesh_of(strategy) is strategy.mesh


def test_fewer_replicas_reuse_the_devices():
    strategy = tpu_scale.create_strategy(num_cpu_replicas=4, gradient_reduction="native")
    assert strategy.num_replicas_in_sync == 4 and strategy.mesh.shape == (1, 4)


def test_more_replicas_after_start_up_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"num_cpu_replicas=16\) before any other TensorFlow op"):
        tpu_scale.create_strategy(num_cpu_replicas=16)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"gradient_reduction": "ring"}, "choose one of"),
        ({"num_cpu_replicas": 0}, "positive int"),
        ({"num_cpu_replicas": 8, "mesh_shape": (3, 3)}, r"holds 9 replicas but there are 8"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tpu_scale.create_strategy(**kwargs)


def test_missing_tpu_is_an_error_that_names_it():
    # "local" asks for this VM's own TPU; there is none here, and that must not silently become the
    # CPU.
    with pytest.raises(RuntimeError, match="Could not reach the TPU 'local'"):
        tpu_scale.create_strategy(tpu="local")


def test_plain_strategies_get_a_derived_mesh():
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    assert tpu_scale.mesh_of(strategy).shape == (1, 4)


# --------------------------------------------------------------------------- what a script reads


def cluster_answers(strategy):
    """What a script written for several workers reads of a strategy's cluster: the resolver (as
    TensorFlow's multi-worker tutorial reads it) and the extended's public answers."""
    resolver, extended = strategy.cluster_resolver, strategy.extended
    return {
        "resolver": type(resolver).__name__,
        "task_type": resolver.task_type,
        "task_id": resolver.task_id,
        "cluster_spec": resolver.cluster_spec().as_dict(),
        "rpc_layer": resolver.rpc_layer,
        "should_checkpoint": extended.should_checkpoint,
        "should_save_summary": extended.should_save_summary,
        "experimental_should_init": extended.experimental_should_init,
        # Read by Keras's trainer to choose how it gathers predictions and reduces losses.
        "in_multi_worker_mode": extended._in_multi_worker_mode(),
    }


def one_worker_answers():
    """Runs in a worker of a one-worker TF_CONFIG: the package's strategy's answers and
    TensorFlow's own multi-worker strategy's, for the same cluster."""
    # TensorFlow's first: with a cluster it starts the runtime's collectives, which must come first.
    tensorflows = cluster_answers(tf.distribute.MultiWorkerMirroredStrategy())
    return cluster_answers(tpu_scale.create_strategy()), tensorflows


def test_one_process_answers_what_tensorflows_multi_worker_strategy_answers():
    ours = cluster_answers(tpu_scale.create_strategy(num_cpu_replicas=4))
    tensorflows = cluster_answers(tf.distribute.MultiWorkerMirroredStrategy())
    assert ours == tensorflows
    assert (ours["resolver"], ours["task_type"], ours["task_id"]) == (
        "TFConfigClusterResolver", None, None,
    )  # fmt: skip
    assert ours["cluster_spec"] == {} and ours["should_checkpoint"] is True


@pytest.mark.multiprocess
def test_a_one_worker_tf_config_is_answered_as_tensorflow_answers():
    # A TF_CONFIG naming this process as its only worker: one process, worker 0, the chief.
    (ours, tensorflows), = run_workers(f"{__name__}:one_worker_answers", num_workers=1, timeout=120)
    assert ours == tensorflows
    assert (ours["task_type"], ours["task_id"], len(ours["cluster_spec"]["worker"])) == (
        "worker", 0, 1,
    )  # fmt: skip


# --------------------------------------------------------------------------- multi-worker, two
# processes


def worker_all_reduce():
    """Runs in each worker: a full all-reduce and row/column group sums over the 2 x 2 mesh."""
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]), gradient_reduction="native"
    )
    mesh = strategy.mesh

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            value = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)
            rows = collectives.group_sum(value, mesh.row_groups())
            columns = collectives.group_sum(value, mesh.column_groups())
            return total, rows, columns

        return strategy.run(replica_fn)

    results = step()
    return {
        "num_replicas": strategy.num_replicas_in_sync,
        "mesh": mesh.shape,
        "local_devices": list(strategy.extended.worker_devices),
        "values": [[float(v) for v in strategy.experimental_local_results(r)] for r in results],
        "cluster": json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"],
        "launched_under": os.environ.get("TPU_SCALE_TEST_PREFIX"),
    }


def worker_fit():
    """Runs in each worker: Keras model.fit under the multi-worker strategy; the final weights."""
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]), gradient_reduction="native"
    )
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(dataset, epochs=2, steps_per_epoch=3, verbose=0)
    return {"weights": [w.numpy() for w in model.weights], "loss": history.history["loss"]}


@pytest.mark.multiprocess
def test_two_workers_all_reduce():
    # At given addresses, each worker started under a command that execs it (as `ip netns exec`
    # does for workers in network namespaces of their own).
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    results = run_workers(
        f"{__name__}:worker_all_reduce",
        num_workers=2,
        cpus_per_worker=2,
        timeout=240,
        addresses=addresses,
        launch_prefixes=[["env", f"TPU_SCALE_TEST_PREFIX={i}"] for i in range(2)],
    )
    for task, result in enumerate(results):
        assert result["cluster"] == addresses and result["launched_under"] == str(task)
        assert result["num_replicas"] == 4 and result["mesh"] == (2, 2)
        assert len(result["local_devices"]) == 2
        total, rows, columns = result["values"]
        assert total == [10.0, 10.0]  # 1 + 2 + 3 + 4
        assert rows == ([3.0, 3.0] if task == 0 else [7.0, 7.0])  # a row is one worker's replicas
        assert columns == [4.0, 6.0]  # replicas {0, 2} and {1, 3}: across the two workers


@pytest.mark.multiprocess
def test_two_workers_keras_fit_agree():
    results = run_workers(f"{__name__}:worker_fit", num_workers=2, cpus_per_worker=2, timeout=300)
    first, second = results
    assert len(first["loss"]) == 2 and np.all(np.isfinite(first["loss"]))
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_workers_given_addresses_or_prefixes_for_another_count_are_an_error():
    with pytest.raises(ValueError, match="addresses has 1 entries for 2 workers"):
        run_workers(f"{__name__}:worker_fit", num_workers=2, addresses=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="launch_prefixes has 3 entries for 2 workers"):
        run_workers(f"{__name__}:worker_fit", num_workers=2, launch_prefixes=[[]] * 3)


@pytest.mark.multiprocess
def test_worker_failure_shows_every_output():
    # The first worker to fail stops the cluster: the other one is killed before or after its own
    # failure.
    with pytest.raises(RuntimeError) as failure:
        run_workers("tpu_scale.no_such_module:f", num_workers=2, timeout=60)
    message = str(failure.value)
    assert "--- worker 0 (exit code " in message and "--- worker 1 (exit code " in message
    assert "No module named 'tpu_scale.no_such_module'" in message


def test_strategies_over_different_devices_coexist():
    """Each strategy gets its own collective keys: key 1 reused elsewhere aborts the runtime."""

    def all_reduce(strategy):
        return strategy.experimental_local_results(
            tf.function(
                lambda: strategy.run(
                    lambda: tf.distribute.get_replica_context().all_reduce("sum", 1.0)
                )
            )()
        )

    first = tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")
    assert [float(v) for v in all_reduce(first)] == [8.0] * 8
    reversed_devices = tpu_scale.distribute.strategy.MirroredStrategy([f"/cpu:{i}" for i in (3, 2, 1, 0)])
    assert [float(v) for v in all_reduce(reversed_devices)] == [4.0] * 4
    assert [float(v) for v in all_reduce(first)] == [8.0] * 8


def test_run_converts_the_replica_function_as_tensorflow_does():
    # The strategies' `run` (which splits Keras train steps by accumulation phase) keeps
    # AutoGraph on for the replica function: Python control flow on tensors still works.
    strategy = tpu_scale.create_strategy(num_cpu_replicas=8)

    def replica_fn():
        x = tf.constant(3.0)
        if x > 0:
            x = x * 2.0
        return x

    results = tf.function(lambda: strategy.run(replica_fn))()
    assert [float(v) for v in strategy.experimental_local_results(results)] == [6.0] * 8


def test_one_cpu_replica_reads_its_pipeline_without_fanning_out():
    from tensorflow.python.data.ops.multi_device_iterator_ops import OwnedMultiDeviceIterator

    def dataset_fn(context):
        return tf.data.Dataset.range(10).batch(context.get_per_replica_batch_size(4))

    def reader(distributed):
        # The one worker's iterator: a MultiDeviceIterator when batches are fanned out to devices.
        return iter(distributed)._iterators[0]._iterator

    one = tpu_scale.create_strategy(num_cpu_replicas=1)
    direct = one.distribute_datasets_from_function(dataset_fn)
    assert not isinstance(reader(direct), OwnedMultiDeviceIterator)
    assert [b.numpy().tolist() for b in direct] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # Options the user gives are kept; several replicas keep TensorFlow's default.
    given = one.distribute_datasets_from_function(dataset_fn, tf.distribute.InputOptions())
    assert isinstance(reader(given), OwnedMultiDeviceIterator)
    assert [b.numpy().tolist() for b in given] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    two = tpu_scale.create_strategy(num_cpu_replicas=2, gradient_reduction="native")
    assert isinstance(reader(two.distribute_datasets_from_function(dataset_fn)), OwnedMultiDeviceIterator)


# --------------------------------------------------------------------------- any number of examples


def _small_convnet():
    """A small convnet as keras.io's image-classification examples write one."""
    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(12, 12, 3))
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.SeparableConv2D(16, 3, padding="same")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.25)(x)
    outputs = keras.layers.Dense(5)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
    )
    return model


@pytest.mark.parametrize("replicas", [4, 2])
def test_predict_and_evaluate_any_number_of_examples_as_on_one_device(replicas):
    # One image on 4 replicas leaves 3 of them without an example (TensorFlow splits it 1, 0, 0,
    # 0), and a CPU's convolution fails on an empty batch: those replicas do not run the model.
    strategy = tpu_scale.create_strategy(num_cpu_replicas=replicas)
    one_device = _small_convnet()
    with strategy.scope():
        model = _small_convnet()
    model.set_weights(one_device.get_weights())
    rng = np.random.default_rng(0)
    for n in (1, 3, 5, 7):
        x = rng.uniform(0, 255, size=(n, 12, 12, 3)).astype("float32")
        y = rng.integers(0, 5, size=(n,))
        predicted = model.predict(x, verbose=0)
        assert predicted.shape == (n, 5)
        np.testing.assert_allclose(predicted, one_device.predict(x, verbose=0), atol=1e-5)
        # A batch size smaller than the examples: the last batch is partial too.
        np.testing.assert_allclose(
            model.predict(x, batch_size=2, verbose=0), one_device.predict(x, verbose=0), atol=1e-5
        )
        got = model.evaluate(x, y, verbose=0, return_dict=True)
        want = one_device.evaluate(x, y, verbose=0, return_dict=True)
        assert set(got) == set(want) == {"loss", "acc"}
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=f"{name}, {n}")


def test_a_training_step_still_runs_on_every_replica():
    # A replica function that sums over the replicas is never skipped: with 5 examples on 4
    # replicas (2, 2, 1, 0), fit trains as TensorFlow's own strategy does on the same batches.
    import keras

    rng = np.random.default_rng(1)
    x = rng.normal(size=(13, 4)).astype("float32")
    y = rng.normal(size=(13, 1)).astype("float32")

    def fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(2)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    ours = fit(tpu_scale.create_strategy(num_cpu_replicas=4, gradient_reduction="native"))
    devices = [f"/cpu:{i}" for i in range(4)]
    reference = fit(tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice()))
    for got, want in zip(ours, reference):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_training_run_does_not_import_the_planner():
    import subprocess
    import sys

    # "auto" is a rule at run time; the planner (tpu_scale.plan) is a tool the run never loads.
    code = (
        "import sys, numpy as np, keras, tpu_scale\n"
        "strategy = tpu_scale.create_strategy(num_cpu_replicas=2)\n"
        "with strategy.scope():\n"
        "    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "    model.compile(optimizer='sgd', loss='mse')\n"
        "model.fit(np.ones((8, 3), 'float32'), np.zeros((8, 2), 'float32'), verbose=0)\n"
        "print(sorted(m for m in sys.modules if m.startswith('tpu_scale.plan')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
