"""`DistributedBatchNormalization` against plain batch normalization over each group's concatenated batch."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale import context
from tpu_scale.layers import DistributedBatchNormalization, convert_batch_normalization
from tpu_scale.mesh import ReplicaMesh
from tpu_scale.testing import run_workers

NUM_REPLICAS = 8


@pytest.fixture(scope="module")
def strategy():
    return tpu_scale.create_strategy(num_cpu_replicas=NUM_REPLICAS, gradient_reduction="native")


def _initial_weights(channels, seed, renorm=False):
    """Non-trivial gamma, beta and moving statistics, so the moving-mean shift and the updates matter."""
    rng = np.random.default_rng(seed)
    weights = [
        rng.uniform(0.5, 1.5, channels),  # gamma
        rng.normal(0.0, 0.5, channels),  # beta
        rng.normal(1.0, 1.0, channels),  # moving mean
        rng.uniform(0.5, 2.0, channels),  # moving variance
    ]
    if renorm:
        stddev = np.sqrt(weights[3])
        weights += [stddev, rng.normal(1.0, 0.5, channels), rng.uniform(1.0, 2.0, channels)]
    return [w.astype(np.float32) for w in weights]


def _run_replicas(strategy, layer, x, dy, mask=None, eager=False):
    """Each replica r runs `layer(x[r], training=True)` and back-propagates `dy[r]`.

    Returns per-replica numpy lists: outputs, input gradients, gamma gradients, beta gradients, moving
    means, moving variances.
    """
    def replica_fn(x, dy, mask):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        x_r, dy_r = tf.gather(x, replica), tf.gather(dy, replica)
        mask_r = None if mask is None else tf.gather(mask, replica)
        with tf.GradientTape() as tape:
            tape.watch(x_r)
            y = layer(x_r, training=True, mask=mask_r)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy_r)
        dx, dgamma, dbeta = tape.gradient(loss, [x_r, layer.gamma.value, layer.beta.value])
        return y, dx, dgamma, dbeta, tf.identity(layer.moving_mean.value), tf.identity(layer.moving_variance.value)

    def step(x, dy, mask):
        return strategy.run(replica_fn, args=(x, dy, mask))

    out = (step if eager else tf.function(step))(x, dy, mask)
    return [[np.asarray(tf.cast(t, tf.float32)) for t in strategy.experimental_local_results(o)] for o in out]


def _reference(x, dy, weights, mask=None, **kwargs):
    """Plain Keras batch normalization over one group's concatenated batch."""
    layer = keras.layers.BatchNormalization(**kwargs)
    layer.build(x.shape)
    layer.set_weights(weights)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True, mask=mask)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
    return [np.asarray(tf.cast(t, tf.float32)) for t in
            (y, dx, dgamma, dbeta, layer.moving_mean.value, layer.moving_variance.value)]


CASES = {
    # name: (per-replica input shape, layer kwargs, input dtype, (rtol, atol))
    "channels_last": ((3, 4, 4, 5), {}, tf.float32, (1e-5, 2e-5)),
    "channels_first": ((2, 3, 5, 3), {"axis": 1}, tf.float32, (1e-5, 2e-5)),
    "odd_channels_1d": ((5, 7), {}, tf.float32, (1e-5, 2e-5)),
    "mixed_bfloat16": ((4, 3, 3, 3), {"dtype": "mixed_bfloat16"}, tf.bfloat16, (2e-2, 5e-2)),
    "renorm": ((3, 2, 2, 5), {"renorm": True, "renorm_clipping": {"rmax": 1.5, "dmax": 0.5}}, tf.float32,
               (1e-5, 2e-5)),
}


