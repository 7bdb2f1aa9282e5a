"""Tests for `tpu_scale.torus.all_reduce`: schedule, executor, `model.fit` hook, TPU graph, eager path."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale import keras_hook
from tpu_scale.distribute import collectives, context
from tpu_scale.distribute.mesh import ReplicaMesh
from tpu_scale.testing import collective_ops as _collective_ops
from tpu_scale.testing import group_size as _group_size
from tpu_scale.testing import train_graphs as _train_graphs
from tpu_scale.torus import all_reduce as torus

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
# Relative error allowed per dtype: float32 as the issue asks; 16-bit types a few roundings of their
# epsilon (the sum of 8 values is rounded after every ring step).
RTOL = {tf.float32: 1e-6, tf.bfloat16: 2e-2, tf.float16: 4e-3}


@functools.lru_cache(maxsize=None)
def _strategy(shape, reduction="torus", algorithm="auto"):
    return tpu_scale.create_strategy(
        num_cpu_replicas=8,
        mesh_shape=shape,
        gradient_reduction=reduction,
        gradient_algorithm=algorithm,
    )


# --------------------------------------------------------------------------- graph inspection


OP_OF_PHASE = {
    torus.REDUCE_SCATTER: "CollectiveAllToAllV2",
    torus.ALL_REDUCE: "CollectiveReduceV2",
    torus.ALL_GATHER: "CollectiveGatherV2",
}


def _is_private(op):
    """True for collectives on tpu_scale's own group keys (TensorFlow's strategies number theirs
    from 1)."""
    return int(tf.get_static_value(op.inputs[2])) >= collectives.PRIVATE_KEY_BASE


# --------------------------------------------------------------------------- executor


# Small tensors of mixed ranks and dtypes summed beside the fixed ones.
MIXED = 12


def _specs():
    """(shape, dtype) of the summed tensors: sizes 1, 7, 1000003, 16-bit types, `MIXED` mixed small
    tensors (ranks 0-3, every dtype; with small packs, several packs of each dtype)."""
    specs = [
        ((1,), tf.float32),
        ((7,), tf.float32),
        ((1000003,), tf.float32),
        ((3, 5), tf.bfloat16),
        ((2, 3, 4), tf.float16),
    ]
    rng = np.random.default_rng(7)
    dtypes = [tf.float32, tf.bfloat16, tf.float16]
    for i in range(MIXED):
        rank = i % 4
        specs.append((tuple(int(d) for d in rng.integers(1, 6, size=rank)), dtypes[i % 3]))
    return specs


@functools.lru_cache(maxsize=None)
def _inputs():
    """Per-replica values `[8, *shape]` (float32, quantized to each dtype) and their exact float64
    sums."""
    rng = np.random.default_rng(0)
    values, sums = [], []
    for shape, dtype in _specs():
        # Positive values: no cancellation, so a relative tolerance is meaningful for every element.
        v = rng.uniform(0.5, 1.5, size=(8,) + shape).astype(np.float32)
        v = tf.cast(tf.cast(v, dtype), tf.float32).numpy()
        values.append(v)
        sums.append(v.astype(np.float64).sum(axis=0))
    return values, sums


def _run_sum(strategy, algorithm, pack_bytes):
    values, _ = _inputs()
    dtypes = [d for _, d in _specs()]
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.cast(v[ctx.replica_id_in_sync_group], d) for v, d in zip(values, dtypes)]
    )

    @tf.function
    def summed(grads):
        return strategy.run(
            lambda g: torus.all_reduce_sum(g, algorithm=algorithm, pack_bytes=pack_bytes),
            args=(grads,),
        )

    return summed(per_replica), summed.get_concrete_function(per_replica).graph


def _check_sums(strategy, out, shape, algorithm):
    _, sums = _inputs()
    for (spec_shape, dtype), result, expected in zip(_specs(), out, sums):
        for replica_value in strategy.experimental_local_results(result):
            assert replica_value.dtype == dtype and tuple(replica_value.shape) == spec_shape
            np.testing.assert_allclose(
                replica_value.numpy().astype(np.float64),
                expected,
                rtol=RTOL[dtype],
                atol=0,
                err_msg=f"{dtype.name} {spec_shape} on {shape} with {algorithm}",
            )


def _graph_op_types(graph):
    types = [op.type for op in graph.get_operations()]
    for function in graph._functions.values():
        types += [op.type for op in function.graph.get_operations()]
    return types


# Every mesh with the algorithms "auto" picks on CPU hosts (flat on one host, torus_2d across
# them); the others on the 2x4 mesh. In graph every tensor is summed on its own (no packs).
IN_GRAPH_CASES = [(shape, a) for shape in MESHES for a in ("flat", "torus_2d")] + [
    ((2, 4), a) for a in torus.ALGORITHMS if a not in ("flat", "torus_2d")
]


@pytest.mark.parametrize("shape,algorithm", IN_GRAPH_CASES)
def test_sum_in_graph_equals_plain_sum(shape, algorithm):
    """On one CPU host every phase is plain ops in the step graph: no collective op at all."""
    strategy = _strategy(shape)
    out, graph = _run_sum(strategy, algorithm, 4096)
    _check_sums(strategy, out, shape, algorithm)
    assert not _collective_ops(graph)
    # One AddN per tensor and group of each reduce-scatter or sum phase (on its first member):
    # nothing is fused, since plain ops have no launch cost to amortize.
    schedule = torus.build_schedule(strategy.mesh, 8, algorithm)
    per_tensor = sum(
        len(p.groups) for stream in schedule.streams for p in stream if p.kind != torus.ALL_GATHER
    )
    assert _graph_op_types(graph).count("AddN") == per_tensor * len(_specs())


@pytest.mark.parametrize("algorithm", torus.ALGORITHMS)
def test_sum_with_collective_ops_equals_plain_sum(algorithm, monkeypatch):
    """The collective-op form (GPUs, groups across hosts), forced on one host."""
    monkeypatch.setattr(collectives, "in_graph_groups", lambda groups: False)
    strategy = _strategy((2, 4))
    pack_bytes = 128  # several packs of every dtype for these 17 tensors
    out, graph = _run_sum(strategy, algorithm, pack_bytes)
    _check_sums(strategy, out, (2, 4), algorithm)
    # Fused: one collective per pack, phase and stream on each replica, not one per tensor.
    fake = [tf.zeros(s, d) for s, d in _specs()]
    packs = torus._packs(list(enumerate(fake)), pack_bytes)
    assert len({fake[p[0]].dtype for p in packs}) == 3 and len(packs) >= 6
    num_packs = len(packs)
    schedule = torus.build_schedule(strategy.mesh, 8, algorithm)
    for kind, op_type in OP_OF_PHASE.items():
        per_pack = sum(p.kind == kind for stream in schedule.streams for p in stream)
        ops = [op for op in _collective_ops(graph) if op.type == op_type]
        assert len(ops) == 8 * num_packs * per_pack < 8 * len(fake) or per_pack == 0


def test_indexed_slices_are_densified_and_summed():
    strategy = _strategy((2, 4))

    @tf.function
    def summed():
        def step():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            # Repeated index 2: the dense sum adds both rows.
            slices = tf.IndexedSlices(
                tf.ones([3, 2]) * (r + 1), tf.constant([0, 2, 2]), tf.constant([5, 2])
            )
            return torus.all_reduce_sum([slices, None, tf.ones([2])])

        return strategy.run(step)

    dense, missing, ones = summed()
    expected = np.zeros([5, 2])
    expected[0] = 36.0  # 1 + 2 + ... + 8
    expected[2] = 72.0
    for value in strategy.experimental_local_results(dense):
        np.testing.assert_allclose(value.numpy(), expected)
    assert missing is None
    np.testing.assert_allclose(strategy.experimental_local_results(ones)[0].numpy(), [8.0, 8.0])


def test_errors_are_clear():
    strategy = _strategy((2, 4))
    with strategy.scope(), pytest.raises(RuntimeError, match="replica context"):
        torus.all_reduce_sum([tf.ones([2])])

    @tf.function
    def ints():
        return strategy.run(lambda: torus.all_reduce_sum([tf.ones([2], tf.int32)]))

    with pytest.raises(ValueError, match="Cast it"):
        ints()


# --------------------------------------------------------------------------- TPU graph


def _tpu_ops(mesh, algorithm, num_elements=10, dtype=tf.float32):
    """The TPU ops of one sum of a float32 and a bfloat16 gradient; those of `dtype` (None: all)."""
    with tf.Graph().as_default() as graph, context.tpu_graph(mesh):
        torus.all_reduce_sum(
            [tf.zeros([num_elements]), tf.zeros([3, 3], tf.bfloat16)], algorithm=algorithm
        )
    ops = [
        op
        for op in graph.get_operations()
        if op.type in ("AllToAll", "CrossReplicaSum")
        and (dtype is None or op.outputs[0].dtype == dtype)
    ]
    return [
        (
            op.type,
            op.outputs[0].dtype,
            tf.get_static_value(op.inputs[-1]).tolist(),
            op.outputs[0].shape.num_elements(),
        )
        for op in ops
    ]


def test_tpu_graph_ops_and_group_assignments():
    mesh = ReplicaMesh.from_shape(2, 4)
    rows, cols = [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]
    everyone = [list(range(8))]
    # 10 float32 elements pad to 16: rows-first reduce-scatter 16 -> 4, column sum of 4, all-gather
    # 4 -> 16 (sent as 4 tiled copies through an all-to-all).
    assert _tpu_ops(mesh, "torus_2d")[:3] == [
        ("AllToAll", tf.float32, rows, 16),
        ("CrossReplicaSum", tf.float32, cols, 4),
        ("AllToAll", tf.float32, rows, 16),
    ]
    # Bidirectional: two halves of 8 (10 pads to 16), issued interleaved, in opposite dimension
    # orders.
    assert _tpu_ops(mesh, "torus_2d_bidirectional")[:6] == [
        ("AllToAll", tf.float32, rows, 8),
        ("AllToAll", tf.float32, cols, 8),
        ("CrossReplicaSum", tf.float32, cols, 2),
        ("CrossReplicaSum", tf.float32, rows, 4),
        ("AllToAll", tf.float32, rows, 8),
        ("AllToAll", tf.float32, cols, 8),
    ]
    ring = _tpu_ops(mesh, "ring", dtype=None)
    assert [(t, g) for t, _, g, _ in ring] == [
        ("AllToAll", everyone)
    ] * 4  # two dtypes x (scatter, gather)
    # Phase by phase: both buffers' reduce-scatters, then both all-gathers.
    assert [d for _, d, _, _ in ring] == [tf.float32, tf.bfloat16, tf.float32, tf.bfloat16]
    # The flat sum is one all-reduce over everyone per buffer.
    assert [(t, g) for t, _, g, _ in _tpu_ops(mesh, "flat", dtype=None)] == [
        ("CrossReplicaSum", everyone)
    ] * 2


def test_tpu_graph_on_a_torus_topology_mesh():
    # A 4x4-chip v3 slice, 2 cores per chip: replica ids follow the torus, not row-major order.
    coords = [[x, y, 0, c] for y in range(4) for x in range(4) for c in range(2)]
    topology = tf.tpu.experimental.Topology(mesh_shape=[4, 4, 1, 2], device_coordinates=[coords])
    mesh = ReplicaMesh.from_topology(topology)
    ops = _tpu_ops(mesh, "torus_2d_bidirectional", num_elements=64)
    assert ops[0][2] == mesh.row_groups().tolist() and ops[1][2] == mesh.column_groups().tolist()


# --------------------------------------------------------------------------- model.fit


def _fit(strategy, run_eagerly=False):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 10, size=(64, 3))
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(1)
        id_in, x_in = keras.Input((3,), dtype="int32"), keras.Input((5,))
        # The embedding's gradient is an IndexedSlices: densified by the torus, gathered by
        # TensorFlow.
        embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(id_in))
        hidden = keras.layers.Dense(7, activation="tanh")(
            keras.layers.Concatenate()([embedded, x_in])
        )
        model = keras.Model([id_in, x_in], keras.layers.Dense(3)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", run_eagerly=run_eagerly
        )
    initial = [w.copy() for w in model.get_weights()]
    model.fit([ids, x], y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    return model, initial


@functools.lru_cache(maxsize=None)
def _native_weights():
    """The weights after `_fit` with TensorFlow's own sum of the 8 replicas' gradients: one
    reference for every mesh shape, which only arranges the torus."""
    model, _ = _fit(_strategy((2, 4), "native"))
    assert not [op for g in _train_graphs(model) for op in _collective_ops(g) if _is_private(op)], (
        "native reduction must not run the torus"
    )
    return model.get_weights()


# "auto" on one CPU host is the planner's "flat" whatever the mesh (one sum per gradient on one
# device), so one mesh runs it; the sharded forms run in the step graph as the mesh arranges them.
# Every algorithm on every mesh equals the plain sum above.
@pytest.mark.parametrize(
    "shape,algorithm", [((2, 4), "auto"), ((4, 2), "torus_2d"), ((8, 1), "ring")]
)
def test_fit_matches_native_and_sums_in_the_step_graph(shape, algorithm):
    strategy = _strategy(shape, algorithm=algorithm)
    model, initial = _fit(strategy)
    for w, native, w0 in zip(model.get_weights(), _native_weights(), initial):
        assert np.abs(w - w0).max() > 1e-3, "training changed nothing"
        np.testing.assert_allclose(w, native, atol=1e-5, rtol=0)

    # Plain ops in the training graph; no collective op of the torus (nor of TensorFlow) remains.
    if algorithm == "auto":
        assert set(strategy.auto_algorithm.choices.values()) == {"flat"}
    graphs = _train_graphs(model)
    assert not [op for g in graphs for op in _collective_ops(g)]
    assert sum(_graph_op_types(g).count("AddN") for g in graphs) >= len(model.trainable_weights)


def test_fit_eagerly_matches_native(monkeypatch):
    calls = []
    original = torus.sum_across_devices
    monkeypatch.setattr(
        torus, "sum_across_devices", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    model, _ = _fit(_strategy((2, 4)), run_eagerly=True)
    assert len(calls) == 4  # every one of the 4 steps' sums of all 8 replicas through the torus
    for w, native in zip(model.get_weights(), _native_weights()):
        np.testing.assert_allclose(w, native, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- every program


def _tutorial_loop(strategy, steps=3):
    """TensorFlow's "Custom training with tf.distribute.Strategy" pattern, unchanged:
    `strategy.run(train_step)`, `tape.gradient`, `optimizer.apply_gradients`, and a loss summed with
    `strategy.reduce`. Returns the weights and the losses."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(steps * 16, 6)).astype("float32")
    y = rng.integers(0, 4, size=(steps * 16,))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.Adam(0.01)
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(images, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    losses = [float(distributed_train_step(batch))
              for batch in strategy.experimental_distribute_dataset(dataset)]
    return model.get_weights(), losses


def _tensorflows_own(replicas):
    """TensorFlow's `MirroredStrategy` on the same CPU devices, summing by
    `ReductionToOneDevice`: no collective keys that could meet the other strategies' in this
    process."""
    devices = [f"/cpu:{i}" for i in range(replicas)]
    return tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice())


