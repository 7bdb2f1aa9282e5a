"""Tests for `tpu_scale.keras_hook`, the Keras seam: settings on the strategy, adoption of the
optimizers made under it and of no other, the start-up checks, how small the seam is."""

import inspect
import pathlib

import keras
import numpy as np
import pytest

import tpu_scale
from tpu_scale import keras_hook


def test_settings_are_checked():
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        keras_hook.Settings(algorithm="tree")
    with pytest.raises(ValueError, match="pack_bytes must be positive"):
        keras_hook.Settings(pack_bytes=-1)
    with pytest.raises(ValueError, match="gradient_reduction='ring'"):
        keras_hook.Settings(reduction="ring")
    assert keras_hook.Settings(gradient_dtype="float32").gradient_dtype is None


def test_the_strategy_holds_its_declared_settings():
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=8,
        mesh_shape=(2, 4),
        gradient_algorithm="ring",
        gradient_pack_bytes=1 << 20,
        weight_update_sharding=True,
    )
    settings = keras_hook.settings_for(strategy)
    assert settings is strategy.settings
    assert (settings.reduction, settings.algorithm, settings.pack_bytes) == ("torus", "ring", 1 << 20)
    assert settings.weight_update_sharding and strategy.gradient_reduction == "torus"
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        tpu_scale.create_strategy(num_cpu_replicas=8, gradient_algorithm="tree")


def _tiny_fit(strategy, optimizer_class=keras.optimizers.Lion):
    """A one-layer model compiled and fitted for one step under `strategy`; returns its
    optimizer."""
    x = np.ones((4, 3), "float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer_class(learning_rate=0.01), "mse")
    model.fit(x, np.zeros((4, 2), "float32"), batch_size=4, epochs=1, verbose=0)
    return model.optimizer


def test_fit_adopts_only_the_optimizer_of_a_model_under_a_strategy_of_the_package():
    import tensorflow as tf

    strategy = tpu_scale.create_strategy(num_cpu_replicas=2)
    with strategy.scope():
        made = keras.optimizers.Lion(learning_rate=0.01)
    assert type(made) is keras.optimizers.Lion  # creating an optimizer changes nothing
    adopted = _tiny_fit(strategy)
    other = _tiny_fit(tf.distribute.MirroredStrategy(["/cpu:0"]))
    plain = keras.optimizers.Lion(learning_rate=0.01)
    assert isinstance(adopted, keras_hook.Seam) and isinstance(adopted, keras.optimizers.Lion)
    assert type(adopted) is adopted.__class__  # honest: one class, whoever asks
    assert keras_hook.keras_class(adopted) is keras.optimizers.Lion
    assert type(other) is keras.optimizers.Lion and not isinstance(other, keras_hook.Seam)
    # Saved with its own class's configuration, and read back as Keras's own class.
    saved, plain_saved = (keras.saving.serialize_keras_object(o) for o in (adopted, plain))
    saved["config"].pop("name"), plain_saved["config"].pop("name")  # Keras numbers the names
    assert saved["config"] == plain_saved["config"] and saved["class_name"] == "Lion"
    restored = keras.saving.deserialize_keras_object(saved)
    assert type(restored) is keras.optimizers.Lion
    assert restored.get_config() == {**adopted.get_config(), "name": restored.name}
    keras_hook.uninstall(strategy)
    assert isinstance(_tiny_fit(strategy, keras.optimizers.SGD), keras_hook.Seam)  # accumulation
    assert strategy.gradient_reduction == "native"


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


def test_the_seam_replaces_one_private_keras_method():
    tpu_scale.create_strategy(num_cpu_replicas=2)  # installs what the seam installs
    replaced = _replaced_keras_methods()
    assert [(c, n) for c, n in replaced] == [(keras_hook._tf_trainer_class(), "_maybe_symbolic_build")]


def test_an_unsupported_keras_fails_at_start_up_naming_the_range_and_the_fix(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.11.3")
    with pytest.raises(ImportError) as raised:
        tpu_scale.create_strategy(num_cpu_replicas=2)
    message = str(raised.value)
    assert "Keras 3.11.3" in message and keras_hook.SUPPORTED_KERAS in message
    assert f"pip install 'keras{keras_hook.SUPPORTED_KERAS}'" in message


def test_a_keras_without_a_needed_private_name_fails_at_start_up(monkeypatch):
    from keras.src.backend.tensorflow import optimizer as module

    monkeypatch.delattr(module.TFOptimizer, "_all_reduce_sum_gradients")
    with pytest.raises(ImportError) as raised:
        tpu_scale.create_strategy(num_cpu_replicas=2)
    message = str(raised.value)
    assert "TFOptimizer._all_reduce_sum_gradients not found" in message
    assert keras.__version__ in message and keras_hook.SUPPORTED_KERAS in message


def test_a_fixed_keras_turns_the_workarounds_off_and_fit_still_adopts(monkeypatch):
    trainer = keras_hook._tf_trainer_class()
    calls = []

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):  # a Keras without the mean
        calls.append((iterator, data_batch))

    def _backend_apply_gradients(self, grads, trainable_variables):  # accumulation without a cond
        return None

    monkeypatch.setattr(trainer, "_maybe_symbolic_build", _maybe_symbolic_build)
    monkeypatch.setattr(keras.optimizers.Optimizer, "_backend_apply_gradients", _backend_apply_gradients)
    assert not keras_hook.build_from_one_replica_needed()
    assert not keras_hook.accumulation_needs_phases()
    strategy = tpu_scale.create_strategy(num_cpu_replicas=2)  # installs the hook on this Keras
    hook = trainer._maybe_symbolic_build
    assert hook._tpu_scale_original is _maybe_symbolic_build
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    iterator = object()
    hook(model, iterator=iterator)
    assert calls == [(iterator, None)]  # Keras's own method, given Keras's own iterator
    assert isinstance(model.optimizer, keras_hook.Seam)


def test_this_keras_still_needs_both_workarounds():
    # When one of these fails, Keras changed the code the workaround is for: run its removal test
    # (named in the workaround's docstring) to tell whether the bug is gone.
    assert keras_hook.build_from_one_replica_needed()
    assert keras_hook.accumulation_needs_phases()


def test_an_adopted_optimizer_trains_as_keras_with_the_native_sum():
    # The torus sum aside (tests/test_torus.py compares it), an adopted optimizer is Keras's own.
    x = np.random.RandomState(0).randn(32, 3).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    weights = []
    for reduction in ("native", "torus"):
        strategy = tpu_scale.create_strategy(num_cpu_replicas=2, gradient_reduction=reduction)
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(keras.optimizers.RMSprop(0.01), "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_install_requirements_pin_the_supported_keras():
    setup = (pathlib.Path(__file__).parents[1] / "setup.py").read_text()
    assert f'"keras{keras_hook.SUPPORTED_KERAS}"' in setup


def test_the_seam_docstring_lists_every_replaced_method():
    tpu_scale.create_strategy(num_cpu_replicas=2)
    doc = keras_hook.__doc__
    for _, name in _replaced_keras_methods():
        assert f"`{name}`" in doc or f"{name}`" in doc
