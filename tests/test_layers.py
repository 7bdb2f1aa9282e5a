"""`DistributedBatchNormalization` against plain batch norm over each group's concatenated batch."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale.distribute import context
from tpu_scale.distribute.mesh import ReplicaMesh
from tpu_scale.distribute.strategy import mesh_of
from tpu_scale.layers import (
    DistributedBatchNormalization,
    average_moving_statistics,
    convert_batch_normalization,
)
from tpu_scale.layers.batch_normalization import keras_has_renorm
from tpu_scale.testing import run_workers

NUM_REPLICAS = 8

# Batch renormalization is Keras's own (keras-team/keras#22047); Keras 3.12 has none.
NEEDS_RENORM = pytest.mark.skipif(
    not keras_has_renorm(), reason=f"Keras {keras.__version__}'s BatchNormalization has no renorm"
)


def _initial_weights(channels, seed, renorm=False):
    """Non-trivial gamma, beta and moving statistics: the moving-mean shift and updates matter."""
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


def _layer_under(strategy, features_shape, weights, **kwargs):
    """`DistributedBatchNormalization(**kwargs)` made in `strategy`'s scope, built for examples
    of `features_shape` (the shape without the batch) and set to `weights`."""
    with strategy.scope():
        layer = DistributedBatchNormalization(**kwargs)
        layer.build((None,) + tuple(features_shape))
        layer.set_weights(weights)
    return layer


def _run_replicas(strategy, layer, x, dy, mask=None, eager=False):
    """Each replica r runs `layer(x[r], training=True)` and back-propagates `dy[r]`.

    Returns per-replica numpy lists: outputs, input gradients, gamma gradients, beta gradients,
    moving means, moving variances.
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
        return (
            y,
            dx,
            dgamma,
            dbeta,
            tf.identity(layer.moving_mean.value),
            tf.identity(layer.moving_variance.value),
        )

    def step(x, dy, mask):
        return strategy.run(replica_fn, args=(x, dy, mask))

    out = (step if eager else tf.function(step))(x, dy, mask)
    return [
        [np.asarray(tf.cast(t, tf.float32)) for t in strategy.experimental_local_results(o)]
        for o in out
    ]


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
    return [
        np.asarray(tf.cast(t, tf.float32))
        for t in (y, dx, dgamma, dbeta, layer.moving_mean.value, layer.moving_variance.value)
    ]


CASES = {
    # name: (per-replica input shape, layer kwargs, input dtype, (rtol, atol))
    "channels_last": ((3, 4, 4, 5), {}, tf.float32, (1e-5, 2e-5)),
    "channels_first": ((2, 3, 5, 3), {"axis": 1}, tf.float32, (1e-5, 2e-5)),
    "odd_channels_1d": ((5, 7), {}, tf.float32, (1e-5, 2e-5)),
    "mixed_bfloat16": ((4, 3, 3, 3), {"dtype": "mixed_bfloat16"}, tf.bfloat16, (2e-2, 5e-2)),
    "renorm": (
        (3, 2, 2, 5),
        {"renorm": True, "renorm_clipping": {"rmax": 1.5, "dmax": 0.5}},
        tf.float32,
        (1e-5, 2e-5),
    ),
}


def _check_against_groups(results, x, dy, group_size, kwargs, weights, tolerance, mask=None):
    ys, dxs, dgammas, dbetas, means, variances = results
    rtol, atol = tolerance
    group_moving = []
    for first in range(0, NUM_REPLICAS, group_size):
        members = list(range(first, first + group_size))
        group_mask = None if mask is None else tf.concat([mask[r] for r in members], 0)
        expected = _reference(
            tf.concat([x[r] for r in members], 0),
            tf.concat([dy[r] for r in members], 0),
            weights,
            group_mask,
            **kwargs,
        )
        y_ref, dx_ref, dgamma_ref, dbeta_ref, mean_ref, var_ref = expected
        close = dict(rtol=rtol, atol=atol)
        np.testing.assert_allclose(np.concatenate([ys[r] for r in members]), y_ref, **close)
        np.testing.assert_allclose(np.concatenate([dxs[r] for r in members]), dx_ref, **close)
        # The group's gamma/beta gradient is the sum of its members' (what the gradient all-reduce
        # adds up).
        np.testing.assert_allclose(
            sum(dgammas[r] for r in members), dgamma_ref, rtol=rtol, atol=atol * 10
        )
        np.testing.assert_allclose(
            sum(dbetas[r] for r in members), dbeta_ref, rtol=rtol, atol=atol * 10
        )
        group_moving.append((mean_ref, var_ref))
    # One set of moving statistics: every replica moved by the mean of the groups' updates.
    _check_shared_moving_statistics(means, variances, group_moving)


def _check_shared_moving_statistics(means, variances, updates):
    """Every replica holds the mean of `updates` (each group's `(moving mean, moving variance)` as
    plain batch norm over its batch leaves them; they all started equal, so this is Keras's update
    from the groups' mean statistics)."""
    expected_mean, expected_variance = np.mean(updates, axis=0)
    for mean, variance in zip(means, variances):
        np.testing.assert_allclose(mean, expected_mean, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(variance, expected_variance, rtol=1e-5, atol=1e-5)


def _case_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.5, 2.0, size=(NUM_REPLICAS,) + shape)
    dy = rng.normal(size=(NUM_REPLICAS,) + shape)
    return tf.constant(x, dtype), tf.constant(dy, tf.float32)


