"""The torus sum across two localhost worker processes x 4 logical CPUs (mesh 2x4, one row per
worker)."""

import functools
import os

import numpy as np
import pytest

from tpu_scale.testing import run_workers
from tpu_scale.torus.schedule import ALGORITHMS

# One cluster (the module's fixture) serves every test here: under pytest-xdist's `--dist
# loadgroup` they run on one worker, so that the cluster starts once instead of once per worker,
# two at a time.
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("torus_multiworker")]

SHAPES = [(1,), (7,), (1003,), (3, 5), (2, 3, 4)] + [(i % 5 + 1, 3) for i in range(30)]
DTYPES = ["float32", "float32", "float32", "bfloat16", "float16"] + ["float32", "bfloat16"] * 15
# (name, algorithm, transport dtype) of every sum the workers run.
SUMS = [(a, a, None) for a in ALGORITHMS] + [("torus_2d_bfloat16", "torus_2d", "bfloat16")]


def _replica_values(replica):
    """Replica `replica`'s inputs as float32 (quantized to each tensor's dtype later, the same
    everywhere)."""
    rng = np.random.default_rng(100 + replica)
    return [rng.uniform(0.5, 1.5, size=s).astype(np.float32) for s in SHAPES]


def cluster_main():
    """Runs in each worker: the sum under every algorithm, then `model.fit` with the torus and
    natively."""
    import keras
    import tensorflow as tf

    import tpu_scale
    from tpu_scale.distribute import collectives
    from tpu_scale.testing import collective_ops, group_size, train_graphs
    from tpu_scale.torus import all_reduce as torus

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"])
    )
    local = len(strategy.extended.worker_devices)
    task = strategy.cluster_resolver.task_id
    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: [
            tf.cast(v, d) for v, d in zip(_replica_values(ctx.replica_id_in_sync_group), DTYPES)
        ]
    )
    out = {"mesh": strategy.mesh.shape, "task": task, "local": local, "sums": {}, "ops": {}}
    for name, algorithm, transport in SUMS:

        @tf.function
        def summed(grads, algorithm=algorithm, transport=transport):
            return strategy.run(
                lambda g: torus.all_reduce_sum(
                    g, algorithm=algorithm, pack_bytes=512, gradient_dtype=transport
                ),
                args=(grads,),
            )

        result = summed(inputs)
        out["sums"][name] = [
            [tf.cast(v, tf.float32).numpy() for v in strategy.experimental_local_results(r)]
            for r in result
        ]
        graph = summed.get_concrete_function(inputs).graph
        out["ops"][name] = sorted(
            {
                (op.type, int(tf.get_static_value(op.inputs[1])), op.inputs[0].dtype.name)
                for op in graph.get_operations()
                if op.type.startswith("Collective") and op.type.endswith("V2")
            }
        )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    out["weights"], out["fit_ops"] = {}, {}
    for reduction in ("torus", "torus_bfloat16", "native"):
        # One MultiWorkerMirroredStrategy per process: switch its reduction between the fits.
        ops = strategy.cross_device_ops
        if reduction == "torus":
            ops.algorithm, ops.gradient_dtype = "auto", None
        elif reduction == "torus_bfloat16":
            ops.algorithm, ops.gradient_dtype = "torus_2d", "bfloat16"
        else:
            ops.algorithm = "native"  # every sum to TensorFlow's own collective ops
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)]
            )
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        initial = [w.copy() for w in model.get_weights()]
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        out["weights"][reduction] = (initial, model.get_weights())
        # The torus's own ops, on private group keys: Keras sums its metrics over all 8 itself.
        out["fit_ops"][reduction] = sorted(
            {
                (op.type, group_size(op), op.inputs[0].dtype.name)
                for g in train_graphs(model)
                for op in collective_ops(g)
                if int(tf.get_static_value(op.inputs[2])) >= collectives.PRIVATE_KEY_BASE
            }
        )
    out["auto"] = sorted(set(strategy.auto_algorithm.choices.values()))
    return out


@functools.lru_cache(maxsize=None)
def _cluster():
    return run_workers(
        "test_torus_multiworker:cluster_main", num_workers=2, cpus_per_worker=4, timeout=600
    )


@pytest.fixture(scope="module")
def cluster():
    return _cluster()