def _check_against_groups(results, x, dy, group_size, kwargs, weights, tolerance, mask=None):
    ys, dxs, dgammas, dbetas, means, variances = results
    rtol, atol = tolerance
    for first in range(0, NUM_REPLICAS, group_size):
        members = list(range(first, first + group_size))
        group_mask = None if mask is None else tf.concat([mask[r] for r in members], 0)
        expected = _reference(tf.concat([x[r] for r in members], 0), tf.concat([dy[r] for r in members], 0),
                              weights, group_mask, **kwargs)
        y_ref, dx_ref, dgamma_ref, dbeta_ref, mean_ref, var_ref = expected
        close = dict(rtol=rtol, atol=atol)
        np.testing.assert_allclose(np.concatenate([ys[r] for r in members]), y_ref, **close)
        np.testing.assert_allclose(np.concatenate([dxs[r] for r in members]), dx_ref, **close)
        # The group's gamma/beta gradient is the sum of its members' (what the gradient all-reduce adds up).
        np.testing.assert_allclose(sum(dgammas[r] for r in members), dgamma_ref, rtol=rtol, atol=atol * 10)
        np.testing.assert_allclose(sum(dbetas[r] for r in members), dbeta_ref, rtol=rtol, atol=atol * 10)
        for r in members:
            np.testing.assert_allclose(means[r], mean_ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(variances[r], var_ref, rtol=1e-5, atol=1e-5)


def _case_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.5, 2.0, size=(NUM_REPLICAS,) + shape)
    dy = rng.normal(size=(NUM_REPLICAS,) + shape)
    return tf.constant(x, dtype), tf.constant(dy, tf.float32)


# Every case at group sizes 1, 2, 4 and 8, except the slower ones, which run at the sizes that communicate most.
CASE_SIZES = [(case, g) for case in CASES for g in (
    (4, 8) if case in ("odd_channels_1d", "renorm") else (1, 2, 4, 8))]


@pytest.mark.parametrize("case, group_size", CASE_SIZES)
def test_matches_plain_batch_norm_over_each_group(strategy, case, group_size):
    shape, kwargs, dtype, tolerance = CASES[case]
    kwargs = dict(kwargs, momentum=0.7)
    channels = shape[kwargs.get("axis", -1)]
    weights = _initial_weights(channels, seed=group_size, renorm=kwargs.get("renorm", False))
    with strategy.scope():
        layer = DistributedBatchNormalization(group_size=group_size, **kwargs)
        layer.build((None,) + shape[1:])
        layer.set_weights(weights)
    x, dy = _case_inputs(shape, dtype, seed=group_size)
    results = _run_replicas(strategy, layer, x, dy)
    _check_against_groups(results, x, dy, group_size, kwargs, weights, tolerance)


def test_eager_replicas_match_the_reference(strategy):
    shape, kwargs, dtype, tolerance = CASES["channels_last"]
    weights = _initial_weights(shape[-1], seed=7)
    with strategy.scope():
        layer = DistributedBatchNormalization(group_size=4, momentum=0.7)
        layer.build((None,) + shape[1:])
        layer.set_weights(weights)
    x, dy = _case_inputs(shape, dtype, seed=7)
    results = _run_replicas(strategy, layer, x, dy, eager=True)
    _check_against_groups(results, x, dy, 4, {"momentum": 0.7}, weights, tolerance)


def test_masked_elements_do_not_count(strategy):
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(2.0, 3.0, size=(NUM_REPLICAS, 4, 6, 3)), tf.float32)
    dy = tf.constant(rng.normal(size=(NUM_REPLICAS, 4, 6, 3)), tf.float32)
    # Different numbers of valid steps on each replica, one replica fully masked.
    lengths = rng.integers(1, 7, size=(NUM_REPLICAS, 4))
    lengths[5] = 0
    mask = tf.constant(np.arange(6)[None, None, :] < lengths[..., None])
    weights = _initial_weights(3, seed=3)
    with strategy.scope():
        layer = DistributedBatchNormalization(group_size=2, momentum=0.5)
        layer.build((None, 6, 3))
        layer.set_weights(weights)
    results = _run_replicas(strategy, layer, x, dy, mask=mask)
    _check_against_groups(results, x, dy, 2, {"momentum": 0.5}, weights, (1e-5, 2e-5), mask=mask)