# Every case at group sizes 1, 2, 4 and 8, except the slower ones, which run at the sizes that
# communicate most.
CASE_SIZES = [
    pytest.param(case, g, marks=NEEDS_RENORM) if case == "renorm" else (case, g)
    for case in CASES
    for g in ((4, 8) if case in ("odd_channels_1d", "renorm") else (1, 2, 4, 8))
]


@pytest.mark.parametrize("case, group_size", CASE_SIZES)
def test_matches_plain_batch_norm_over_each_group(strategy, case, group_size):
    shape, kwargs, dtype, tolerance = CASES[case]
    kwargs = dict(kwargs, momentum=0.7)
    channels = shape[kwargs.get("axis", -1)]
    weights = _initial_weights(channels, seed=group_size, renorm=kwargs.get("renorm", False))
    layer = _layer_under(strategy, shape[1:], weights, group_size=group_size, **kwargs)
    x, dy = _case_inputs(shape, dtype, seed=group_size)
    results = _run_replicas(strategy, layer, x, dy)
    _check_against_groups(results, x, dy, group_size, kwargs, weights, tolerance)


def test_eager_replicas_match_the_reference(strategy):
    shape, kwargs, dtype, tolerance = CASES["channels_last"]
    weights = _initial_weights(shape[-1], seed=7)
    layer = _layer_under(strategy, shape[1:], weights, group_size=4, momentum=0.7)
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
    layer = _layer_under(strategy, (6, 3), weights, group_size=2, momentum=0.5)
    results = _run_replicas(strategy, layer, x, dy, mask=mask)
    _check_against_groups(results, x, dy, 2, {"momentum": 0.5}, weights, (1e-5, 2e-5), mask=mask)


def _check_against_virtual_batches(results, x, dy, size, kwargs, weights, tolerance, mask=None):
    """Each replica's outputs and gradients are plain batch norm's over each run of `size` of its
    examples; its moving statistics moved towards the runs' mean and variance, weighted by the
    elements each counted."""
    ys, dxs, dgammas, dbetas, means, variances = results
    close = dict(rtol=tolerance[0], atol=tolerance[1])
    replica_moving = []
    for r in range(len(ys)):
        expected, counts = [], []
        for first in range(0, x.shape[1], size):
            part = slice(first, first + size)
            part_mask = None if mask is None else mask[r][part]
            expected.append(_reference(x[r][part], dy[r][part], weights, part_mask, **kwargs))
            # Elements counted per channel: the examples' (all of the same size), or the mask's.
            counts.append(len(x[r][part]) if mask is None else np.sum(part_mask))
        y_ref, dx_ref, dgamma_ref, dbeta_ref, mean_ref, var_ref = zip(*expected)
        np.testing.assert_allclose(ys[r], np.concatenate(y_ref), **close)
        np.testing.assert_allclose(dxs[r], np.concatenate(dx_ref), **close)
        np.testing.assert_allclose(
            dgammas[r], sum(dgamma_ref), rtol=close["rtol"], atol=close["atol"] * 10
        )
        np.testing.assert_allclose(
            dbetas[r], sum(dbeta_ref), rtol=close["rtol"], atol=close["atol"] * 10
        )
        # Each reference moved from the same start, so their count-weighted average moved
        # towards the count-weighted average of the runs' statistics.
        share = np.asarray(counts) / np.sum(counts)
        replica_moving.append((np.tensordot(share, mean_ref, 1), np.tensordot(share, var_ref, 1)))
    # Every replica then takes the mean of the replicas' updates.
    _check_shared_moving_statistics(means, variances, replica_moving)


@pytest.mark.parametrize(
    "shape, kwargs, size",
    [
        ((8, 4, 4, 5), {}, 4),  # two virtual batches of 4
        ((7, 3, 3, 5), {}, 3),  # 3, 3 and what is left, 1
        ((6, 3, 5, 3), {"axis": 1}, 2),  # channels first
        ((5, 7), {}, 2),
        ((4, 3, 3, 3), {"dtype": "mixed_bfloat16"}, 2),
    ],
)
def test_virtual_batches_match_plain_batch_norm_over_each(strategy, shape, kwargs, size):
    kwargs = dict(kwargs, momentum=0.7)
    dtype = tf.bfloat16 if "dtype" in kwargs else tf.float32
    tolerance = (2e-2, 5e-2) if "dtype" in kwargs else (1e-5, 2e-5)
    weights = _initial_weights(shape[kwargs.get("axis", -1)], seed=size)
    layer = _layer_under(strategy, shape[1:], weights, virtual_batch_size=size, **kwargs)
    x, dy = _case_inputs(shape, dtype, seed=size)
    results = _run_replicas(strategy, layer, x, dy)
    _check_against_virtual_batches(results, x, dy, size, kwargs, weights, tolerance)


def test_virtual_batches_without_a_strategy_and_with_a_mask():
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(2.0, 3.0, size=(1, 6, 5, 3)), tf.float32)
    dy = tf.constant(rng.normal(size=(1, 6, 5, 3)), tf.float32)
    lengths = rng.integers(1, 6, size=(1, 6))
    lengths[0, 2:4] = 0  # the second virtual batch counts nothing
    mask = tf.constant(np.arange(5)[None, None, :] < lengths[..., None])
    weights = _initial_weights(3, seed=4)
    layer = DistributedBatchNormalization(virtual_batch_size=2, momentum=0.5)
    layer.build((None, 5, 3))
    layer.set_weights(weights)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x[0], training=True, mask=mask[0])
        loss = tf.reduce_sum(y * dy[0])
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
    results = [
        [np.asarray(t)]
        for t in (y, dx[0], dgamma, dbeta, layer.moving_mean.value, layer.moving_variance.value)
    ]
    _check_against_virtual_batches(
        results, x, dy, 2, {"momentum": 0.5}, weights, (1e-5, 2e-5), mask=mask
    )


