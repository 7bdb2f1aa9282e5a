"""The torus sum across two localhost worker processes x 4 logical CPUs (mesh 2x4, one row per worker)."""

import functools
import os

import numpy as np
import pytest

from tpu_scale.testing import run_workers

pytestmark = pytest.mark.multiprocess

SHAPES = [(1,), (7,), (1003,), (3, 5), (2, 3, 4)] + [(i % 5 + 1, 3) for i in range(100)]
DTYPES = ["float32", "float32", "float32", "bfloat16", "float16"] + ["float32", "bfloat16"] * 50
ALGORITHMS = ("ring", "torus_2d", "torus_2d_bidirectional")


def _replica_values(replica):
    """Replica `replica`'s inputs as float32 (quantized to each tensor's dtype later, the same everywhere)."""
    rng = np.random.default_rng(100 + replica)
    return [rng.uniform(0.5, 1.5, size=s).astype(np.float32) for s in SHAPES]


def cluster_main():
    """Runs in each worker: the sum under every algorithm, then `model.fit` with the torus and natively."""
    import keras
    import tensorflow as tf

    import tpu_scale
    from tpu_scale import keras_hook, torus
    from tpu_scale.testing import collective_ops, group_size, train_graphs

    strategy = tpu_scale.create_strategy(num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]))
    local = len(strategy.extended.worker_devices)
    task = strategy.cluster_resolver.task_id
    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.cast(v, d) for v, d in zip(_replica_values(ctx.replica_id_in_sync_group), DTYPES)]
    )
    out = {"mesh": strategy.mesh.shape, "task": task, "local": local, "sums": {}, "ops": {},
           "auto": torus.resolve_algorithm(keras_hook.settings_for(strategy).algorithm, strategy.mesh)}
    for algorithm in ALGORITHMS:
        @tf.function
        def summed(grads, algorithm=algorithm):
            return strategy.run(lambda g: torus.all_reduce_sum(g, algorithm=algorithm, pack_bytes=2048),
                                args=(grads,))

        result = summed(inputs)
        out["sums"][algorithm] = [
            [tf.cast(v, tf.float32).numpy() for v in strategy.experimental_local_results(r)] for r in result
        ]
        graph = summed.get_concrete_function(inputs).graph
        out["ops"][algorithm] = sorted(
            {(op.type, int(tf.get_static_value(op.inputs[1]))) for op in graph.get_operations()
             if op.type.startswith("Collective") and op.type.endswith("V2")}
        )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    out["weights"], out["fit_ops"] = {}, {}
    for reduction in ("torus", "native"):
        # One MultiWorkerMirroredStrategy per process: switch its reduction between the two fits.
        if reduction == "torus":
            keras_hook.install(strategy)
        else:
            keras_hook.uninstall(strategy)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="tanh"),
                                      keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        initial = [w.copy() for w in model.get_weights()]
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        out["weights"][reduction] = (initial, model.get_weights())
        out["fit_ops"][reduction] = sorted(
            {(op.type, group_size(op)) for g in train_graphs(model) for op in collective_ops(g)})
    return out


@functools.lru_cache(maxsize=None)
def _cluster():
    return run_workers("test_torus_multiworker:cluster_main", num_workers=2, cpus_per_worker=4, timeout=600)


@pytest.fixture(scope="module")
def cluster():
    return _cluster()


def test_two_workers_form_a_2x4_mesh(cluster):
    assert [r["task"] for r in cluster] == [0, 1]
    assert all(r["mesh"] == (2, 4) and r["local"] == 4 for r in cluster)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sum_across_processes_equals_plain_sum(cluster, algorithm):
    import tensorflow as tf

    replicas = [_replica_values(r) for r in range(8)]
    rtol = {"float32": 1e-6, "bfloat16": 2e-2, "float16": 4e-3}
    for i, dtype in enumerate(DTYPES):
        quantized = [tf.cast(tf.cast(values[i], dtype), tf.float32).numpy().astype(np.float64) for values in replicas]
        expected = np.sum(quantized, axis=0)
        for worker in cluster:
            for value in worker["sums"][algorithm][i]:
                np.testing.assert_allclose(value, expected, rtol=rtol[dtype], err_msg=f"{dtype} {SHAPES[i]}")


def test_hierarchical_graph_crosses_hosts_only_in_the_column_sum(cluster):
    # torus_2d on hosts x local devices: all-to-all and gather inside a worker (4), the sum across workers (2).
    ops = cluster[0]["ops"]["torus_2d"]
    assert ("CollectiveAllToAllV2", 4) in ops and ("CollectiveGatherV2", 4) in ops
    assert ("CollectiveReduceV2", 2) in ops
    assert not [size for kind, size in ops if size == 8]


def test_fit_across_processes_matches_native(cluster):
    # "auto", what create_strategy registers, is the hierarchical sum across hosts: shards inside a worker,
    # the sum across the two workers, and nothing over all 8 replicas at once (the flat ring).
    assert cluster[0]["auto"] == "torus_2d"
    torus_ops, native_ops = cluster[0]["fit_ops"]["torus"], cluster[0]["fit_ops"]["native"]
    assert not [size for _, size in torus_ops if size == 8]
    assert {("CollectiveAllToAllV2", 4), ("CollectiveReduceV2", 2), ("CollectiveGatherV2", 4)} <= set(torus_ops)
    assert not [kind for kind, _ in native_ops if kind == "CollectiveAllToAllV2"]
    for worker in cluster:
        (initial, torus_weights), (_, native_weights) = worker["weights"]["torus"], worker["weights"]["native"]
        for w, native, w0 in zip(torus_weights, native_weights, initial):
            assert np.abs(w - w0).max() > 1e-3, "training changed nothing"
            np.testing.assert_allclose(w, native, atol=1e-5, rtol=0)
    for w0, w1 in zip(cluster[0]["weights"]["torus"][1], cluster[1]["weights"]["torus"][1]):
        np.testing.assert_array_equal(w0, w1)