def test_group_variance_is_not_an_average_of_local_variances(strategy):
    # Each replica's batch is constant: every local variance is 0, the group's is not.
    x = tf.constant(np.arange(NUM_REPLICAS, dtype=np.float32).reshape(NUM_REPLICAS, 1, 1) * np.ones((1, 4, 2)),
                    tf.float32)
    with strategy.scope():
        layer = DistributedBatchNormalization(group_size=8, momentum=0.0)
        layer.build((None, 2))
    _, _, _, _, means, variances = _run_replicas(strategy, layer, x, tf.zeros_like(x))
    for mean, variance in zip(means, variances):
        np.testing.assert_allclose(mean, [3.5, 3.5], rtol=1e-6)
        np.testing.assert_allclose(variance, [np.var(np.arange(8))] * 2, rtol=1e-6)


def test_large_mean_keeps_precision_through_the_moving_mean_shift(strategy):
    # Mean 1e4, deviation 1: E[x^2] - E[x]^2 without a shift loses the variance to float32 rounding.
    rng = np.random.default_rng(11)
    x64 = rng.normal(1e4, 1.0, size=(NUM_REPLICAS, 16, 2))
    x = tf.constant(x64, tf.float32)
    with strategy.scope():
        layer = DistributedBatchNormalization(group_size=8, momentum=0.0)
        layer.build((None, 2))
        layer.moving_mean.assign([1e4 + 0.3, 1e4 - 0.2])  # what training would have tracked
    _, _, _, _, means, variances = _run_replicas(strategy, layer, x, tf.zeros_like(x))
    exact = np.var(np.asarray(x, np.float64).reshape(-1, 2), axis=0)
    np.testing.assert_allclose(variances[0], exact, rtol=1e-4)
    np.testing.assert_allclose(means[0], np.asarray(x, np.float64).reshape(-1, 2).mean(0), rtol=1e-7)


def test_synchronized_means_all_replicas(strategy):
    shape, _, dtype, tolerance = CASES["odd_channels_1d"]
    weights = _initial_weights(shape[-1], seed=5)
    with strategy.scope():
        layer = DistributedBatchNormalization(synchronized=True, momentum=0.7)
        layer.build((None,) + shape[1:])
        layer.set_weights(weights)
    x, dy = _case_inputs(shape, dtype, seed=5)
    results = _run_replicas(strategy, layer, x, dy)
    _check_against_groups(results, x, dy, 8, {"momentum": 0.7}, weights, tolerance)


def _count_ops(graph, op_type):
    count = sum(op.type == op_type for op in graph.get_operations())
    for function in graph._functions.values():
        count += sum(op.type == op_type for op in function.graph.get_operations())
    return count


def test_one_group_sum_per_training_call(strategy):
    with strategy.scope():
        first = DistributedBatchNormalization(group_size=4)
        second = DistributedBatchNormalization(group_size=2)
        first.build((None, 3))
        second.build((None, 3))

    @tf.function
    def forward(x):
        def replica_fn(x):
            y = first(x, training=True)
            y = second(y, training=True)
            return first(y, training=True), first(y, training=False)
        return strategy.run(replica_fn, args=(x,))

    graph = forward.get_concrete_function(tf.TensorSpec([4, 3], tf.float32)).graph
    # On one host the statistics are summed in the step's graph: one AddN per group and training call
    # (2 + 4 + 2 groups); the inference call communicates nothing, and no collective op is launched.
    assert _count_ops(graph, "AddN") == 2 + 4 + 2
    assert not [op for op in graph.get_operations() if op.type.startswith("Collective")]


# --------------------------------------------------------------------------- TPU graphs


def _topology(x, y, cores=2):
    """A TPU v3-like slice of x*y chips, built without hardware."""
    coords = [[i, j, 0, c] for j in range(y) for i in range(x) for c in range(cores)]
    return tf.tpu.experimental.Topology(mesh_shape=[x, y, 1, cores], device_coordinates=np.array([coords]))