def test_virtual_batches_need_no_group(strategy):
    with strategy.scope():
        layer = DistributedBatchNormalization(virtual_batch_size=4)
        layer.build((None, 3))
    mesh = mesh_of(strategy)
    assert layer._group_size_for(mesh, tf.ones([64, 3])) == 1
    restored = DistributedBatchNormalization.from_config(layer.get_config())
    assert restored.virtual_batch_size == 4 and restored.group_size is None


def test_group_variance_is_not_an_average_of_local_variances(strategy):
    # Each replica's batch is constant: every local variance is 0, the group's is not.
    x = tf.constant(
        np.arange(NUM_REPLICAS, dtype=np.float32).reshape(NUM_REPLICAS, 1, 1) * np.ones((1, 4, 2)),
        tf.float32,
    )
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
    np.testing.assert_allclose(
        means[0], np.asarray(x, np.float64).reshape(-1, 2).mean(0), rtol=1e-7
    )


def test_synchronized_means_all_replicas(strategy):
    shape, _, dtype, tolerance = CASES["odd_channels_1d"]
    weights = _initial_weights(shape[-1], seed=5)
    layer = _layer_under(strategy, shape[1:], weights, synchronized=True, momentum=0.7)
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
    # On one host the members' statistics are gathered in the step's graph: one ConcatV2 per
    # group and training call (2 + 4 + 2 groups); each training call's moving statistics are
    # summed over all 8 replicas by one AddN; the inference call communicates nothing, and no
    # collective op is launched.
    assert _count_ops(graph, "ConcatV2") == 2 + 4 + 2
    assert _count_ops(graph, "AddN") == 3
    assert not [op for op in graph.get_operations() if op.type.startswith("Collective")]


# ------------------------------------------------------------------------ empty and uneven batches

# name: (per-replica batch sizes, group size). The last batch of an epoch batched with
# `drop_remainder=False` splits like these, with replicas left empty.
BATCH_PATTERNS = {
    "one_empty_member": ([3, 0, 2, 1, 2, 2, 0, 3], 4),
    "all_but_one_empty": ([0, 0, 3, 0, 0, 1, 0, 0], 4),
    "whole_groups_empty": ([0, 0, 2, 3, 2, 0, 0, 0], 2),  # groups (0, 1) and (6, 7) have nothing
    "uneven": ([1, 2, 3, 4, 5, 1, 2, 7], 8),
    "local_empty": ([2, 0, 1, 3, 0, 2, 1, 0], 1),  # local statistics: an empty replica is a group
}
# name: (example shape, layer kwargs). "fused" takes the FusedBatchNormV3 path; "masked" counts a
# random prefix of each example's 6 steps, none at all on replicas 2 and 3.
BATCH_PATHS = {
    "fused": ((3, 3, 4), {}),
    "channels_first": ((4, 3, 3), {"axis": 1}),
    "dense": ((5,), {}),
    "masked": ((6, 3), {}),
    "renorm": ((5,), {"renorm": True, "renorm_clipping": {"rmax": 1.5, "dmax": 0.5}}),
}
BATCH_CASES = [
    (pattern, path, True)
    for pattern in BATCH_PATTERNS
    for path in ("fused", "channels_first", "dense")
]
BATCH_CASES += [
    pytest.param("whole_groups_empty", "renorm", True, marks=NEEDS_RENORM),
    ("whole_groups_empty", "masked", True),
    ("one_empty_member", "masked", True),
    ("local_empty", "masked", True),
    ("whole_groups_empty", "fused", False),
    ("whole_groups_empty", "dense", False),
]


def _run_uneven_replicas(strategy, layer, xs, dys, masks=None, dynamic_batch=True):
    """Each replica r runs `layer(xs[r], training=True)` on its own batch, of any size, and
    back-propagates `dys[r]`; with `dynamic_batch` the batch dimension is unknown in the graph, as
    in a partial batch from a dataset.

    Returns per-replica numpy lists: outputs, input gradients, gamma gradients, beta gradients, and
    the layer's non-trainable weights (moving statistics).
    """

    def per_replica(values):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: values[ctx.replica_id_in_sync_group]
        )

    def replica_fn(x, dy, mask):
        if dynamic_batch:
            x = tf.compat.v1.placeholder_with_default(x, [None] + x.shape[1:])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
            loss = tf.reduce_sum(y * dy)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
        return y, dx, dgamma, dbeta, [tf.identity(w.value) for w in layer.non_trainable_weights]

    masks = None if masks is None else per_replica(masks)
    out = tf.function(lambda x, dy, mask: strategy.run(replica_fn, args=(x, dy, mask)))(
        per_replica(xs), per_replica(dys), masks
    )
    local = strategy.experimental_local_results
    ys, dxs, dgammas, dbetas = ([np.asarray(t) for t in local(o)] for o in out[:4])
    stats = [[np.asarray(t) for t in local(w)] for w in out[4]]
    return ys, dxs, dgammas, dbetas, [list(s) for s in zip(*stats)]


