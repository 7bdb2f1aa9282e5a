"""Tests for `tpu_scale.keras_hook`, the Keras seam: settings on the strategy, the optimizer wrapper
(no optimizer's class changed, Keras's own update), the start-up checks, no Keras method replaced."""

import inspect
import pathlib

import keras
import numpy as np
import pytest

import tpu_scale
from tpu_scale import keras_hook


def test_settings_are_checked():
    with pytest.raises(ValueError, match="choose one of \\('auto'"):
        keras_hook.Settings(algorithm="tree")
    with pytest.raises(ValueError, match="pack_bytes must be positive"):
        keras_hook.Settings(pack_bytes=-1)
    with pytest.raises(ValueError, match="gradient_reduction='ring'"):
        keras_hook.Settings(reduction="ring")
    assert keras_hook.Settings(gradient_dtype="float32").gradient_dtype is None


def test_the_strategy_holds_its_declared_settings():
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=8, mesh_shape=(2, 4), gradient_algorithm="ring", gradient_pack_bytes=1 << 20
    )
    settings = keras_hook.settings_for(strategy)
    assert settings is strategy.settings
    assert (settings.reduction, settings.algorithm, settings.pack_bytes) == ("torus", "ring", 1 << 20)
    assert strategy.gradient_reduction == "torus"
    ops = strategy.cross_device_ops
    assert isinstance(ops, tpu_scale.TorusAllReduce) and ops.strategy is strategy
    assert (ops.algorithm, ops.pack_bytes) == ("ring", 1 << 20)
    assert tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native").cross_device_ops is None
    with pytest.raises(ValueError, match="choose one of \\('auto'"):
        tpu_scale.create_strategy(num_cpu_replicas=8, gradient_algorithm="tree")


def _tiny_fit(strategy, optimizer):
    """A one-layer model compiled with `optimizer()` and fitted for two steps under `strategy`;
    returns the model."""
    x = np.random.RandomState(0).randn(8, 3).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer(), "mse")
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=4, epochs=1, verbose=0, shuffle=False)
    return model


def test_no_optimizer_changes_class_and_the_wrapper_is_keras_own_update():
    # Under the package's strategy a plain optimizer stays what it was made as, and trains as under
    # TensorFlow's own strategy; wrapped, it trains the same, and the wrapper delegates.
    import tensorflow as tf

    strategy = tpu_scale.create_strategy(num_cpu_replicas=2)
    plain = _tiny_fit(strategy, lambda: keras.optimizers.Lion(learning_rate=0.01))
    assert type(plain.optimizer) is keras.optimizers.Lion
    wrapped = _tiny_fit(
        strategy, lambda: tpu_scale.DistributedOptimizer(keras.optimizers.Lion(learning_rate=0.01))
    )
    assert type(wrapped.optimizer) is tpu_scale.DistributedOptimizer
    assert type(wrapped.optimizer.inner_optimizer) is keras.optimizers.Lion
    assert int(wrapped.optimizer.iterations.numpy()) == 2
    assert float(wrapped.optimizer.learning_rate.numpy()) == pytest.approx(0.01)
    reference = _tiny_fit(
        tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], tf.distribute.ReductionToOneDevice()),
        lambda: keras.optimizers.Lion(learning_rate=0.01),
    )
    for a, b, c in zip(plain.get_weights(), wrapped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(b, c, rtol=1e-6, atol=1e-7)


def test_the_wrapper_is_refused_where_it_has_nothing_to_wrap():
    with pytest.raises(ValueError, match="wraps a keras.optimizers.Optimizer"):
        tpu_scale.DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="takes no clipnorm: set them on the optimizer it wraps"):
        tpu_scale.DistributedOptimizer(keras.optimizers.SGD(), clipnorm=1.0)
    once = tpu_scale.DistributedOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already a tpu_scale.DistributedOptimizer"):
        tpu_scale.DistributedOptimizer(once)


def _replaced_keras_methods():
    """Every function on a Keras class that the package put there: `(class, name)`."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    classes = {keras_hook._tf_trainer_class(), TFOptimizer, keras.Model, keras.optimizers.Optimizer}
    classes |= {
        getattr(keras.optimizers, name)
        for name in dir(keras.optimizers)
        if inspect.isclass(getattr(keras.optimizers, name))
    }
    replaced = []
    for cls in classes:
        for name, value in vars(cls).items():
            if getattr(value, "__module__", "").startswith("tpu_scale"):
                replaced.append((cls, name))
    return replaced


def test_the_package_replaces_no_keras_method():
    strategy = tpu_scale.create_strategy(num_cpu_replicas=2)
    _tiny_fit(strategy, lambda: keras.optimizers.SGD(0.1))
    assert _replaced_keras_methods() == []


def test_an_unsupported_keras_fails_at_start_up_naming_the_range_and_the_fix(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.11.3")
    with pytest.raises(ImportError) as raised:
        tpu_scale.create_strategy(num_cpu_replicas=2)
    message = str(raised.value)
    assert "Keras 3.11.3" in message and keras_hook.SUPPORTED_KERAS in message
    assert f"pip install 'keras{keras_hook.SUPPORTED_KERAS}'" in message


def test_a_keras_without_a_needed_private_name_fails_at_start_up(monkeypatch):
    from keras.src.optimizers import base_optimizer as module

    monkeypatch.delattr(module.BaseOptimizer, "_get_variable_index")
    with pytest.raises(ImportError) as raised:
        tpu_scale.create_strategy(num_cpu_replicas=2)
    message = str(raised.value)
    assert "BaseOptimizer._get_variable_index not found" in message
    assert keras.__version__ in message and keras_hook.SUPPORTED_KERAS in message


def test_this_keras_still_needs_the_accumulation_workaround():
    # When this fails, Keras changed the code the workaround is for: run its removal test (named in
    # the workaround's docstring) to tell whether the bug is gone.
    assert keras_hook.accumulation_needs_phases()


def test_install_requirements_pin_the_supported_keras():
    setup = (pathlib.Path(__file__).parents[1] / "setup.py").read_text()
    assert f'"keras{keras_hook.SUPPORTED_KERAS}"' in setup