def _said_torus(caplog):
    return [r.getMessage() for r in caplog.records if "gradient sum by TorusAllReduce" in r.getMessage()]


def test_tensorflows_custom_training_loop_sums_with_the_torus(caplog, monkeypatch):
    calls = []
    original = torus.sum_across_devices
    monkeypatch.setattr(
        torus, "sum_across_devices", lambda *a, **k: calls.append(a[4]) or original(*a, **k)
    )
    caplog.set_level("INFO", logger="tpu_scale")
    strategy = tpu_scale.create_strategy(num_cpu_replicas=4, gradient_algorithm="torus_2d",
                                         mesh_shape=(2, 2))
    weights, losses = _tutorial_loop(strategy)
    reference, reference_losses = _tutorial_loop(_tensorflows_own(4))
    assert calls and set(calls) == {"torus_2d"}  # one sum of all gradients per trace
    assert len(_said_torus(caplog)) == 1 and "torus_2d over mesh 2x2" in _said_torus(caplog)[0]
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for w, r in zip(weights, reference):
        np.testing.assert_allclose(w, r, atol=1e-5, rtol=0)


def test_a_plain_mirrored_strategy_takes_the_torus_as_its_cross_device_ops(caplog):
    caplog.set_level("INFO", logger="tpu_scale")
    devices = [f"/cpu:{i}" for i in range(4)]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tpu_scale.TorusAllReduce(ReplicaMesh.from_shape(2, 2), "torus_2d")
    )
    weights, _ = _tutorial_loop(strategy)
    reference, _ = _tutorial_loop(_tensorflows_own(4))
    for w, r in zip(weights, reference):
        np.testing.assert_allclose(w, r, atol=1e-5, rtol=0)
    assert _said_torus(caplog)

    # A replica's own all_reduce, SUM and MEAN, graph and eager; integers go to the fallback.
    def step():
        ctx = tf.distribute.get_replica_context()
        r = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0
        return (ctx.all_reduce("sum", [tf.fill([3, 5], r), tf.range(7.0) * r]),
                ctx.all_reduce("mean", r * tf.ones([2])),
                ctx.all_reduce("sum", tf.cast(r, tf.int64)))

    for run in (lambda: strategy.run(step), tf.function(lambda: strategy.run(step))):
        (a, b), mean, count = run()
        for values in zip(*(strategy.experimental_local_results(v) for v in (a, b, mean, count))):
            np.testing.assert_allclose(values[0].numpy(), np.full([3, 5], 10.0))
            np.testing.assert_allclose(values[1].numpy(), np.arange(7.0) * 10)
            np.testing.assert_allclose(values[2].numpy(), [2.5, 2.5])
            assert int(values[3]) == 10
    assert any("int64 values" in r.getMessage() for r in caplog.records)


