"""Ordinary Keras code, written as keras.io writes it, under the package's strategy and layers."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale.layers import convert_batch_normalization, restore_batch_normalization


def _photos(count=56, size=24, seed=0):
    """A small two-class image task: bright or dark squares, 0-255 pixels. 56 examples in batches
    of 16 leave a last batch of 8: 2 per replica on 4. (With one example a replica, TF 2.21's
    oneDNN fails this model's 1x1 strided convolution's filter gradient, with Keras's own layer
    too at a static batch of 1: "could not create a primitive descriptor for the reorder
    primitive".)"""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count)
    images = rng.uniform(0, 120, (count, size, size, 3)) + 100 * labels[:, None, None, None]
    return images.astype("float32"), labels


def make_model(input_shape, num_classes):
    """keras.io's "Image classification from scratch" model, at a tenth of its width."""
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    previous_block_activation = x
    for size in [16, 24]:
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.SeparableConv2D(size, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.SeparableConv2D(size, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = keras.layers.Conv2D(size, 1, strides=2, padding="same")(
            previous_block_activation
        )
        x = keras.layers.add([x, residual])
        previous_block_activation = x
    x = keras.layers.SeparableConv2D(32, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.25)(x)
    outputs = keras.layers.Dense(1 if num_classes == 2 else num_classes, activation=None)(x)
    return keras.Model(inputs, outputs)


def _unbatched_remainder_dataset(images, labels, batch_size):
    # As `keras.utils.image_dataset_from_directory` batches: the last batch is partial, so the
    # batch dimension is unknown when the step is traced.
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch_size)


def test_keras_io_from_scratch_trains_converted_with_the_default_group():
    images, labels = _photos()
    train_ds = _unbatched_remainder_dataset(images, labels, 16)
    assert train_ds.element_spec[0].shape[0] is None
    strategy = tpu_scale.create_strategy(num_cpu_replicas=4)
    with strategy.scope():
        model = convert_batch_normalization(make_model((24, 24, 3), 2))
        model.compile(
            optimizer=keras.optimizers.Adam(3e-4),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.BinaryAccuracy(name="acc")],
        )
    history = model.fit(train_ds, epochs=2, validation_data=train_ds, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    # The default group is the host's 4 replicas: one set of statistics, exact over the batch.
    bns = [x for x in model.layers if isinstance(x, tpu_scale.layers.DistributedBatchNormalization)]
    assert len(bns) == 6 and all(bn._resolved[1] == 4 for bn in bns)


def test_after_fit_one_set_of_moving_statistics_and_the_saved_model_agrees(tmp_path):
    images, labels = _photos(seed=1)
    train_ds = _unbatched_remainder_dataset(images, labels, 16)
    strategy = tpu_scale.create_strategy(num_cpu_replicas=4)
    with strategy.scope():
        model = convert_batch_normalization(make_model((24, 24, 3), 2), group_size=2)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    model.fit(train_ds, epochs=2, verbose=0)
    bns = [x for x in model.layers if isinstance(x, keras.layers.BatchNormalization)]
    for bn in bns:
        for variable in (bn.moving_mean, bn.moving_variance):
            copies = [np.asarray(v) for v in variable.value.values]
            assert len(copies) == 4
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0])
    # Groups of 2 of 4 replicas saw different examples; what moved is their mean, and it moved.
    assert not np.allclose(bns[0].moving_mean.numpy(), 0.0)
    under_strategy = model.predict(images, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    np.testing.assert_allclose(
        keras.models.load_model(path).predict(images, verbose=0), under_strategy, atol=1e-5
    )
    np.testing.assert_allclose(
        model.evaluate(train_ds, verbose=0),
        keras.models.load_model(path).evaluate(train_ds, verbose=0),
        rtol=1e-5,
    )


def test_import_tpu_scale_is_enough_to_load_a_saved_model(tmp_path):
    path = os.path.join(tmp_path, "converted.keras")
    model = convert_batch_normalization(make_model((24, 24, 3), 2), group_size=2)
    model.save(path)
    images, _ = _photos(count=4)
    np.save(os.path.join(tmp_path, "images.npy"), images)
    np.save(os.path.join(tmp_path, "expected.npy"), model.predict(images, verbose=0))
    # A fresh process, as a user's serving script: `import tpu_scale` and Keras's own loader.
    code = (
        "import sys, numpy as np, keras, tpu_scale\n"
        f"model = keras.models.load_model({path!r})\n"
        "kinds = {type(x) for x in model.layers}\n"
        "assert tpu_scale.layers.DistributedBatchNormalization in kinds, kinds\n"
        f"got = model.predict(np.load({os.path.join(tmp_path, 'images.npy')!r}), verbose=0)\n"
        f"np.testing.assert_array_equal(got, np.load({os.path.join(tmp_path, 'expected.npy')!r}))\n"
        "print('loaded')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("loaded")


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_weights_files_move_both_ways_between_keras_and_grouped_batch_norm(tmp_path, suffix):
    images, _ = _photos(count=4)
    keras_model = make_model((24, 24, 3), 2)
    grouped = convert_batch_normalization(make_model((24, 24, 3), 2), group_size=2)
    rng = np.random.default_rng(5)
    keras_model.set_weights([rng.normal(0.5, 0.2, w.shape) for w in keras_model.get_weights()])
    # Keras's model's file into the grouped model...
    path = os.path.join(tmp_path, "keras" + suffix)
    if suffix == ".keras":
        keras_model.save(path)
    else:
        keras_model.save_weights(path)
    grouped.load_weights(path)
    expected = keras_model.predict(images, verbose=0)
    np.testing.assert_allclose(grouped.predict(images, verbose=0), expected, rtol=1e-6)
    # ...and the grouped model's file back into a fresh Keras model.
    path = os.path.join(tmp_path, "grouped" + suffix)
    if suffix == ".keras":
        grouped.save(path)
    else:
        grouped.save_weights(path)
    fresh = make_model((24, 24, 3), 2)
    fresh.load_weights(path)
    np.testing.assert_allclose(fresh.predict(images, verbose=0), expected, rtol=1e-6)
    # Converted back to Keras's layer for sharing: the same model, Keras's classes only.
    restored = restore_batch_normalization(grouped)
    assert {type(x) for x in restored.layers} & {keras.layers.BatchNormalization}
    assert not any(isinstance(x, tpu_scale.layers.BatchNormalization) for x in restored.layers)
    np.testing.assert_allclose(restored.predict(images, verbose=0), expected, rtol=1e-6)
