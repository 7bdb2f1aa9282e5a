"""Tests for `ImageNormalization`: equal to the pipeline's normalization, serializable."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_scale.data import image_ops
from tpu_scale.layers import ImageNormalization


@pytest.mark.parametrize("dtype", ["uint8", "float32", "bfloat16"])
def test_equals_the_pipeline_normalization(dtype):
    pixels = np.random.default_rng(0).integers(0, 256, size=(2, 5, 7, 3)).astype("uint8")
    expected = image_ops.normalize_image(tf.constant(pixels, tf.float32)).numpy()
    got = ImageNormalization()(tf.constant(pixels, dtype))
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-5)


def test_compute_dtype_follows_the_policy():
    layer = ImageNormalization(dtype="mixed_bfloat16")
    out = layer(tf.zeros([1, 2, 2, 3], tf.uint8))
    assert out.dtype == tf.bfloat16


def test_custom_statistics_and_bad_ones():
    out = ImageNormalization(mean=[10.0], stddev=[2.0])(tf.constant([[[[14]]]], tf.uint8))
    assert float(tf.reshape(out, [])) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="one value per channel"):
        ImageNormalization(mean=[1.0, 2.0], stddev=[1.0])
    with pytest.raises(ValueError, match="stddev must be positive"):
        ImageNormalization(stddev=[1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="Pass mean= and stddev= per channel"):
        ImageNormalization()(tf.zeros([1, 2, 2, 1], tf.uint8))


def test_model_with_the_layer_saves_and_loads(tmp_path):
    inputs = keras.Input((4, 4, 3), dtype="uint8")
    model = keras.Model(inputs, ImageNormalization(mean=[1.0, 2.0, 3.0], name="norm")(inputs))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    x = np.full((1, 4, 4, 3), 7, np.uint8)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy())
    assert loaded.get_layer("norm").mean == (1.0, 2.0, 3.0)
