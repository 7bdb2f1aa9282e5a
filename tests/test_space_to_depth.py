"""Tests for the space-to-depth stem: the same function as ResNet-50's 7x7 stride-2 stem."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_scale import models
from tpu_scale.layers import SpaceToDepth
from tpu_scale.layers.space_to_depth import (
    stem_kernel_from_space_to_depth,
    stem_kernel_to_space_to_depth,
)


def _standard_stem(x, kernel):
    x = tf.pad(x, [[0, 0], [3, 3], [3, 3], [0, 0]])
    return tf.nn.conv2d(x, kernel, strides=2, padding="VALID")


def _s2d_stem(x, kernel):
    x = tf.nn.space_to_depth(x, 2)
    x = tf.pad(x, [[0, 0], [2, 1], [2, 1], [0, 0]])
    return tf.nn.conv2d(x, kernel, strides=1, padding="VALID")


@pytest.mark.parametrize("size", [8, 14, 32])
def test_converted_kernel_computes_the_standard_stem(size):
    rng = np.random.default_rng(size)
    x = rng.normal(size=(2, size, size, 3)).astype("float32")
    kernel = rng.normal(size=(7, 7, 3, 5)).astype("float32")
    expected = _standard_stem(x, kernel).numpy()
    got = _s2d_stem(x, stem_kernel_to_space_to_depth(kernel)).numpy()
    assert got.shape == expected.shape == (2, size // 2, size // 2, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_kernel_conversion_round_trips_and_rejects_foreign_kernels():
    kernel = np.random.default_rng(1).normal(size=(7, 7, 3, 4)).astype("float32")
    np.testing.assert_array_equal(
        stem_kernel_from_space_to_depth(stem_kernel_to_space_to_depth(kernel)), kernel
    )
    with pytest.raises(ValueError, match="outside the 7x7 window"):
        stem_kernel_from_space_to_depth(np.ones((4, 4, 12, 4), np.float32))
    with pytest.raises(ValueError, match=r"\[7, 7, C, O\]"):
        stem_kernel_to_space_to_depth(np.ones((3, 3, 3, 4)))


def test_space_to_depth_layer_checks_the_size():
    assert SpaceToDepth()(tf.zeros([1, 4, 6, 3])).shape == (1, 2, 3, 12)
    with pytest.raises(ValueError, match="divisible by 2"):
        SpaceToDepth()(tf.zeros([1, 5, 6, 3]))


def test_resnet50_with_a_space_to_depth_stem_equals_the_standard_one():
    standard = models.resnet50(num_classes=10, input_shape=(64, 64, 3))
    s2d = models.resnet50(num_classes=10, input_shape=(64, 64, 3), space_to_depth=True)
    assert tuple(s2d.get_layer("stem_conv").kernel.shape) == (4, 4, 12, 64)
    assert standard.count_params() + 64 * (16 * 12 - 49 * 3) == s2d.count_params()
    models.convert_stem(standard, s2d)
    x = np.random.default_rng(2).normal(size=(2, 64, 64, 3)).astype("float32")
    np.testing.assert_allclose(
        s2d(x, training=False).numpy(), standard(x, training=False).numpy(), rtol=1e-4, atol=1e-4
    )
    back = models.resnet50(num_classes=10, input_shape=(64, 64, 3))
    models.convert_stem(s2d, back)
    np.testing.assert_allclose(
        back.get_layer("stem_conv").kernel.numpy(), standard.get_layer("stem_conv").kernel.numpy()
    )


def test_model_that_normalizes_uint8_inputs_saves_and_loads(tmp_path):
    model = models.small_resnet(4, input_shape=(16, 16, 3), normalize_inputs=True)
    assert model.inputs[0].dtype == "uint8"
    path = str(tmp_path / "small.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    x = np.random.default_rng(3).integers(0, 256, size=(2, 16, 16, 3)).astype("uint8")
    np.testing.assert_allclose(
        loaded(x, training=False).numpy(), model(x, training=False).numpy(), rtol=1e-5, atol=1e-5
    )
