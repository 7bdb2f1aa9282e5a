"""Tests for `tpu_scale.models`: ResNet-50 v1.5 and the small ResNet."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_scale.layers import DistributedBatchNormalization
from tpu_scale.losses import SmoothedSparseCategoricalCrossentropy
from tpu_scale.models import resnet50, small_resnet
from tpu_scale.optimizers import LARS
from tpu_scale.schedules import WarmupPolynomialDecay


@pytest.fixture(scope="module")
def resnet50_bf16():
    """ResNet-50 built once, under `mixed_bfloat16`, with groups of 4 replicas."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        return resnet50(num_classes=1000, bn_group_size=4)
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _num_params(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


def _batch_norms(model):
    return [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]


def _producer(tensor):
    return tensor._keras_history[0]


def _check_zero_gamma_rule(model):
    """Each residual add sums a shortcut and a branch whose last batch norm has gamma = 0;
    every other batch norm has gamma = 1. Returns the number of residual blocks."""
    adds = [layer for layer in model.layers if isinstance(layer, keras.layers.Add)]
    zero = set()
    for add in adds:
        shortcut, branch = add.input
        last_bn = _producer(branch)
        assert isinstance(last_bn, DistributedBatchNormalization), add.name
        zero.add(last_bn.name)
        # The shortcut is the block input (identity) or a projection with an ordinary BN.
        assert _producer(shortcut).name not in zero
    for bn in _batch_norms(model):
        want = 0.0 if bn.name in zero else 1.0
        np.testing.assert_array_equal(bn.gamma.numpy(), want, err_msg=bn.name)
    return len(adds)


def test_resnet50_parameter_count(resnet50_bf16):
    assert _num_params(resnet50_bf16.trainable_weights) == 25_557_032
    # Plus the moving mean and variance of 26,560 batch-norm channels.
    assert resnet50_bf16.count_params() == 25_557_032 + 2 * 26_560


def test_resnet50_structure(resnet50_bf16):
    model = resnet50_bf16
    bns = _batch_norms(model)
    assert len(bns) == 53 and all(isinstance(bn, DistributedBatchNormalization) for bn in bns)
    for bn in bns:
        assert (bn.group_size, bn.momentum, bn.epsilon) == (4, 0.9, 1e-5)
    assert _check_zero_gamma_rule(model) == 16
    # v1.5: a downsampling block strides on its 3x3 convolution, never on the 1x1s.
    for stage, stride in ((1, 1), (2, 2), (3, 2), (4, 2)):
        block = f"stage{stage}_block1"
        assert model.get_layer(f"{block}_conv1").strides == (1, 1)
        assert model.get_layer(f"{block}_conv2").strides == (stride, stride)
        assert model.get_layer(f"{block}_conv3").strides == (1, 1)
        assert model.get_layer(f"{block}_shortcut_conv").strides == (stride, stride)
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len(convs) == 53 and not any(c.use_bias for c in convs)
    assert not model.losses  # no kernel regularizers: L2 belongs to the optimizer
    assert model.get_layer("stage4_block3_out").output.shape == (None, 7, 7, 2048)


def test_resnet50_float32_logits_under_mixed_bfloat16(resnet50_bf16):
    model = resnet50_bf16
    assert model.get_layer("stem_conv").compute_dtype == "bfloat16"
    assert model.outputs[0].dtype == "float32"
    assert all(w.dtype == "float32" for w in model.weights)
    images = np.random.default_rng(0).normal(size=(2, 224, 224, 3)).astype(np.float32)
    logits = model(images, training=False)
    assert logits.dtype == tf.float32 and logits.shape == (2, 1000)
    assert np.all(np.isfinite(logits.numpy()))


def test_small_resnet_structure():
    model = small_resnet(10, input_shape=(64, 64, 3), bn_group_size=2)
    assert _check_zero_gamma_rule(model) == 3
    assert all(bn.group_size == 2 and bn.virtual_batch_size is None for bn in _batch_norms(model))
    ghosts = small_resnet(10, input_shape=(32, 32, 3), bn_virtual_batch_size=64)
    assert all(bn.virtual_batch_size == 64 for bn in _batch_norms(ghosts))
    assert model.input_shape == (None, 64, 64, 3) and model.output_shape == (None, 10)
    assert model.count_params() < 200_000
    deeper = small_resnet(
        10, input_shape=(32, 32, 3), widths=(8, 16), blocks_per_stage=(2, 3), bottleneck=True
    )
    assert _check_zero_gamma_rule(deeper) == 5
    assert deeper.get_layer("stage2_block1_conv2").strides == (2, 2)
    assert deeper.output_shape == (None, 10)


def test_small_resnet_pools_its_stem_from_64_pixels():
    pooled, unpooled = small_resnet(10, (64, 64, 3)), small_resnet(10, (64, 64, 3), stem_pool=False)
    assert pooled.get_layer("stage1_block1_add").output.shape[1:3] == (16, 16)
    assert unpooled.get_layer("stage1_block1_add").output.shape[1:3] == (32, 32)
    smaller = small_resnet(10, (48, 64, 3))  # the smaller side decides
    assert "stem_pool" not in [layer.name for layer in smaller.layers]
    assert small_resnet(10, (32, 32, 3)).get_layer("stage1_block1_add").output.shape[1:3] == (16, 16)
    assert small_resnet(10, (32, 32, 3), stem_pool=True).get_layer("stem_pool").output.shape[1:3] == (8, 8)
    # The pool has no weights: the same weights, and with them the same function up to the pool,
    # which is ResNet-50's 3x3 stride-2 max pool of the stem's output.
    unpooled.set_weights(pooled.get_weights())
    images = np.random.default_rng(0).normal(size=(4, 64, 64, 3)).astype(np.float32)
    stem = keras.Model(unpooled.input, unpooled.get_layer("stem_relu").output)(images)
    expected = tf.nn.max_pool2d(stem, 3, 2, "SAME")
    got = keras.Model(pooled.input, pooled.get_layer("stem_pool").output)(images)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="`stem_pool` must be True, False or None"):
        small_resnet(10, (64, 64, 3), stem_pool="yes")


