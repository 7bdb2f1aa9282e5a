"""A small, learnable, deterministic ImageNet stand-in: real JPEG files in classic-layout TFRecords.

Each class has its own colour and stripe orientation; every image gets a random stripe phase, a
colour jitter, noise, and a random size around `image_shape`, so random crops and flips keep the
class visible and a small CNN learns it in a few epochs. Used by the training example's default run
and by the tests.
"""

import math
import os

import numpy as np
import tensorflow as tf

from tpu_scale.data.schema import make_example, write_label_map


def _class_styles(num_classes):
    """A distinct (RGB colour, stripe angle, stripe frequency) per class."""
    styles = []
    for label in range(num_classes):
        hue = label / num_classes
        colour = 127.5 + 100.0 * np.array(
            [math.cos(2 * math.pi * (hue + shift)) for shift in (0.0, 1 / 3, 2 / 3)]
        )
        angle = math.pi * ((label * 0.618034) % 1.0)
        frequency = 2.0 + 2.0 * (label % 3)
        styles.append((colour, angle, frequency))
    return styles


def _render(rng, style, height, width):
    colour, angle, frequency = style
    y, x = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    phase = rng.uniform(0, 2 * math.pi)
    # The stripes keep their orientation under horizontal flips only up to a sign; the colour
    # disambiguates.
    stripes = np.sin(2 * math.pi * frequency * (x * math.cos(angle) + y * math.sin(angle)) + phase)
    image = colour * (0.75 + 0.25 * stripes[..., None])
    image += rng.uniform(-20, 20, size=3) + rng.normal(0, 8, size=(height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def _write_split(path_prefix, num_examples, num_shards, styles, image_shape, rng):
    height, width = image_shape
    writers = [
        tf.io.TFRecordWriter(f"{path_prefix}-{index:05d}-of-{num_shards:05d}")
        for index in range(num_shards)
    ]
    labels = np.arange(num_examples) % len(styles)
    rng.shuffle(labels)
    try:
        for index, label in enumerate(labels):
            # Up to 25% larger than image_shape, in either direction, so the crops have something to
            # do.
            image_height = int(height * rng.uniform(1.0, 1.25))
            image_width = int(width * rng.uniform(1.0, 1.25))
            image = _render(rng, styles[label], image_height, image_width)
            jpeg = tf.io.encode_jpeg(image, quality=90).numpy()
            example = make_example(
                jpeg,
                int(label) + 1,
                height=image_height,
                width=image_width,
                synset=f"class_{label:03d}",
                filename=f"{os.path.basename(path_prefix)}_{index:06d}.jpg",
            )
            writers[index % num_shards].write(example.SerializeToString())
    finally:
        for writer in writers:
            writer.close()
    # Example i went to file i % num_shards.
    counts = {
        f"{os.path.basename(path_prefix)}-{index:05d}-of-{num_shards:05d}": len(
            range(index, num_examples, num_shards)
        )
        for index in range(num_shards)
    }
    return f"{path_prefix}-*-of-{num_shards:05d}", counts


def make_synthetic_imagenet(
    output_dir,
    *,
    num_classes=10,
    train_examples=1280,
    validation_examples=320,
    image_shape=(64, 64),
    num_train_shards=4,
    num_validation_shards=2,
    seed=0,
    **renamed,
):
    """Writes a small learnable dataset of JPEGs as `train-*` and `validation-*` TFRecords.

    Labels are stored 1-based, as in the classic ImageNet files, and a `labels.json` label map says
    so (`ImageNetInput` and the training example read it). The same arguments always give
    byte-identical files.

    Args:
      output_dir: where to write (created if missing).
      num_classes: number of classes.
      train_examples: training examples, spread evenly over the classes.
      validation_examples: validation examples, spread evenly over the classes.
      image_shape: (height, width) of the smallest images; sizes vary up to 25% above it.
      num_train_shards: training files.
      num_validation_shards: validation files.
      seed: the random seed.

    Returns:
      A dict with the glob `train` and `validation` file patterns and `num_classes`.
    """
    for name in renamed:
        new = {"eval_examples": "validation_examples", "num_eval_shards": "num_validation_shards"}
        if name in new:
            raise TypeError(f"make_synthetic_imagenet: {name} is now {new[name]}.")
        raise TypeError(f"make_synthetic_imagenet() got an unexpected keyword argument {name!r}")
    tf.io.gfile.makedirs(output_dir)
    rng = np.random.default_rng(seed)
    styles = _class_styles(num_classes)
    train, train_counts = _write_split(
        os.path.join(output_dir, "train"),
        train_examples,
        num_train_shards,
        styles,
        image_shape,
        rng,
    )
    validation, validation_counts = _write_split(
        os.path.join(output_dir, "validation"),
        validation_examples,
        num_validation_shards,
        styles,
        image_shape,
        rng,
    )
    # The same label map the writer leaves, so readers take classes, offset and counts from it (and
    # each file's record count).
    write_label_map(
        output_dir,
        [f"class_{label:03d}" for label in range(num_classes)],
        label_offset=1,
        counts={"train": train_examples, "validation": validation_examples},
        record_counts={**train_counts, **validation_counts},
    )
    return {"train": train, "validation": validation, "num_classes": num_classes}
