"""Tests for `tpu_scale.schedules`: the learning-rate schedules, the reference LARS settings."""

import keras
import numpy as np
import pytest

from tpu_scale.optimizers import LARS
from tpu_scale.schedules import WarmupPolynomialDecay, reference_lars_hparams


def _lr(schedule, step):
    return float(schedule(np.int64(step)))


def test_values_at_key_steps():
    s = WarmupPolynomialDecay(
        peak_learning_rate=10.0, warmup_steps=100, total_steps=300, end_learning_rate=1.0
    )
    assert _lr(s, 0) == 0.0
    assert _lr(s, 50) == pytest.approx(5.0)
    assert _lr(s, 100) == pytest.approx(10.0)
    # Halfway through the decay: 1 + 9 * (1 - 0.5) ** 2.
    assert _lr(s, 200) == pytest.approx(1.0 + 9.0 * 0.25)
    assert _lr(s, 300) == pytest.approx(1.0)
    assert _lr(s, 10_000) == pytest.approx(1.0)
    values = [_lr(s, i) for i in range(0, 301, 5)]
    assert max(values) == pytest.approx(10.0)
    assert np.all(np.diff(values[:21]) > 0) and np.all(np.diff(values[20:]) < 0)


def test_power_and_no_warmup():
    s = WarmupPolynomialDecay(4.0, warmup_steps=0, total_steps=10, power=1.0)
    assert _lr(s, 0) == pytest.approx(4.0)
    assert _lr(s, 5) == pytest.approx(2.0)
    assert _lr(s, 10) == pytest.approx(0.0)


def test_from_epochs():
    s = WarmupPolynomialDecay.from_epochs(
        25.0, warmup_epochs=2.5, total_epochs=10, steps_per_epoch=40
    )
    assert (s.warmup_steps, s.total_steps) == (100, 400)
    assert _lr(s, 100) == pytest.approx(25.0)


def test_serialization_round_trip():
    s = WarmupPolynomialDecay(7.0, 12, 90, end_learning_rate=0.5, power=3.0)
    clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
    assert isinstance(clone, WarmupPolynomialDecay)
    assert clone.get_config() == s.get_config()
    for step in (0, 6, 12, 50, 90, 200):
        assert _lr(clone, step) == _lr(s, step)
    # Also through the optimizer's config, as a saved model stores it.
    opt = keras.optimizers.deserialize(keras.optimizers.serialize(LARS(learning_rate=s)))
    assert opt.learning_rate.numpy() == 0.0  # step 0 of the warmup
    assert opt.get_config()["learning_rate"]["config"] == s.get_config()


def test_reference_hparams():
    assert reference_lars_hparams(256) == {"peak_learning_rate": 25.0, "warmup_epochs": 5.0}
    assert reference_lars_hparams(16384) == {"peak_learning_rate": 25.0, "warmup_epochs": 5.0}
    assert reference_lars_hparams(32768) == {"peak_learning_rate": 34.0, "warmup_epochs": 12.0}
    assert reference_lars_hparams(65536) == {"peak_learning_rate": 35.0, "warmup_epochs": 34.0}
    assert reference_lars_hparams(131072) == reference_lars_hparams(65536)
    # Between table rows: interpolated in log2(batch), so monotonic and in between.
    mid = reference_lars_hparams(24576)
    assert 25.0 < mid["peak_learning_rate"] < 34.0 and 5.0 < mid["warmup_epochs"] < 12.0
    t = np.log2(24576 / 16384)
    assert mid["peak_learning_rate"] == pytest.approx(25.0 + 9.0 * t)
    s = WarmupPolynomialDecay.from_epochs(
        **reference_lars_hparams(32768), total_epochs=72, steps_per_epoch=39
    )
    assert s.warmup_steps == 12 * 39 and _lr(s, s.warmup_steps) == pytest.approx(34.0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(peak_learning_rate=0.0, warmup_steps=1, total_steps=2), "peak_learning_rate"),
        (dict(peak_learning_rate=1.0, warmup_steps=-1, total_steps=2), "warmup_steps"),
        (dict(peak_learning_rate=1.0, warmup_steps=2.5, total_steps=5), "warmup_steps"),
        (dict(peak_learning_rate=1.0, warmup_steps=5, total_steps=5), "total_steps"),
        (
            dict(peak_learning_rate=1.0, warmup_steps=1, total_steps=5, end_learning_rate=2.0),
            "end_learning_rate",
        ),
        (dict(peak_learning_rate=1.0, warmup_steps=1, total_steps=5, power=0.0), "power"),
    ],
)
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        WarmupPolynomialDecay(**kwargs)


def test_bad_epoch_and_batch_arguments():
    with pytest.raises(ValueError, match="warmup_epochs"):
        WarmupPolynomialDecay.from_epochs(1.0, -1, 10, 5)
    with pytest.raises(ValueError, match="total_epochs"):
        WarmupPolynomialDecay.from_epochs(1.0, 5, 5, 5)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        WarmupPolynomialDecay.from_epochs(1.0, 1, 5, 0)
    with pytest.raises(ValueError, match="global_batch_size"):
        reference_lars_hparams(0)


def test_a_traced_step_reads_each_steps_rate():
    import tensorflow as tf

    from tpu_scale.schedules import ScaledSchedule

    s = WarmupPolynomialDecay(4.0, warmup_steps=2, total_steps=10)
    scaled = ScaledSchedule(s, 0.5)
    step = tf.Variable(3, dtype=tf.int64)

    @tf.function
    def reads():
        # Keras's weight decay reads the rate once per variable and replica.
        rates = [s(step) for _ in range(2)] + [scaled(step) for _ in range(2)]
        in_branch = tf.cond(step > 0, lambda: s(step), lambda: s(step) + 1.0)
        return tf.stack(rates), in_branch

    for value in (3, 6, 10):
        step.assign(value)
        rates, in_branch = reads()
        want = _lr(s, value)
        np.testing.assert_allclose(rates, [want] * 2 + [want / 2] * 2, rtol=1e-6)
        assert float(in_branch) == pytest.approx(want)
    for number in (5, np.int64(5)):
        assert float(tf.function(lambda: scaled(number))()) == pytest.approx(_lr(s, 5) / 2)


def test_weight_decay_under_a_strategy_applies_each_steps_rate(strategy):
    """Several replicas, weight decay and a rate that changes every step: the same weights as
    Keras's own `PolynomialDecay`, which builds its rate at every read."""
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, size=64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    ours = WarmupPolynomialDecay(0.5, warmup_steps=0, total_steps=6)
    keras_own = keras.optimizers.schedules.PolynomialDecay(0.5, 6, end_learning_rate=0.0, power=2.0)
    weights = []
    for schedule in (ours, keras_own):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(3)])
            optimizer = keras.optimizers.SGD(schedule, momentum=0.9, weight_decay=0.05)
            model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(data, epochs=1, verbose=0)
        assert int(optimizer.iterations.numpy()) == 4
        weights.append([w.numpy() for w in model.trainable_weights])
    for got, want in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
