"""Tests for `tpu_scale.keras_hook`: registration per strategy, settings, the version check."""

import keras
import pytest

import tpu_scale
from tpu_scale import keras_hook


def test_settings_are_checked():
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        keras_hook.Settings(algorithm="tree")
    with pytest.raises(ValueError, match="pack_bytes must be positive"):
        keras_hook.Settings(pack_bytes=-1)


def test_create_strategy_registers_its_declared_settings():
    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=8,
        mesh_shape=(2, 4),
        gradient_algorithm="ring",
        gradient_pack_bytes=1 << 20,
    )
    settings = keras_hook.settings_for(strategy)
    assert (settings.algorithm, settings.pack_bytes) == ("ring", 1 << 20)
    assert keras_hook.is_installed()
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        tpu_scale.create_strategy(num_cpu_replicas=8, gradient_algorithm="tree")


def test_uninstall_one_strategy_keeps_the_others():
    a = tpu_scale.create_strategy(num_cpu_replicas=8)
    b = tpu_scale.create_strategy(num_cpu_replicas=8)
    keras_hook.uninstall(a)
    assert keras_hook.settings_for(a) is None and keras_hook.settings_for(b) is not None
    assert keras_hook.is_installed()
    keras_hook.install(a)
    assert keras_hook.settings_for(a) is not None


def test_a_keras_without_the_hooked_method_names_the_versions_that_work(monkeypatch):
    from keras.src.backend.tensorflow import optimizer as module

    monkeypatch.delattr(module.TFOptimizer, "_all_reduce_sum_gradients")
    with pytest.raises(ImportError) as raised:
        keras_hook.check_keras()
    message = str(raised.value)
    assert keras.__version__ in message and keras_hook.SUPPORTED_KERAS in message
    assert "gradient_reduction='native'" in message


def test_install_requirements_pin_the_supported_keras():
    import pathlib

    setup = (pathlib.Path(__file__).parents[1] / "setup.py").read_text()
    assert f'"keras{keras_hook.SUPPORTED_KERAS}"' in setup
