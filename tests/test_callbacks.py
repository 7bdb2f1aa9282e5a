"""Tests for `tpu_scale.callbacks`: `LossGuard` and `AverageMovingStatistics`."""

import keras
import numpy as np
import pytest

from tpu_scale import keras_hook, optimizers, schedules
from tpu_scale.callbacks import AverageMovingStatistics, LossGuard
from tpu_scale.layers import DistributedBatchNormalization


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    return x, y


def _model(optimizer, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _finite(model):
    return all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_absurd_learning_rate_is_stopped_and_reported():
    x, y = _data()
    schedule = schedules.WarmupPolynomialDecay(1e8, warmup_steps=4, total_steps=200)
    model = _model(optimizers.LARS(schedule, eta=1.0))
    guard = LossGuard(
        max_backoffs=0, learning_rate_flag="--peak_learning_rate", optimizer_flag="--optimizer"
    )
    history = model.fit(x, y, batch_size=16, epochs=10, callbacks=[guard], verbose=0)
    assert guard.stopped and not guard.backoffs
    # Stopped in the first epochs, not after training on for the whole run.
    assert guard.stopped_epoch <= 2 and len(history.history["loss"]) == guard.stopped_epoch + 1
    assert "--peak_learning_rate" in guard.message and "--optimizer sgd" in guard.message
    assert "from 1e+08 to 5e+07" in guard.message
    assert _finite(model)
    assert all(np.all(np.isfinite(v.numpy())) for v in model.optimizer.variables)
    # The restored model still predicts finite logits.
    assert np.all(np.isfinite(model.predict(x[:8], verbose=0)))


def test_restores_the_last_good_epoch_not_the_start():
    x, y = _data()
    rates = []

    class Explode(keras.callbacks.Callback):
        """Three sane epochs, then a learning rate that makes the loss NaN."""

        def on_epoch_begin(self, epoch, logs=None):
            self.model.optimizer.learning_rate.assign(0.05 if epoch < 3 else 1e12)
            rates.append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 2:
                self.good = [w.copy() for w in self.model.get_weights()]

    explode = Explode()
    model = _model(keras.optimizers.SGD(0.05, momentum=0.9))
    guard = LossGuard(max_backoffs=0, learning_rate_flag="--peak_learning_rate")
    model.fit(x, y, batch_size=16, epochs=8, callbacks=[explode, guard], verbose=0)
    assert guard.stopped and guard.stopped_epoch == 3
    assert "end of epoch 3" in guard.message and "warm up for longer" in guard.message
    for restored, good in zip(model.get_weights(), explode.good):
        np.testing.assert_array_equal(restored, good)


def test_healthy_run_is_not_stopped():
    x, y = _data()
    model = _model(keras.optimizers.SGD(0.1, momentum=0.9))
    guard = LossGuard()
    history = model.fit(x, y, batch_size=8, epochs=4, callbacks=[guard], verbose=0)
    assert not guard.stopped and guard.message is None
    assert len(history.history["loss"]) == 4
    assert guard.reference_loss == pytest.approx(np.log(2), rel=0.3)


class _FakeModel:
    def __init__(self):
        self.stop_training = False
        self.optimizer = None
        self.weights = [np.zeros(3)]

    def get_weights(self):
        return [w.copy() for w in self.weights]

    def set_weights(self, weights):
        self.weights = [w.copy() for w in weights]


def _feed(guard, epoch_losses):
    """Runs the guard's hooks on per-step losses, given per epoch; returns the steps seen."""
    model = _FakeModel()
    guard.set_model(model)
    guard.on_train_begin()
    seen = 0
    for epoch, losses in enumerate(epoch_losses):
        guard.on_epoch_begin(epoch)
        for step, loss in enumerate(losses):
            # Keras hands callbacks the running mean of the epoch.
            guard.on_train_batch_end(step, {"loss": float(np.mean(losses[: step + 1]))})
            seen += 1
            if model.stop_training:
                return seen
        guard.on_epoch_end(epoch)
    return seen


def test_finite_blow_up_is_caught_after_the_window():
    guard = LossGuard(factor=3.0, reference_steps=4, window=3, max_backoffs=0)
    # Reference 2.3; the loss climbs past 6.9 on average over 3 steps in epoch 2.
    losses = [[2.3] * 10, [2.0] * 5 + [5.0, 8.0, 12.0, 20.0, 30.0]]
    seen = _feed(guard, losses)
    assert guard.stopped and guard.stopped_epoch == 1
    assert seen == 10 + 8  # mean(8, 12, 20) > 6.9; mean(5, 8, 12) is not
    assert guard.reference_loss == pytest.approx(2.3)
    assert "3x the first steps' 2.3" in guard.message


def test_a_finite_blow_up_in_epochs_shorter_than_the_window_is_caught_at_their_end():
    # Epochs of 3 steps, 4 reference steps and a window of 5: epoch 2 blows up before any window
    # past the reference fills.
    guard = LossGuard(factor=3.0, reference_steps=4, window=5, max_backoffs=0)
    guard.set_params({"epochs": 4})
    losses = [[2.0, 2.0, 2.0], [2.0, 40.0, 90.0], [2.0, 1e6, 1e9], [1e12, 1e15, 1e18]]
    _feed(guard, losses)
    # Epoch 2 ends 2 steps past the reference steps: its mean, 44, is checked at its end.
    assert guard.stopped and (guard.stopped_epoch, guard.stopped_step) == (1, 2)
    assert "loss 44 averaged over the epoch's last 3 steps is more than 3x the first steps' 2" in (
        guard.message
    )

    # At the last epoch's end a divergence stops: no step is left to take at a lower rate.
    last = LossGuard(factor=3.0, reference_steps=4, window=5, max_backoffs=3)
    last.set_params({"epochs": 2})
    _feed(last, [[2.3, 2.2, 2.1, 2.0], [50.0, 60.0, 70.0]])
    assert last.stopped and not last.backoffs and last.stopped_epoch == 1


def test_one_noisy_step_does_not_stop():
    guard = LossGuard(factor=3.0, reference_steps=4, window=5)
    losses = [[2.3] * 6 + [12.0] + [1.5] * 10, [1.0] * 10]
    _feed(guard, losses)
    assert not guard.stopped


@pytest.mark.parametrize(
    "kwargs",
    [
        {"factor": 1.0},
        {"reference_steps": 0},
        {"window": 2.5},
        {"max_backoffs": -1},
        {"backoff_factor": 1.0},
        {"restore_weights": False},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        LossGuard(**kwargs)


def _diverging_model(learning_rate):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        keras.optimizers.SGD(learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.mark.parametrize("schedule", [True, False])
def test_a_run_made_to_blow_up_backs_off_and_finishes(schedule, caplog):
    x, y = _data()
    # Plain SGD at 10 sends this network's loss far above its start within the first epoch;
    # a quarter of that rate trains it.
    rate = (
        schedules.WarmupPolynomialDecay(10.0, warmup_steps=16, total_steps=160)
        if schedule
        else 10.0
    )
    model = _diverging_model(rate)
    guard = LossGuard()
    with caplog.at_level("WARNING", logger="tpu_scale"):
        history = model.fit(x, y, batch_size=16, epochs=10, callbacks=[guard], verbose=0)
    assert not guard.stopped and guard.message is None
    assert len(history.history["loss"]) == 10  # every epoch ran
    assert 1 <= len(guard.backoffs) <= 3
    assert guard.learning_rate_scale == 0.5 ** len(guard.backoffs)
    assert guard.backoffs[0]["epoch"] == 1 and guard.backoffs[0]["loss"] > 10 * guard.reference_loss
    # Each back-off is logged with where it happened and the new rate.
    logged = [r.getMessage() for r in caplog.records if "continues at" in r.getMessage()]
    assert len(logged) == len(guard.backoffs)
    assert "at epoch 1, step" in logged[0] and "0.5 times the learning rate" in logged[0]
    # The run then trains: a low loss and the right answers, at the lowered rate.
    assert history.history["loss"][-1] < 0.2 and history.history["accuracy"][-1] > 0.95
    assert _finite(model)
    rate_now = keras_hook.learning_rate_of(model.optimizer)
    if schedule:
        assert isinstance(rate_now, schedules.ScaledSchedule)
        assert rate_now.peak_learning_rate == pytest.approx(10.0 * guard.learning_rate_scale)
    else:
        assert float(model.optimizer.learning_rate) == pytest.approx(
            10.0 * guard.learning_rate_scale
        )


def test_stops_naming_the_fix_when_backing_off_does_not_help():
    x, y = _data()
    model = _diverging_model(schedules.WarmupPolynomialDecay(1e9, warmup_steps=4, total_steps=160))
    guard = LossGuard(max_backoffs=2, learning_rate_flag="--peak_learning_rate")
    model.fit(x, y, batch_size=16, epochs=10, callbacks=[guard], verbose=0)
    assert guard.stopped and len(guard.backoffs) == 2
    assert "after 2 back-off(s) to 0.25 times the learning rate" in guard.message
    assert "--peak_learning_rate from 2.5e+08 to 1.25e+08" in guard.message
    assert _finite(model)


def test_scaled_schedule_scales_and_serializes():
    inner = schedules.WarmupPolynomialDecay(2.0, warmup_steps=4, total_steps=20)
    scaled = schedules.ScaledSchedule(inner, 0.25)
    for step in (0, 2, 4, 11, 20):
        assert float(scaled(step)) == pytest.approx(0.25 * float(inner(step)))
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(scaled))
    assert isinstance(again, schedules.ScaledSchedule) and again.factor == 0.25
    assert float(again(11)) == pytest.approx(float(scaled(11)))
    with pytest.raises(ValueError, match="factor"):
        schedules.ScaledSchedule(inner, 0.0)


# ------------------------------------------------------------------ AverageMovingStatistics


def _grouped_model(strategy, norm=None):
    norm = norm or (lambda: DistributedBatchNormalization(group_size=2, momentum=0.5))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6, 6, 2)),
                keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
                norm(),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def _grouped_data():
    rng = np.random.default_rng(1)
    # Batches of 16 give each of the 8 replicas 2 examples; replica r's are scaled by 1 + r, so
    # the groups' statistics differ.
    scale = 1 + (np.arange(64) % 16) // 2
    x = rng.normal(size=(64, 6, 6, 2)) * scale[:, None, None, None]
    x = x.astype("float32")
    y = rng.integers(0, 3, size=64)
    return x, y


def _copies_agree(variable):
    copies = [np.asarray(v) for v in variable.value.values]
    return all(np.array_equal(c, copies[0]) for c in copies)


@pytest.mark.parametrize("norm, average", [("keras", True), ("keras", False), ("grouped", False)])
def test_one_set_of_moving_statistics_makes_evaluation_the_saved_models(strategy, norm, average):
    """Keras's own layer needs the callback for one set of statistics; the package's has it at
    every step."""
    import tensorflow as tf

    x, y = _grouped_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    keras_local = lambda: keras.layers.BatchNormalization(momentum=0.5)  # noqa: E731
    model = _grouped_model(strategy, keras_local if norm == "keras" else None)
    bn = model.layers[1]
    agreed_at_validation = []

    class Watch(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            agreed_at_validation.append(_copies_agree(bn.moving_mean))

    callbacks = ([AverageMovingStatistics()] if average else []) + [Watch()]
    model.fit(data, validation_data=data, epochs=2, verbose=0, callbacks=callbacks)
    # The strategy's evaluation against the model called outside it (as saved: replica 0's
    # statistics).
    evaluated = model.evaluate(data, verbose=0)
    outside = float(
        np.mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=False), True))
    )
    if average or norm == "grouped":
        assert agreed_at_validation == [True, True]
        assert _copies_agree(bn.moving_mean) and _copies_agree(bn.moving_variance)
        assert evaluated == pytest.approx(outside, rel=1e-5)
    else:
        assert agreed_at_validation == [False, False]
        assert evaluated != pytest.approx(outside, rel=1e-3)
