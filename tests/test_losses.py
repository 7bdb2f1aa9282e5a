"""Tests for `tpu_scale.losses.SmoothedSparseCategoricalCrossentropy`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_scale.losses import SmoothedSparseCategoricalCrossentropy


def _data(batch=6, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.normal(size=(batch, classes))).astype(np.float32)
    labels = rng.integers(0, classes, size=(batch,))
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", None])
def test_matches_categorical_crossentropy_on_one_hot(smoothing, reduction):
    logits, labels = _data()
    one_hot = np.eye(5, dtype=np.float32)[labels]
    want = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=smoothing, reduction=reduction
    )(one_hot, logits)
    got = SmoothedSparseCategoricalCrossentropy(label_smoothing=smoothing, reduction=reduction)(
        labels, logits
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Labels as a column and sample weights are handled like Keras's own losses.
    weights = np.linspace(0.0, 1.0, 6).astype(np.float32)
    want_w = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=smoothing)(
        one_hot, logits, sample_weight=weights
    )
    got_w = SmoothedSparseCategoricalCrossentropy(label_smoothing=smoothing)(
        labels[:, None], logits, sample_weight=weights
    )
    np.testing.assert_allclose(float(got_w), float(want_w), rtol=1e-5)


def test_probabilities_match_keras():
    logits, labels = _data(seed=1)
    probs = tf.nn.softmax(logits).numpy()
    one_hot = np.eye(5, dtype=np.float32)[labels]
    want = keras.losses.CategoricalCrossentropy(label_smoothing=0.1)(one_hot, probs)
    got = SmoothedSparseCategoricalCrossentropy(from_logits=False)(labels, probs)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_bfloat16_logits_give_float32_loss():
    logits, labels = _data(batch=4, classes=1000, seed=2)
    bf16 = tf.cast(logits, tf.bfloat16)
    loss = SmoothedSparseCategoricalCrossentropy(reduction=None)(labels, bf16)
    assert loss.dtype == tf.float32
    # Computed from the bfloat16 values, in float32: equals the float32 loss of those values.
    want = SmoothedSparseCategoricalCrossentropy(reduction=None)(labels, tf.cast(bf16, tf.float32))
    np.testing.assert_allclose(loss.numpy(), want.numpy(), rtol=1e-6)


def test_serialization():
    loss = SmoothedSparseCategoricalCrossentropy(
        label_smoothing=0.2, from_logits=False, reduction="sum", name="xent"
    )
    clone = keras.losses.deserialize(keras.losses.serialize(loss))
    assert isinstance(clone, SmoothedSparseCategoricalCrossentropy)
    assert clone.get_config() == loss.get_config()
    assert (clone.label_smoothing, clone.from_logits, clone.reduction) == (0.2, False, "sum")


def test_trains_a_model_under_mixed_bfloat16(tmp_path):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(3, dtype="float32"),
            ]
        )
        model.compile("sgd", loss=SmoothedSparseCategoricalCrossentropy())
        history = model.fit(np.ones((8, 4)), np.arange(8) % 3, epochs=2, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        path = str(tmp_path / "m.keras")
        model.save(path)
        assert isinstance(keras.models.load_model(path).loss, SmoothedSparseCategoricalCrossentropy)
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_bad_smoothing():
    with pytest.raises(ValueError, match="label_smoothing"):
        SmoothedSparseCategoricalCrossentropy(label_smoothing=1.0)