def _chip_tiles(x, y, tile_x, tile_y, cores=2):
    """Expected groups: every tile_x x tile_y block of chips, with both cores of each chip."""
    chip_of = {}
    for index, (i, j) in enumerate((i, j) for j in range(y) for i in range(x)):
        for c in range(cores):
            chip_of[index * cores + c] = (i, j)
    tiles = {}
    for replica, (i, j) in chip_of.items():
        tiles.setdefault((i // tile_x, j // tile_y), []).append(replica)
    return sorted(tuple(sorted(t)) for t in tiles.values())


def _tpu_training_graph(mesh, per_replica_shape, group_size, calls=2, gradients=False):
    graph = tf.Graph()
    with graph.as_default(), context.tpu_graph(mesh):
        layer = DistributedBatchNormalization(group_size=group_size)
        x = tf.compat.v1.placeholder(tf.float32, per_replica_shape)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for _ in range(calls):
                y = layer(y, training=True)
            layer(y, training=False)
        if gradients:
            tape.gradient(y, x)
    sums = [op for op in graph.get_operations() if op.type == "CrossReplicaSum"]
    assignments = [sorted(tuple(g) for g in tf.get_static_value(op.inputs[1]).tolist()) for op in sums]
    return sums, assignments


@pytest.mark.parametrize("chips, group_size, tile", [
    ((2, 2), 2, (1, 1)), ((2, 2), 8, (2, 2)),
    ((4, 4), 8, (2, 2)), ((4, 4), 32, (4, 4)),
])
def test_tpu_graph_has_one_cross_replica_sum_per_call(chips, group_size, tile):
    mesh = ReplicaMesh.from_topology(_topology(*chips))
    sums, assignments = _tpu_training_graph(mesh, [4, 3, 3, 5], group_size, calls=2)
    assert len(sums) == 2
    for op, assignment in zip(sums, assignments):
        assert assignment == _chip_tiles(*chips, *tile)
        assert op.inputs[0].dtype == tf.float32 and op.inputs[0].shape.as_list() == [3, 5]


def test_tpu_graph_gradient_is_one_more_group_sum():
    mesh = ReplicaMesh.from_topology(_topology(4, 4))
    sums, assignments = _tpu_training_graph(mesh, [4, 3], 8, calls=1, gradients=True)
    assert len(sums) == 2 and assignments[0] == assignments[1] == _chip_tiles(4, 4, 2, 2)


@pytest.mark.parametrize("per_replica_batch, group_size, tile", [(16, 4, (2, 1)), (8, 8, (2, 2)), (64, 1, None)])
def test_default_group_reaches_a_span_of_64(per_replica_batch, group_size, tile):
    mesh = ReplicaMesh.from_topology(_topology(4, 4))
    sums, assignments = _tpu_training_graph(mesh, [per_replica_batch, 3], None, calls=1)
    if group_size == 1:
        assert not sums  # a replica's own batch already spans 64 examples
    else:
        assert len(sums) == 1 and assignments[0] == _chip_tiles(4, 4, *tile)


def test_default_group_needs_a_static_batch():
    mesh = ReplicaMesh.from_topology(_topology(2, 2))
    with pytest.raises(ValueError, match="batch dimension is unknown.*drop_remainder"):
        _tpu_training_graph(mesh, [None, 3], None, calls=1)


# --------------------------------------------------------------------------- errors


def test_group_size_that_does_not_divide_the_replicas(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match=r"group_size=3 does not divide the 8 replicas.*\[1, 2, 4, 8\]"):
            DistributedBatchNormalization(group_size=3).build((None, 4))
    layer = DistributedBatchNormalization(group_size=16)
    layer.build((None, 4))  # no strategy yet: checked at the first training call
    with pytest.raises(ValueError, match=r"group_size=16 does not divide the 8 replicas"):
        strategy.run(tf.function(lambda: layer(tf.ones([2, 4]), training=True)))


@pytest.mark.parametrize("kwargs, message", [
    ({"group_size": 0}, "positive int"),
    ({"group_size": 2.0}, "positive int"),
    ({"group_size": 1, "synchronized": True}, "only one of them"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedBatchNormalization(**kwargs)


def test_behaves_like_keras_without_a_strategy():
    x = np.random.default_rng(0).normal(5.0, 3.0, size=(6, 4)).astype(np.float32)
    ours, keras_bn = DistributedBatchNormalization(group_size=4), keras.layers.BatchNormalization()
    np.testing.assert_array_equal(ours(x, training=True), keras_bn(x, training=True))
    np.testing.assert_array_equal(ours.moving_variance.numpy(), keras_bn.moving_variance.numpy())


@pytest.mark.parametrize("kwargs", [{}, {"scale": False, "center": False}, {"epsilon": 0.1, "momentum": 0.5}])
def test_four_d_training_matches_keras_without_a_strategy(kwargs):
    # 4-D channels-last training calls normalize with the fused kernel: same values as Keras's element-wise
    # ops up to rounding, same moving statistics, same gradients.
    x = tf.constant(np.random.default_rng(1).normal(2.0, 3.0, size=(3, 5, 4, 7)).astype(np.float32))
    ours, keras_bn = DistributedBatchNormalization(**kwargs), keras.layers.BatchNormalization(**kwargs)
    outputs, grads = [], []
    for layer in (ours, keras_bn):
        layer.build(x.shape)
        if layer.scale:
            layer.gamma.assign(np.linspace(0.5, 2.0, 7))
            layer.beta.assign(np.linspace(-1.0, 1.0, 7))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.range(7, dtype=tf.float32) * y)
        outputs.append(y)
        grads.append(tape.gradient(loss, [x] + layer.trainable_weights))
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads[0], grads[1]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours.moving_mean.numpy(), keras_bn.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours.moving_variance.numpy(), keras_bn.moving_variance.numpy(), rtol=1e-6)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_fit_without_a_strategy_matches_keras(jit_compile):
    # The fused kernels and written-out gradients also compile with XLA (`jit_compile`, Keras's default
    # when it can) and train exactly as Keras's layer does.
    x = np.random.default_rng(2).random((32, 8, 8, 3)).astype(np.float32)
    y = np.random.default_rng(3).integers(0, 2, 32)
    losses = []
    for norm in (DistributedBatchNormalization, keras.layers.BatchNormalization):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.GlobalAveragePooling2D()(norm()(keras.layers.Conv2D(4, 3)(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(2)(h))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile)
        losses.append(model.fit(x, y, epochs=3, batch_size=8, verbose=0, shuffle=False).history["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@pytest.mark.parametrize("shape, kwargs, mask, fused", [
    ((2, 3, 3, 4), {}, False, True),
    ((2, 3, 3, 4), {"dtype": "mixed_bfloat16"}, False, True),
    ((2, 3, 3, 4), {"axis": 1}, False, False),  # the kernel here takes NHWC only
    ((2, 3, 3, 4), {}, True, False),  # masked statistics
    ((2, 3, 3, 4), {"renorm": True}, False, False),
    ((2, 5, 4), {}, False, False),  # 3-D
])
def test_fused_kernel_only_where_its_contract_holds(shape, kwargs, mask, fused):
    layer = DistributedBatchNormalization(**kwargs)
    layer.build(shape)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            m = tf.ones(shape[:-1], tf.bool) if mask else None
            loss = tf.reduce_sum(tf.cast(layer(x, training=True, mask=m), tf.float32) ** 2)
        return tape.gradient(loss, x), layer(x, training=False)

    graph = step.get_concrete_function(tf.TensorSpec(shape, layer.compute_dtype)).graph
    assert (_count_ops(graph, "FusedBatchNormV3"), _count_ops(graph, "FusedBatchNormGradV3")) == (
        (1, 1) if fused else (0, 0))


# --------------------------------------------------------------------------- model.fit


def _conv_model(group_size, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
        DistributedBatchNormalization(group_size=group_size, momentum=0.5),
        keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3),
    ])


def _dataset(steps=3, per_replica_batch=2):
    rng = np.random.default_rng(0)
    n = steps * per_replica_batch * NUM_REPLICAS
    x = rng.normal(1.0, 2.0, size=(n, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica_batch * NUM_REPLICAS, drop_remainder=True)


def _fit(strategy, group_size, run_eagerly):
    with strategy.scope():
        model = _conv_model(group_size)
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=run_eagerly)
    history = model.fit(_dataset(), epochs=1, verbose=0)
    bn = model.layers[1]
    moving = [np.asarray(v) for v in bn.moving_mean.value.values]
    return model, history, moving


def test_fit_under_the_strategy_graph_and_eager_agree(strategy):
    graph_model, history, moving = _fit(strategy, group_size=4, run_eagerly=False)
    assert np.isfinite(history.history["loss"][0])
    # Both groups of 4 keep their own moving statistics, identical inside a group.
    for r in range(NUM_REPLICAS):
        np.testing.assert_array_equal(moving[r], moving[4 * (r // 4)])
    assert not np.allclose(moving[0], moving[4])
    eager_model, _, eager_moving = _fit(strategy, group_size=4, run_eagerly=True)
    for a, b in zip(graph_model.get_weights(), eager_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(moving, eager_moving, rtol=1e-4, atol=1e-5)


def test_default_group_in_fit(strategy):
    # 2 examples per replica never reach 64: the span rule falls back to all 8 replicas.
    _, _, moving = _fit(strategy, group_size=None, run_eagerly=False)
    for r in range(NUM_REPLICAS):
        np.testing.assert_array_equal(moving[r], moving[0])


# --------------------------------------------------------------------------- saving and conversion


def test_save_and_load_round_trip(tmp_path):
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4),
        DistributedBatchNormalization(group_size=2, momentum=0.9, epsilon=1e-4, renorm=True,
                                      renorm_clipping={"rmax": 2.0}),
    ])
    layer = model.layers[1]
    layer.set_weights(_initial_weights(4, seed=1, renorm=True))
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_layer = loaded.layers[1]
    assert type(loaded_layer) is DistributedBatchNormalization
    assert loaded_layer.get_config() == layer.get_config()
    assert loaded_layer.get_config()["group_size"] == 2
    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_convert_resnet50_keeps_inference_outputs():
    model = keras.applications.ResNet50(weights=None)
    rng = np.random.default_rng(0)
    # Random statistics and affine parameters, so a weight left behind would change the outputs.
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.set_weights(_initial_weights(layer.gamma.shape[0], seed=int(rng.integers(1 << 30))))
    converted = convert_batch_normalization(model, group_size=4)
    old_bn = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    new_bn = [l for l in converted.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert len(new_bn) == len(old_bn) == 53
    assert all(type(l) is DistributedBatchNormalization and l.group_size == 4 for l in new_bn)
    assert not any(type(l) is DistributedBatchNormalization for l in model.layers)
    x = rng.uniform(0, 255, size=(2, 224, 224, 3)).astype(np.float32)
    np.testing.assert_array_equal(converted(x, training=False), model(x, training=False))


def test_convert_rejects_subclassed_models():
    class Net(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="subclassed"):
        convert_batch_normalization(Net())


# --------------------------------------------------------------------------- multi-worker


def worker_fit():
    """Runs in each of 2 workers x 2 CPUs: fits with local and with cross-worker groups; returns the results."""
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]), gradient_reduction="native")
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(64, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=64)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True).with_options(options)
    results = {"mesh": strategy.mesh.shape}
    for group_size in (1, 4):
        with strategy.scope():
            model = _conv_model(group_size)
            model.compile(keras.optimizers.SGD(0.1),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(dataset, epochs=1, verbose=0)
        results[group_size] = {
            "loss": history.history["loss"],
            "weights": [w.numpy() for w in model.trainable_weights],
            "moving_means": [np.asarray(v) for v in model.layers[1].moving_mean.value.values],
        }
    return results


def test_two_workers_fit_with_a_group_across_workers():
    first, second = run_workers(f"{__name__}:worker_fit", num_workers=2, cpus_per_worker=2, timeout=300)
    assert first["mesh"] == second["mesh"] == (2, 2)
    # With local statistics the four replicas disagree (they saw different examples)...
    local_means = first[1]["moving_means"] + second[1]["moving_means"]
    assert len(local_means) == 4 and not np.allclose(local_means[0], local_means[2])
    # ...with one group of 4 spanning both workers they all hold the same statistics.
    grouped_means = first[4]["moving_means"] + second[4]["moving_means"]
    for mean in grouped_means[1:]:
        np.testing.assert_allclose(mean, grouped_means[0], rtol=1e-6)
    for a, b in zip(first[4]["weights"], second[4]["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert np.all(np.isfinite(first[4]["loss"]))