@pytest.mark.parametrize("pattern, path, dynamic_batch", BATCH_CASES)
def test_empty_and_uneven_replica_batches_match_the_reference(
    strategy, pattern, path, dynamic_batch
):
    sizes, group_size = BATCH_PATTERNS[pattern]
    shape, kwargs = BATCH_PATHS[path]
    kwargs = dict(kwargs, momentum=0.7)
    channels = ((None,) + shape)[kwargs.get("axis", -1)]
    weights = _initial_weights(channels, seed=sum(sizes), renorm=kwargs.get("renorm", False))
    layer = _layer_under(strategy, shape, weights, group_size=group_size, **kwargs)
    rng = np.random.default_rng(len(sizes) + group_size)
    xs = [tf.constant(rng.normal(1.5, 2.0, size=(n,) + shape), tf.float32) for n in sizes]
    dys = [tf.constant(rng.normal(size=(n,) + shape), tf.float32) for n in sizes]
    masks = None
    if path == "masked":
        lengths = [
            rng.integers(0 if r in (2, 3) else 1, 1 if r in (2, 3) else 7, size=n)
            for r, n in enumerate(sizes)
        ]
        masks = [tf.constant(np.arange(shape[0]) < length[:, None]) for length in lengths]
    ys, dxs, dgammas, dbetas, stats = _run_uneven_replicas(
        strategy, layer, xs, dys, masks, dynamic_batch
    )
    for values in (ys, dxs, dgammas, dbetas, stats):
        assert all(np.all(np.isfinite(v)) for v in values)
    close = {"rtol": 1e-5, "atol": 2e-5}
    group_moving = []
    counted = [n if masks is None else int(np.sum(m)) for n, m in zip(sizes, masks or sizes)]
    for first in range(0, NUM_REPLICAS, group_size):
        members = range(first, first + group_size)
        for r in members:
            assert ys[r].shape == dxs[r].shape == (sizes[r],) + shape
            if sizes[r] == 0:  # an empty replica contributes nothing
                np.testing.assert_array_equal(dgammas[r], 0.0)
                np.testing.assert_array_equal(dbetas[r], 0.0)
        if sum(sizes[r] for r in members) == 0:
            continue
        group_mask = None if masks is None else tf.concat([masks[r] for r in members], 0)
        x_group = tf.concat([xs[r] for r in members], 0)
        dy_group = tf.concat([dys[r] for r in members], 0)
        y_ref, dx_ref, dgamma_ref, dbeta_ref, mean_ref, var_ref = _reference(
            x_group, dy_group, weights, group_mask, **kwargs
        )
        np.testing.assert_allclose(np.concatenate([ys[r] for r in members]), y_ref, **close)
        np.testing.assert_allclose(np.concatenate([dxs[r] for r in members]), dx_ref, **close)
        # The group's gamma/beta gradient is the sum of its members'.
        for got, want in ((dgammas, dgamma_ref), (dbetas, dbeta_ref)):
            np.testing.assert_allclose(sum(got[r] for r in members), want, rtol=1e-5, atol=2e-4)
        if sum(counted[r] for r in members) > 0:
            group_moving.append((mean_ref, var_ref))
    # One set of moving statistics (all of them with renorm): the mean of the updates of the groups
    # that counted something; groups that counted nothing add nothing to it.
    assert group_moving
    _check_shared_moving_statistics([s[0] for s in stats], [s[1] for s in stats], group_moving)
    for r in range(NUM_REPLICAS):
        for got, first in zip(stats[r], stats[0]):
            np.testing.assert_array_equal(got, first)


def test_no_replica_counting_anything_keeps_the_moving_statistics(strategy):
    weights = _initial_weights(3, seed=9)
    layer = _layer_under(strategy, (3,), weights, group_size=2, momentum=0.7)
    xs = [tf.zeros((0, 3))] * NUM_REPLICAS
    *_, stats = _run_uneven_replicas(strategy, layer, xs, xs)
    for r in range(NUM_REPLICAS):
        for got, initial in zip(stats[r], weights[2:]):
            np.testing.assert_array_equal(got, initial)


def test_empty_batch_without_a_strategy_keeps_the_moving_statistics():
    # Keras's layer takes the 0 / 0 moments of an empty batch: NaN moving statistics and gamma
    # gradient.
    for shape in ((0, 3), (0, 2, 2, 3)):
        layer = DistributedBatchNormalization()
        layer.build((None,) + shape[1:])
        layer.set_weights(_initial_weights(3, seed=0))
        before = [w.numpy() for w in layer.non_trainable_weights]
        with tf.GradientTape() as tape:
            y = layer(tf.zeros(shape), training=True)
            loss = tf.reduce_sum(y)
        gradients = tape.gradient(loss, [layer.gamma, layer.beta])
        assert y.shape == shape
        for gradient in gradients:
            np.testing.assert_array_equal(gradient, 0.0)
        for got, want in zip(layer.non_trainable_weights, before):
            np.testing.assert_array_equal(got.numpy(), want)


# --------------------------------------------------------------------------- TPU graphs