def test_small_resnet_forward_backward_under_mixed_bfloat16():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = small_resnet(5, input_shape=(32, 32, 3))
    finally:
        keras.mixed_precision.set_global_policy(previous)
    rng = np.random.default_rng(1)
    images = rng.normal(size=(8, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 5, size=(8,))
    loss_fn = SmoothedSparseCategoricalCrossentropy()
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = loss_fn(labels, logits)
    assert logits.dtype == tf.float32 and loss.dtype == tf.float32
    grads = tape.gradient(loss, model.trainable_variables)
    for g, v in zip(grads, model.trainable_variables):
        assert g is not None, v.path
        assert g.dtype == tf.float32 and np.all(np.isfinite(g.numpy())), v.path
    # With gamma = 0 the residual branches are silent at the start, but their zero gammas
    # do get a gradient: the blocks can switch on.
    grads_by_path = {v.path: g for g, v in zip(grads, model.trainable_variables)}
    for name in ("stage1_block1_bn2", "stage2_block1_bn2", "stage3_block1_bn2"):
        assert np.abs(grads_by_path[f"{name}/gamma"].numpy()).max() > 0


def _stripes(n, size, rng):
    """Four classes of stripes (vertical, horizontal, two diagonals) at random phase in noise:
    learnable through global average pooling, unlike a position-coded task."""
    i, j = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    labels = rng.integers(0, 4, size=n)
    images = rng.normal(size=(n, size, size, 3)).astype(np.float32)
    for k, c in enumerate(labels):
        phase = rng.uniform(0, 2 * np.pi)
        pattern = (i * 0.8, j * 0.8, (i + j) * 0.6, (i - j) * 0.6)[c]
        images[k] += np.sin(pattern + phase)[..., None]
    return images, labels


def test_small_resnet_learns_with_the_recipe():
    keras.utils.set_random_seed(0)
    images, labels = _stripes(512, 32, np.random.default_rng(0))
    model = small_resnet(4, input_shape=(32, 32, 3))
    steps = 6 * 8  # 384 training images, batch 64, 8 epochs
    model.compile(
        optimizer=LARS(
            WarmupPolynomialDecay(10.0, warmup_steps=8, total_steps=steps), weight_decay=1e-4
        ),
        loss=SmoothedSparseCategoricalCrossentropy(),
        metrics=["accuracy"],
    )
    model.fit(images[:384], labels[:384], batch_size=64, epochs=8, verbose=0)
    _, accuracy = model.evaluate(images[384:], labels[384:], verbose=0)
    assert accuracy > 0.8  # chance is 0.25


def _fit_recipe(strategy, images, labels, bn_group_size):
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = small_resnet(4, input_shape=(16, 16, 3), widths=(8, 16), bn_group_size=bn_group_size)
        model.compile(
            optimizer=LARS(
                WarmupPolynomialDecay(5.0, warmup_steps=1, total_steps=4), weight_decay=1e-3
            ),
            loss=SmoothedSparseCategoricalCrossentropy(),
        )
    model.fit(images, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return model


def test_small_resnet_on_8_replicas_matches_one_device():
    """The whole recipe under `create_strategy` (8 virtual replicas in a 2x4 mesh, the torus
    gradient sum, batch norm over groups of all 8) trains exactly like one device on the
    global batch."""
    from tpu_scale import create_strategy

    rng = np.random.default_rng(6)
    images, labels = _stripes(96, 16, rng)  # 3 steps of a global batch of 32
    strategy = create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4))
    distributed = _fit_recipe(strategy, images, labels, bn_group_size=8)
    local = _fit_recipe(tf.distribute.get_strategy(), images, labels, bn_group_size=None)
    keras.utils.set_random_seed(5)
    start = small_resnet(4, input_shape=(16, 16, 3), widths=(8, 16))
    for a, b, s in zip(distributed.weights, local.weights, start.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-3, atol=2e-5, err_msg=a.path)
    assert (
        np.abs(
            local.get_layer("logits").kernel.numpy() - start.get_layer("logits").kernel.numpy()
        ).max()
        > 1e-4
    )
    assert (
        np.abs(
            local.get_layer("stem_conv").kernel.numpy()
            - start.get_layer("stem_conv").kernel.numpy()
        ).max()
        > 1e-4
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_classes=0), "num_classes"),
        (dict(num_classes=10, widths=(8, 16), blocks_per_stage=(1,)), "same length"),
        (dict(num_classes=10, blocks_per_stage=(1, 0, 1)), "at least one block"),
        (dict(num_classes=10, bn_group_size=0), "group_size"),
        (dict(num_classes=10, input_shape=(4, 4, 3)), "input_shape"),
    ],
)
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        small_resnet(**kwargs)
