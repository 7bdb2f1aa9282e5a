"""Tests for `tpu_scale.optimizers.LARS`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_scale.distribute.strategy  # its MirroredStrategy has private collective keys: tests share a process
from tpu_scale.optimizers import LARS


def numpy_lars(weights, grads, lr, momentum, weight_decay, eta, adapt, decay):
    """Hand-written LARS over several steps for one variable; returns the weights after each."""
    w = np.array(weights, np.float64)
    v = np.zeros_like(w)
    history = []
    for g, step_lr in zip(grads, lr):
        g = np.asarray(g, np.float64)
        wd = weight_decay if decay else 0.0
        local_lr = step_lr
        if adapt:
            w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
            if w_norm > 0 and g_norm > 0:
                local_lr = step_lr * eta * w_norm / (g_norm + wd * w_norm)
        v = momentum * v + local_lr * (g + wd * w)
        w = w - v
        history.append(w.copy())
    return history


def _grads(rng, shape, steps):
    return [rng.normal(size=shape).astype(np.float32) for _ in range(steps)]


def test_matches_hand_computed_update_over_several_steps():
    rng = np.random.default_rng(0)
    kernel0 = rng.normal(size=(3, 4)).astype(np.float32)
    bias0 = rng.normal(size=(4,)).astype(np.float32)
    kernel = keras.Variable(kernel0, name="kernel")
    bias = keras.Variable(bias0, name="bias")
    steps = 4
    kernel_grads, bias_grads = _grads(rng, (3, 4), steps), _grads(rng, (4,), steps)
    # A schedule, so the per-step learning rate is checked too.
    lrs = [2.0, 3.0, 5.0, 4.0]
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0, 1, 2], lrs)  # step i -> lrs[i]
    opt = LARS(learning_rate=schedule, momentum=0.9, weight_decay=0.01, eta=0.002)

    for kg, bg in zip(kernel_grads, bias_grads):
        opt.apply([tf.constant(kg), tf.constant(bg)], [kernel, bias])

    want_kernel = numpy_lars(kernel0, kernel_grads, lrs, 0.9, 0.01, 0.002, True, True)[-1]
    want_bias = numpy_lars(bias0, bias_grads, lrs, 0.9, 0.01, 0.002, False, False)[-1]
    np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bias.numpy(), want_bias, rtol=1e-5, atol=1e-6)
    # The excluded bias moved by plain momentum SGD at the full learning rate, far more than
    # the adapted kernel: the two rules really differ.
    assert np.abs(bias.numpy() - bias0).max() > 10 * np.abs(kernel.numpy() - kernel0).max()


def test_exclusion_rules_are_configurable():
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(5,)).astype(np.float32)
    k0 = rng.normal(size=(2, 3)).astype(np.float32)
    vector = keras.Variable(w0, name="scale")
    kernel = keras.Variable(k0, name="kernel")
    grads = [_grads(rng, (5,), 3), _grads(rng, (2, 3), 3)]
    # Rank-1 variables adapted; the kernel excluded by name from decay only.
    opt = LARS(
        learning_rate=1.0,
        weight_decay=0.1,
        exclude_vectors=False,
        exclude_from_weight_decay=["kernel"],
        exclude_from_layer_adaptation=[],
    )
    for g1, g2 in zip(*grads):
        opt.apply([tf.constant(g1), tf.constant(g2)], [vector, kernel])
    np.testing.assert_allclose(
        vector.numpy(),
        numpy_lars(w0, grads[0], [1.0] * 3, 0.9, 0.1, 0.001, True, True)[-1],
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        kernel.numpy(),
        numpy_lars(k0, grads[1], [1.0] * 3, 0.9, 0.1, 0.001, True, False)[-1],
        rtol=1e-5,
        atol=1e-6,
    )


def test_default_rule_on_a_real_model():
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.Conv2D(2, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="conv_bn")(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(3, name="fc")(x)
    model = keras.Model(inputs, outputs)
    opt = LARS(weight_decay=1e-4)
    opt.build(model.trainable_variables)
    adapted = {v.path for v, a in zip(model.trainable_variables, opt._adapt_flags) if a}
    decayed = {v.path for v, d in zip(model.trainable_variables, opt._decay_flags) if d}
    assert adapted == decayed == {"conv/kernel", "fc/kernel"}
    # The inherited `exclude_from_weight_decay()` method still works, on top of the rule.
    opt = LARS(weight_decay=1e-4, learning_rate=25)
    opt.exclude_from_weight_decay(var_list=[model.get_layer("fc").kernel])
    opt.build(model.trainable_variables)
    decayed = {v.path for v, d in zip(model.trainable_variables, opt._decay_flags) if d}
    assert decayed == {"conv/kernel"}


def test_zero_weights_fall_back_to_plain_learning_rate():
    w = keras.Variable(np.zeros((2, 2), np.float32), name="kernel")
    opt = LARS(learning_rate=0.5, momentum=0.0)
    opt.apply([tf.ones((2, 2))], [w])
    np.testing.assert_allclose(w.numpy(), -0.5 * np.ones((2, 2)))


def test_config_round_trip_and_model_saving(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(3.0, 100, 0.5)
    opt = LARS(
        learning_rate=schedule,
        momentum=0.8,
        weight_decay=5e-5,
        eta=0.01,
        exclude_from_weight_decay=["bn"],
        exclude_vectors=False,
    )
    config = opt.get_config()
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, LARS)
    assert clone.get_config() == config
    assert clone._wd_patterns == ("bn",) and clone._adapt_patterns == ("bn",)
    assert clone.weight_decay == 5e-5 and clone.eta == 0.01 and clone.momentum == 0.8

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored.optimizer, LARS)
    assert restored.optimizer.get_config()["eta"] == 0.01
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"weight_decay": -1e-4}, "weight_decay"),
        ({"eta": 0.0}, "eta"),
        ({"exclude_from_weight_decay": "bias"}, "list"),
        ({"exclude_from_layer_adaptation": ["("]}, "regular expression"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LARS(**kwargs)


def _regression_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


# Always all 8 devices: collective group keys are numbered from 1 by every strategy in the
# process, and a strategy over a different number of devices would join the same group with
# another size and abort the process's collectives for good.
def _fit(strategy, data, steps, policy=None):
    previous = keras.mixed_precision.global_policy()
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope():
            model = _regression_model(seed=3)
            model.compile(optimizer=LARS(learning_rate=2.0, weight_decay=1e-3), loss="mse")
        x, y = data
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
        return model
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_fit_under_mirrored_strategy_matches_one_device(cpu_devices):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(48, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1))).astype(np.float32)
    single = _fit(tf.distribute.OneDeviceStrategy(cpu_devices[0]), (x, y), steps=3)
    mirrored = _fit(tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices), (x, y), steps=3)
    start = _regression_model(seed=3)
    for a, b, s in zip(single.weights, mirrored.weights, start.weights):
        assert np.abs(a.numpy() - s.numpy()).max() > 1e-4  # training moved the weights
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


def test_mixed_bfloat16_keeps_float32_master_weights(cpu_devices):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    model = _fit(
        tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices), (x, y), steps=2, policy="mixed_bfloat16"
    )
    assert model.layers[0].compute_dtype == "bfloat16"
    start = _regression_model(seed=3)
    for w, s in zip(model.weights, start.weights):
        assert w.dtype == "float32"
        assert np.all(np.isfinite(w.numpy()))
        assert np.abs(w.numpy() - s.numpy()).max() > 1e-4
    assert all(v.dtype == "float32" for v in model.optimizer.momentums)