def _topology(x, y, cores=2):
    """A TPU v3-like slice of x*y chips, built without hardware."""
    coords = [[i, j, 0, c] for j in range(y) for i in range(x) for c in range(cores)]
    return tf.tpu.experimental.Topology(
        mesh_shape=[x, y, 1, cores], device_coordinates=np.array([coords])
    )


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
    # The forward pass gathers the members' statistics (an all-to-all of copies on TPU), the
    # backward pass sums the upstream gradients. Where groups are smaller than the mesh, each
    # training call also sums its moving statistics' update over all replicas: [mean, variance,
    # weight] x channels, in one group.
    found = [op for op in graph.get_operations() if op.type in ("AllToAll", "CrossReplicaSum")]
    everyone = [tuple(range(mesh.num_replicas))]

    def groups(op):
        return sorted(tuple(g) for g in tf.get_static_value(op.inputs[1]).tolist())

    shared = [
        op
        for op in found
        if op.type == "CrossReplicaSum"
        and groups(op) == everyone
        and op.inputs[0].shape[0] == 3
    ]
    found = [op for op in found if op not in shared]
    resolved = layer._resolved[1] if group_size is None else group_size
    expected_shared = 0 if resolved == mesh.num_replicas else calls
    assert len(shared) == expected_shared, [op.inputs[0].shape for op in shared]
    return found, [groups(op) for op in found]


@pytest.mark.parametrize(
    "chips, group_size, tile",
    [
        ((2, 2), 2, (1, 1)),
        ((2, 2), 8, (2, 2)),
        ((4, 4), 8, (2, 2)),
        ((4, 4), 32, (4, 4)),
    ],
)
def test_tpu_graph_has_one_gather_per_call(chips, group_size, tile):
    mesh = ReplicaMesh.from_topology(_topology(*chips))
    ops, assignments = _tpu_training_graph(mesh, [4, 3, 3, 5], group_size, calls=2)
    assert [op.type for op in ops] == ["AllToAll", "AllToAll"]
    for op, assignment in zip(ops, assignments):
        assert assignment == _chip_tiles(*chips, *tile)
        # Each member's count, mean and variance of 5 channels, one copy per member.
        shape = op.inputs[0].shape.as_list()
        assert op.inputs[0].dtype == tf.float32 and shape == [group_size, 3, 5]


def test_tpu_graph_gradient_is_one_group_sum():
    mesh = ReplicaMesh.from_topology(_topology(4, 4))
    ops, assignments = _tpu_training_graph(mesh, [4, 3], 8, calls=1, gradients=True)
    assert sorted(op.type for op in ops) == ["AllToAll", "CrossReplicaSum"]
    assert assignments[0] == assignments[1] == _chip_tiles(4, 4, 2, 2)


@pytest.mark.parametrize(
    "per_replica_batch, group_size, tile", [(16, 4, (2, 1)), (8, 8, (2, 2)), (64, 1, None)]
)
def test_default_group_reaches_a_span_of_64(per_replica_batch, group_size, tile):
    mesh = ReplicaMesh.from_topology(_topology(4, 4))
    gathers, assignments = _tpu_training_graph(mesh, [per_replica_batch, 3], None, calls=1)
    if group_size == 1:
        assert not gathers  # a replica's own batch already spans 64 examples
    else:
        assert len(gathers) == 1 and assignments[0] == _chip_tiles(4, 4, *tile)


def test_default_group_needs_a_static_batch():
    mesh = ReplicaMesh.from_topology(_topology(2, 2))
    with pytest.raises(ValueError, match="batch dimension is unknown.*drop_remainder"):
        _tpu_training_graph(mesh, [None, 3], None, calls=1)


# --------------------------------------------------------------------------- errors