def test_the_seam_sums_a_functions_inputs_and_leaves_the_host_to_tensorflow(monkeypatch, caplog):
    """Per-replica values handed to a tf.function (placed nowhere inside it) are the replicas'
    own: the torus sums them; a reduction to the host (`strategy.reduce`) is TensorFlow's."""
    calls = []
    original = torus.sum_across_devices
    monkeypatch.setattr(
        torus, "sum_across_devices", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    caplog.set_level("INFO", logger="tpu_scale")
    strategy = _strategy((2, 4), algorithm="torus_2d")
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([5], tf.cast(ctx.replica_id_in_sync_group, tf.float32))
    )

    @tf.function
    def summed(v):
        return strategy.run(lambda x: tf.distribute.get_replica_context().all_reduce("sum", x), args=(v,))

    for part in strategy.experimental_local_results(summed(values)):
        np.testing.assert_allclose(part.numpy(), np.full([5], 28.0))
    assert calls
    np.testing.assert_allclose(strategy.reduce("SUM", values, axis=None).numpy(), np.full([5], 28.0))


class OwnStep(keras.Model):
    """A Keras model with its own `train_step`, as keras.io's "Customizing what happens in fit"."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply_gradients(
            zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        )
        return {"loss": loss}


def test_a_keras_custom_train_step_sums_with_the_torus(caplog):
    caplog.set_level("INFO", logger="tpu_scale")
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")

    def fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(5)
            inputs = keras.Input((5,))
            model = OwnStep(inputs, keras.layers.Dense(2)(keras.layers.Dense(6)(inputs)))
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    weights = fit(tpu_scale.create_strategy(num_cpu_replicas=4, gradient_algorithm="ring"))
    assert any("ring over mesh 1x4" in m for m in _said_torus(caplog))
    for w, r in zip(weights, fit(_tensorflows_own(4))):
        np.testing.assert_allclose(w, r, atol=1e-5, rtol=0)


def test_the_torus_runs_for_the_strategies_that_ask_and_others_keep_native():
    registered = _strategy((2, 4))
    assert keras_hook.settings_for(registered).algorithm == "auto"
    assert keras_hook.settings_for(registered).torus_sum
    native = _strategy((2, 4), "native")
    assert not keras_hook.settings_for(native).torus_sum

    # A strategy not made by create_strategy: Keras's own all-reduce, no torus ops. All 8 devices:
    # every strategy numbers its group keys from 1, and key 1 already means a group of 8 in this
    # process.
    plain = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(8)])
    with plain.scope():
        variable = tf.Variable(tf.zeros([6]))
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([variable])

    @tf.function
    def step():
        return plain.run(
            lambda: optimizer._all_reduce_sum_gradients([(tf.ones([6]), variable)])[0][0]
        )

    # Traced, not run: executing it could reuse collective keys of other strategies in this process.
    ops = _collective_ops(step.get_concrete_function().graph)
    assert ops and not [op for op in ops if op.type != "CollectiveReduceV2"]
    assert {_group_size(op) for op in ops} == {8}