def test_two_workers_form_a_2x4_mesh(cluster):
    assert [r["task"] for r in cluster] == [0, 1]
    assert all(r["mesh"] == (2, 4) and r["local"] == 4 for r in cluster)


@pytest.mark.parametrize("name", [name for name, _, _ in SUMS])
def test_sum_across_processes_equals_plain_sum(cluster, name):
    import tensorflow as tf

    replicas = [_replica_values(r) for r in range(8)]
    rtol = {"float32": 1e-6, "bfloat16": 2e-2, "float16": 4e-3}
    if name.endswith("bfloat16"):
        # The shard crosses between processes in bfloat16: one rounding of each host's partial sum.
        rtol = {"float32": 1e-2, "bfloat16": 2e-2, "float16": 1e-2}
    for i, dtype in enumerate(DTYPES):
        quantized = [
            tf.cast(tf.cast(values[i], dtype), tf.float32).numpy().astype(np.float64)
            for values in replicas
        ]
        expected = np.sum(quantized, axis=0)
        for worker in cluster:
            for value in worker["sums"][name][i]:
                np.testing.assert_allclose(
                    value, expected, rtol=rtol[dtype], err_msg=f"{dtype} {SHAPES[i]}"
                )


def test_hierarchical_graph_crosses_hosts_only_in_the_column_sum(cluster):
    # torus_2d on hosts x local CPUs: the row phases are plain ops inside a worker; the only
    # collective ops are the column sums across the two workers (groups of 2), in bfloat16 if asked.
    assert {kind for kind, _, _ in cluster[0]["ops"]["torus_2d"]} == {"CollectiveReduceV2"}
    assert {size for _, size, _ in cluster[0]["ops"]["torus_2d"]} == {2}
    assert {d for _, _, d in cluster[0]["ops"]["torus_2d"]} == {"float32", "bfloat16", "float16"}
    bf16_ops = cluster[0]["ops"]["torus_2d_bfloat16"]
    assert {(k, s) for k, s, _ in bf16_ops} == {("CollectiveReduceV2", 2)}
    assert {d for _, _, d in cluster[0]["ops"]["torus_2d_bfloat16"]} == {"bfloat16", "float16"}
    # Groups spanning both workers stay collective ops: the flat sum is one all-reduce over all 8.
    assert {(k, s) for k, s, _ in cluster[0]["ops"]["flat"]} == {("CollectiveReduceV2", 8)}


def test_fit_across_processes_matches_native(cluster):
    from tpu_scale import plan

    # "auto" for 2 CPU processes x 4 and this model's four small gradients (264 bytes, under the
    # rule's 64 KiB): one all-reduce of each over all 8 (latency-bound: one collective beats three
    # phases), as the planner prices it too. ResNet-50's gradients take the hierarchical form
    # (tests/test_torus_schedule.py), as the bfloat16 fit here does.
    tensors = [(4 * n, "float32") for n in (35, 7, 21, 3)]
    expected = plan.choose_algorithm(plan.hardware_cluster("cpu", 2, 4), tensors).algorithm
    assert cluster[0]["auto"] == [expected] == ["flat"]
    assert cluster[0]["fit_ops"]["torus"] == [("CollectiveReduceV2", 8, "float32")]
    # torus_2d with bfloat16 between hosts: plain ops inside a worker, only the column sums of a
    # shard cross between the two workers, in bfloat16; nothing over all 8 at once.
    assert cluster[0]["fit_ops"]["torus_bfloat16"] == [("CollectiveReduceV2", 2, "bfloat16")]
    assert cluster[0]["fit_ops"]["native"] == []
    for worker in cluster:
        (initial, torus_weights), (_, native_weights) = (
            worker["weights"]["torus"],
            worker["weights"]["native"],
        )
        for w, native, w0 in zip(torus_weights, native_weights, initial):
            assert np.abs(w - w0).max() > 1e-3, "training changed nothing"
            np.testing.assert_allclose(w, native, atol=1e-5, rtol=0)
        # bfloat16 between hosts: within its precision (8 bits of mantissa on each shard crossing).
        for w, native in zip(worker["weights"]["torus_bfloat16"][1], native_weights):
            np.testing.assert_allclose(w, native, atol=2e-2, rtol=0)
    for w0, w1 in zip(cluster[0]["weights"]["torus"][1], cluster[1]["weights"]["torus"][1]):
        np.testing.assert_array_equal(w0, w1)
