"""keras_hub's image classifiers, built from small configs (nothing downloaded), converted whole."""

import os
import subprocess
import sys

import keras
import keras_hub
import numpy as np
import pytest

import tpu_scale
from tpu_scale.layers import (
    BatchNormalization,
    convert_batch_normalization,
    restore_batch_normalization,
)


def resnet():
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
    )
    converter = keras_hub.layers.ResNetImageConverter(image_size=(32, 32), scale=1 / 255.0)
    preprocessor = keras_hub.models.ResNetImageClassifierPreprocessor(image_converter=converter)
    return keras_hub.models.ResNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=preprocessor
    )


def densenet():
    backbone = keras_hub.models.DenseNetBackbone(stackwise_num_repeats=[1, 2], growth_rate=8)
    converter = keras_hub.layers.DenseNetImageConverter(image_size=(32, 32), scale=1 / 255.0)
    preprocessor = keras_hub.models.DenseNetImageClassifierPreprocessor(image_converter=converter)
    return keras_hub.models.DenseNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=preprocessor
    )


def mobilenet():
    # Its batch norms sit inside its own blocks (InvertedResidualBlock, ConvBnActBlock, ...).
    backbone = keras_hub.models.MobileNetBackbone(
        stackwise_expansion=[[16], [24, 24]],
        stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]],
        stackwise_kernel_size=[[3], [3, 3], [1]],
        stackwise_num_strides=[[2], [2, 1], [1]],
        stackwise_se_ratio=[[None], [0.25, 0.25]],
        stackwise_activation=[["relu"], ["hard_swish", "hard_swish"]],
        stackwise_padding=[[1], [1, 1], [1]],
        output_num_filters=32,
        depthwise_filters=8,
        depthwise_stride=2,
        depthwise_residual=False,
        last_layer_filter=48,
        squeeze_and_excite=0.5,
        input_num_filters=8,
    )
    converter = keras_hub.layers.MobileNetImageConverter(image_size=(32, 32), scale=1 / 255.0)
    preprocessor = keras_hub.models.MobileNetImageClassifierPreprocessor(image_converter=converter)
    return keras_hub.models.MobileNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=preprocessor
    )


def efficientnet():
    backbone = keras_hub.models.EfficientNetBackbone(
        stackwise_width_coefficients=[1.0] * 2,
        stackwise_depth_coefficients=[1.0] * 2,
        stackwise_kernel_sizes=[3, 3],
        stackwise_num_repeats=[1, 2],
        stackwise_input_filters=[16, 8],
        stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 4],
        stackwise_strides=[1, 2],
        stackwise_block_types=["v1", "v1"],
        stackwise_squeeze_and_excite_ratios=[0.25, 0.25],
        stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False],
        min_depth=None,
        use_depth_divisor_as_min_depth=True,
        dropout=0,
    )
    converter = keras_hub.layers.EfficientNetImageConverter(image_size=(32, 32), scale=1 / 255.0)
    preprocessor = keras_hub.models.EfficientNetImageClassifierPreprocessor(
        image_converter=converter
    )
    return keras_hub.models.EfficientNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=preprocessor
    )


def _batch_norms(model):
    return [x for x in model._flatten_layers() if isinstance(x, keras.layers.BatchNormalization)]


def _raw_photos(count, height=40, width=48, seed=0):
    """0-255 photos of another size than the converter's: the preprocessor resizes them."""
    return np.random.default_rng(seed).uniform(0, 255, (count, height, width, 3)).astype("float32")


def _randomize_statistics(model, seed):
    # Moving statistics and affine parameters away from their initial values, so that a layer
    # left behind or a weight not carried over changes the predictions.
    rng = np.random.default_rng(seed)
    for bn in _batch_norms(model):
        channels = bn.moving_mean.shape
        bn.moving_mean.assign(rng.normal(0.0, 0.3, channels))
        bn.moving_variance.assign(rng.uniform(0.5, 2.0, channels))
        bn.gamma.assign(rng.uniform(0.5, 1.5, channels))


@pytest.mark.parametrize("build", [resnet, densenet, mobilenet, efficientnet])
def test_classifier_converts_whole_under_the_strategy(build):
    strategy = tpu_scale.create_strategy(num_cpu_replicas=4)
    with strategy.scope():
        task = build()
        _randomize_statistics(task, seed=1)
        converted = convert_batch_normalization(task, group_size=2)
    assert type(converted) is type(task)
    assert type(converted.preprocessor) is type(task.preprocessor)
    assert type(converted.backbone) is type(task.backbone)
    before, after = _batch_norms(task), _batch_norms(converted)
    assert len(after) == len(before) > 0
    assert all(type(x) is BatchNormalization and x.group_size == 2 for x in after)
    assert not any(type(x) is BatchNormalization for x in before)
    photos = _raw_photos(6)
    np.testing.assert_allclose(
        converted.predict(photos, verbose=0), task.predict(photos, verbose=0), atol=1e-4
    )


def test_resnet_classifier_trains_and_reloads_after_import_tpu_scale(tmp_path):
    strategy = tpu_scale.create_strategy(num_cpu_replicas=4)
    with strategy.scope():
        task = convert_batch_normalization(resnet(), group_size=2)
        task.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    photos = _raw_photos(16, seed=2)
    labels = np.random.default_rng(3).integers(0, 3, 16)
    history = task.fit(photos, labels, batch_size=8, epochs=2, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    # One set of moving statistics after fit (groups of 2 on 4 replicas).
    for bn in _batch_norms(task):
        copies = [np.asarray(v) for v in bn.moving_mean.value.values]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    path = os.path.join(tmp_path, "classifier.keras")
    task.save(path)
    np.save(os.path.join(tmp_path, "photos.npy"), photos)
    np.save(os.path.join(tmp_path, "expected.npy"), task.predict(photos, verbose=0))
    code = (
        "import numpy as np, keras, tpu_scale\n"
        f"task = keras.models.load_model({path!r})\n"
        f"got = task.predict(np.load({os.path.join(tmp_path, 'photos.npy')!r}), verbose=0)\n"
        f"np.testing.assert_allclose(got, np.load({os.path.join(tmp_path, 'expected.npy')!r}), atol=1e-5)\n"
        "print(type(task).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ResNetImageClassifier")


def test_restore_gives_keras_layers_back_with_the_same_predictions():
    task = mobilenet()
    _randomize_statistics(task, seed=4)
    grouped = convert_batch_normalization(task, group_size=1)
    plain = restore_batch_normalization(grouped)
    assert type(plain) is type(task)
    assert all(type(x) is keras.layers.BatchNormalization for x in _batch_norms(plain))
    photos = _raw_photos(3)
    np.testing.assert_allclose(
        plain.predict(photos, verbose=0), task.predict(photos, verbose=0), atol=1e-5
    )