def test_group_size_that_does_not_divide_the_replicas(strategy):
    with strategy.scope():
        with pytest.raises(
            ValueError, match=r"group_size=3 does not divide the 8 replicas.*\[1, 2, 4, 8\]"
        ):
            DistributedBatchNormalization(group_size=3).build((None, 4))
    layer = DistributedBatchNormalization(group_size=16)
    layer.build((None, 4))  # no strategy yet: checked at the first training call
    with pytest.raises(ValueError, match=r"group_size=16 does not divide the 8 replicas"):
        strategy.run(tf.function(lambda: layer(tf.ones([2, 4]), training=True)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group_size": 0}, "positive int"),
        ({"group_size": 2.0}, "positive int"),
        ({"group_size": 1, "synchronized": True}, "only one of them"),
        ({"virtual_batch_size": 0}, "positive int"),
        ({"virtual_batch_size": 4.0}, "positive int"),
        ({"virtual_batch_size": 4, "group_size": 2}, "splits each replica's batch.*only one"),
        ({"virtual_batch_size": 4, "synchronized": True}, "synchronized=True joins"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedBatchNormalization(**kwargs)


def test_behaves_like_keras_without_a_strategy():
    x = np.random.default_rng(0).normal(5.0, 3.0, size=(6, 4)).astype(np.float32)
    ours, keras_bn = DistributedBatchNormalization(group_size=4), keras.layers.BatchNormalization()
    np.testing.assert_array_equal(ours(x, training=True), keras_bn(x, training=True))
    np.testing.assert_array_equal(ours.moving_variance.numpy(), keras_bn.moving_variance.numpy())


@pytest.mark.parametrize(
    "kwargs", [{}, {"scale": False, "center": False}, {"epsilon": 0.1, "momentum": 0.5}]
)
def test_four_d_training_matches_keras_without_a_strategy(kwargs):
    # 4-D channels-last training calls normalize with the fused kernel: same values as Keras's
    # element-wise ops up to rounding, same moving statistics, same gradients.
    x = tf.constant(np.random.default_rng(1).normal(2.0, 3.0, size=(3, 5, 4, 7)).astype(np.float32))
    ours, keras_bn = (
        DistributedBatchNormalization(**kwargs),
        keras.layers.BatchNormalization(**kwargs),
    )
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
    np.testing.assert_allclose(
        ours.moving_variance.numpy(), keras_bn.moving_variance.numpy(), rtol=1e-6
    )


@pytest.mark.parametrize("jit_compile", [True, False])
def test_fit_without_a_strategy_matches_keras(jit_compile):
    # The fused kernels and written-out gradients also compile with XLA (`jit_compile`, Keras's
    # default when it can) and train exactly as Keras's layer does.
    x = np.random.default_rng(2).random((32, 8, 8, 3)).astype(np.float32)
    y = np.random.default_rng(3).integers(0, 2, 32)
    losses = []
    for norm in (DistributedBatchNormalization, keras.layers.BatchNormalization):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.GlobalAveragePooling2D()(norm()(keras.layers.Conv2D(4, 3)(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(2)(h))
        model.compile(
            "sgd",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        losses.append(
            model.fit(x, y, epochs=3, batch_size=8, verbose=0, shuffle=False).history["loss"]
        )
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@pytest.mark.parametrize(
    "shape, kwargs, mask, fused",
    [
        ((2, 3, 3, 4), {}, False, True),
        ((2, 3, 3, 4), {"dtype": "mixed_bfloat16"}, False, True),
        ((2, 3, 3, 4), {"axis": 1}, False, False),  # the kernel here takes NHWC only
        ((2, 3, 3, 4), {}, True, False),  # masked statistics
        pytest.param((2, 3, 3, 4), {"renorm": True}, False, False, marks=NEEDS_RENORM),
        ((2, 5, 4), {}, False, False),  # 3-D
    ],
)
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
        (1, 1) if fused else (0, 0)
    )


# --------------------------------------------------------------------------- model.fit


def _conv_model(group_size, seed=0, norm=DistributedBatchNormalization):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            # A per-pixel projection, not a Conv2D: some tests hand replicas empty batches, which
            # oneDNN's convolution mishandles on some CPUs
            # (`_workarounds.convolution_drops_empty_batches`); the batch norm under test sees
            # spatial features all the same.
            keras.layers.Dense(4, use_bias=False),
            norm(group_size=group_size, momentum=0.5),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    )


def _dataset(steps=3, per_replica_batch=2):
    rng = np.random.default_rng(0)
    n = steps * per_replica_batch * NUM_REPLICAS
    x = rng.normal(1.0, 2.0, size=(n, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        per_replica_batch * NUM_REPLICAS, drop_remainder=True
    )


def _fit(strategy, group_size, run_eagerly, norm=DistributedBatchNormalization):
    with strategy.scope():
        model = _conv_model(group_size, norm=norm)
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=run_eagerly,
        )
    history = model.fit(_dataset(), epochs=1, verbose=0)
    bn = model.layers[1]
    moving = [np.asarray(v) for v in bn.moving_mean.value.values]
    return model, history, moving


def test_fit_under_the_strategy_graph_and_eager_agree(strategy):
    graph_model, history, moving = _fit(strategy, group_size=4, run_eagerly=False)
    assert np.isfinite(history.history["loss"][0])
    # The two groups of 4 saw different examples, yet all replicas hold one set of statistics.
    for r in range(NUM_REPLICAS):
        np.testing.assert_array_equal(moving[r], moving[0])
    eager_model, _, eager_moving = _fit(strategy, group_size=4, run_eagerly=True)
    for a, b in zip(graph_model.get_weights(), eager_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(moving, eager_moving, rtol=1e-4, atol=1e-5)


def test_default_group_in_fit(strategy):
    # 2 examples per replica never reach 64: the span rule falls back to all 8 replicas.
    _, _, moving = _fit(strategy, group_size=None, run_eagerly=False)
    for r in range(NUM_REPLICAS):
        np.testing.assert_array_equal(moving[r], moving[0])


def _keras_local(group_size, **kwargs):
    assert group_size == 1
    return keras.layers.BatchNormalization(**kwargs)


def test_average_moving_statistics_gives_every_replica_the_mean(strategy):
    # Keras's own layer: each replica's copy moves with its own batch.
    model, _, _ = _fit(strategy, group_size=1, run_eagerly=False, norm=_keras_local)
    bn = model.layers[1]
    before = {
        name: np.stack([np.asarray(v) for v in getattr(bn, name).value.values])
        for name in ("moving_mean", "moving_variance")
    }
    assert not np.allclose(before["moving_mean"][0], before["moving_mean"][4])
    assert average_moving_statistics(model) == 2
    for name, copies in before.items():
        expected = copies.mean(axis=0)
        for value in getattr(bn, name).value.values:
            np.testing.assert_allclose(np.asarray(value), expected, rtol=1e-6)
    # What is saved and what the model computes outside the strategy are that mean too.
    np.testing.assert_allclose(bn.moving_mean.numpy(), before["moving_mean"].mean(axis=0), 1e-6)
    # Averaging again changes nothing, and a model on one replica has nothing to average.
    assert average_moving_statistics(model) == 2
    for value in bn.moving_mean.value.values:
        np.testing.assert_allclose(np.asarray(value), before["moving_mean"].mean(axis=0), 1e-6)
    assert average_moving_statistics(_conv_model(4)) == 0
    # The package's layer keeps one set at every step: nothing to average.
    grouped, _, _ = _fit(strategy, group_size=4, run_eagerly=False)
    assert average_moving_statistics(grouped) == 0


def _partial_last_batch_dataset():
    """43 examples in global batches of 16, `drop_remainder=False`: the last batch has 11."""
    rng = np.random.default_rng(4)
    x = rng.normal(1.0, 2.0, size=(43, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=43)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=False)


def _keras_synchronized(group_size, **kwargs):
    assert group_size == NUM_REPLICAS
    return keras.layers.BatchNormalization(synchronized=True, **kwargs)


def _fit_reference(weights, steps, group_size, momentum=0.5, epsilon=1e-3, learning_rate=0.1):
    """What `model.fit` computes for `_conv_model` under the strategy, written out on one device.

    Each replica's loss is the mean over its own examples (0 without any) divided by the number of
    replicas; the gradients of all replicas add up into one SGD step. Batch normalization uses the
    statistics of the group's concatenated batch; the one set of moving statistics moves by the
    mean of the updates of the groups that have examples. Returns the trainable weights and the
    moving mean and variance.
    """
    kernel, gamma, beta, moving_mean, moving_variance, dense_kernel, dense_bias = weights
    params = [tf.Variable(w) for w in (kernel, gamma, beta, dense_kernel, dense_bias)]
    moving = [moving_mean, moving_variance]
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for xs, ys in steps:
        with tf.GradientTape() as tape:
            kernel, gamma, beta, dense_kernel, dense_bias = params
            features = [tf.einsum("bhwc,cd->bhwd", x, kernel) for x in xs]
            loss = 0.0
            updates = []
            for group in range(NUM_REPLICAS // group_size):
                members = range(group * group_size, (group + 1) * group_size)
                members = [r for r in members if len(xs[r])]
                if not members:
                    continue
                batch = tf.concat([features[r] for r in members], 0)
                mean, variance = tf.nn.moments(batch, [0, 1, 2])
                updates.append(
                    [
                        old * momentum + new.numpy() * (1.0 - momentum)
                        for old, new in zip(moving, (mean, variance))
                    ]
                )
                for r in members:
                    h = (features[r] - mean) * tf.math.rsqrt(variance + epsilon) * gamma + beta
                    logits = tf.reduce_mean(tf.nn.relu(h), [1, 2]) @ dense_kernel + dense_bias
                    loss += cross_entropy(ys[r], logits) / NUM_REPLICAS
        moving = list(np.mean(updates, axis=0))
        for param, gradient in zip(params, tape.gradient(loss, params)):
            param.assign_sub(learning_rate * gradient)
    return [p.numpy() for p in params], moving


def _fit_partial(strategy, group_size, norm=DistributedBatchNormalization):
    with strategy.scope():
        model = _conv_model(group_size, norm=norm)
        model.compile(
            keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    initial = [np.asarray(w) for w in model.get_weights()]
    history = model.fit(_partial_last_batch_dataset(), epochs=1, verbose=0)
    bn = model.layers[1]
    moving = [[np.asarray(v) for v in w.value.values] for w in (bn.moving_mean, bn.moving_variance)]
    return initial, history.history["loss"][0], [w.numpy() for w in model.trainable_weights], moving


@pytest.mark.parametrize("group_size", [2, 8])
def test_fit_with_a_partial_last_batch_trains_as_the_reference(strategy, group_size):
    steps = [
        [[np.asarray(t) for t in strategy.experimental_local_results(part)] for part in batch]
        for batch in strategy.experimental_distribute_dataset(_partial_last_batch_dataset())
    ]
    # The last step leaves replicas 6 and 7 empty: with groups of 2 a whole group, and the group
    # (4, 5) uneven.
    assert [len(x) for x in steps[-1][0]] == [2, 2, 2, 2, 2, 1, 0, 0]
    initial, loss, weights, moving = _fit_partial(strategy, group_size)
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(w)) for w in weights + moving[0] + moving[1])
    expected_weights, expected_moving = _fit_reference(initial, steps, group_size)
    for got, want in zip(weights, expected_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for r in range(NUM_REPLICAS):
        for got, want in zip((moving[0][r], moving[1][r]), expected_moving):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if group_size == NUM_REPLICAS:
        # Over all replicas, Keras's synchronized layer computes the same (its local one turns gamma
        # NaN in this run, from the 0 / 0 moments of the empty replicas).
        try:
            _, keras_loss, keras_weights, keras_moving = _fit_partial(
                strategy, group_size, _keras_synchronized
            )
        except AssertionError as e:
            # keras-nightly 3.16.0.dev2026102704 takes each batch eagerly before the step, so the
            # replicas' batch sizes are static, and its synchronized layer then fails here under
            # a plain tf.distribute.MirroredStrategy too: a replica's backward all-reduce of the
            # statistics meets another's gradient sum (tensorflow/tensorflow#52986). Keras 3.12
            # and 3.15 run it. Only Keras's layer is at fault: the package's passed above.
            if "Values to regroup had different lengths" not in str(e):
                raise
            pytest.xfail("Keras's own synchronized layer fails on this partial batch (TF #52986)")
        np.testing.assert_allclose(loss, keras_loss, rtol=1e-5)
        for got, want in zip(weights, keras_weights):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(moving, keras_moving, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- saving and conversion


def test_save_and_load_round_trip(tmp_path):
    renorm = {"renorm": True, "renorm_clipping": {"rmax": 2.0}} if keras_has_renorm() else {}
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4),
            DistributedBatchNormalization(group_size=2, momentum=0.9, epsilon=1e-4, **renorm),
        ]
    )
    layer = model.layers[1]
    layer.set_weights(_initial_weights(4, seed=1, renorm=bool(renorm)))
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
            layer.set_weights(
                _initial_weights(layer.gamma.shape[0], seed=int(rng.integers(1 << 30)))
            )
    converted = convert_batch_normalization(model, group_size=4)
    old_bn = [x for x in model.layers if isinstance(x, keras.layers.BatchNormalization)]
    new_bn = [x for x in converted.layers if isinstance(x, keras.layers.BatchNormalization)]
    assert len(new_bn) == len(old_bn) == 53
    assert all(type(x) is DistributedBatchNormalization and x.group_size == 4 for x in new_bn)
    assert not any(type(x) is DistributedBatchNormalization for x in model.layers)
    x = rng.uniform(0, 255, size=(2, 224, 224, 3)).astype(np.float32)
    np.testing.assert_array_equal(converted(x, training=False), model(x, training=False))


def test_convert_keeps_a_subclassed_model_and_its_blocks_whole():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(3)
            self.norm = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            return self.norm(self.dense(x), training=training)

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block()
            self.norm = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            return self.norm(self.block(x, training=training), training=training)

    net = Net()
    x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    net(x)
    for layer in (net.norm, net.block.norm):
        layer.set_weights(_initial_weights(3, seed=len(layer.name)))
    converted = convert_batch_normalization(net, group_size=2)
    assert type(converted) is Net
    assert type(converted.norm) is type(converted.block.norm) is DistributedBatchNormalization
    assert converted.norm.group_size == converted.block.norm.group_size == 2
    np.testing.assert_array_equal(converted(x, training=False), net(x, training=False))


def test_convert_refuses_a_class_it_cannot_rebuild():
    class Fixed(keras.Model):
        def __init__(self, width):
            super().__init__()
            self.dense = keras.layers.Dense(width)

        def call(self, x):
            return self.dense(x)

    model = Fixed(3)
    model(np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="Fixed cannot be.*tpu_scale.layers"):
        convert_batch_normalization(model)


def test_convert_refuses_a_batch_norm_of_a_class_of_its_own():
    class FrozenBatchNormalization(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=False, mask=mask)

    model = keras.Sequential([keras.Input((3,)), FrozenBatchNormalization(name="frozen")])
    with pytest.raises(ValueError, match="'frozen' is a FrozenBatchNormalization.*subclass"):
        convert_batch_normalization(model)


# --------------------------------------------------------------------------- multi-worker


def worker_fit():
    """Runs in each of 2 workers x 2 CPUs: fits with local and with cross-worker groups."""
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]), gradient_reduction="native"
    )
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(64, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=64)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(16, drop_remainder=True)
        .with_options(options)
    )
    from tpu_scale.distribute import collectives
    from tpu_scale.testing import collective_ops, group_size, train_graphs

    results = {"mesh": strategy.mesh.shape}
    for size in (1, 2, 4):
        with strategy.scope():
            model = _conv_model(size)
            model.compile(
                keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        history = model.fit(dataset, epochs=1, verbose=0)
        results[size] = {
            "loss": history.history["loss"],
            "weights": [w.numpy() for w in model.trainable_weights],
            "moving_means": [np.asarray(v) for v in model.layers[1].moving_mean.value.values],
            # The group sizes of the layer's own collective ops (private keys; Keras's loss sum
            # and TensorFlow's gradient all-reduce use the strategy's keys).
            "bn_collectives": sorted(
                {
                    group_size(op)
                    for g in train_graphs(model)
                    for op in collective_ops(g)
                    if int(tf.get_static_value(op.inputs[2])) >= collectives.PRIVATE_KEY_BASE
                }
            ),
        }
    return results


def test_two_workers_fit_with_a_group_across_workers():
    first, second = run_workers(
        f"{__name__}:worker_fit", num_workers=2, cpus_per_worker=2, timeout=300
    )
    assert first["mesh"] == second["mesh"] == (2, 2)
    # Whatever the groups, all four replicas on both workers hold one set of moving statistics.
    for size in (1, 2, 4):
        means = first[size]["moving_means"] + second[size]["moving_means"]
        assert len(means) == 4
        for mean in means[1:]:
            np.testing.assert_array_equal(mean, means[0])
        for a, b in zip(first[size]["weights"], second[size]["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        assert np.all(np.isfinite(first[size]["loss"]))
    # Local statistics and groups of 2 (each worker's own replicas) saw different examples...
    assert not np.allclose(first[1]["moving_means"][0], first[2]["moving_means"][0])
    # ...and their group sums are plain ops in each worker's graph; the one collective op, across
    # both workers, shares the moving statistics. One group of 4 spans the workers: its sums are
    # collective ops, and its statistics are already shared.
    assert first[1]["bn_collectives"] == first[2]["bn_collectives"] == [4]
    assert first[4]["bn_collectives"] == second[4]["bn_collectives"] == [4]


def test_renorm_on_a_keras_without_it_names_the_fix(monkeypatch):
    from tpu_scale.layers import batch_normalization

    monkeypatch.setattr(batch_normalization, "keras_has_renorm", lambda: False)
    with pytest.raises(ValueError, match=r"renorm.*pip install -U keras"):
        DistributedBatchNormalization(renorm=True, renorm_clipping={"rmax": 2.0})
    # Renormalization off, as in a newer Keras's saved config: the arguments are dropped.
    layer = DistributedBatchNormalization(renorm=False, renorm_momentum=0.99, group_size=1)
    assert layer.group_size == 1
