"""Images of every shape: how a non-square image becomes the square input (`InputConfig.
aspect_ratio`), at each augmentation level, against Keras's own resize."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_scale import data
from tpu_scale.data import image_ops
from tpu_scale.recipe import AUGMENTATIONS, Recipe

CORNERS = {  # colour of the marker in each corner: top-left, top-right, bottom-left, bottom-right
    (0, 0): (255, 0, 0),
    (0, 1): (0, 255, 0),
    (1, 0): (0, 0, 255),
    (1, 1): (255, 255, 0),
}


def marked(height, width):
    """A grey image with a coloured marker an eighth of each side in each corner (a centred
    square of a 3:2 image cuts a sixth off each end)."""
    image = np.full((height, width, 3), 128, np.uint8)
    mh, mw = max(1, height // 8), max(1, width // 8)
    for (bottom, right), colour in CORNERS.items():
        rows = slice(height - mh, height) if bottom else slice(0, mh)
        cols = slice(width - mw, width) if right else slice(0, mw)
        image[rows, cols] = colour
    return image


def corners_shown(image):
    """The corners whose marker colour shows in that quarter of `image` (uint8 `[s, s, 3]`)."""
    half = image.shape[0] // 2
    shown = set()
    for (bottom, right), colour in CORNERS.items():
        quarter = image[half * bottom : half * (bottom + 1), half * right : half * (right + 1)]
        if (np.abs(quarter.astype(int) - colour).max(-1) < 40).any():
            shown.add((bottom, right))
    return shown


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Marked images in both orientations, PNG and JPEG, 3:2 and 16:9, written as records whose
    validation split holds the same images."""
    root = tmp_path_factory.mktemp("shapes")
    images = root / "images"
    for i, (height, width) in enumerate([(60, 90), (90, 60), (54, 96), (96, 54)]):
        folder = images / ("wide" if width > height else "tall")
        folder.mkdir(parents=True, exist_ok=True)
        pixels = marked(height, width)
        tf.io.write_file(str(folder / f"{i}.png"), tf.io.encode_png(pixels))
        tf.io.write_file(str(folder / f"{i}.jpg"), tf.io.encode_jpeg(pixels, quality=95))
    out = root / "records"
    data.write_tfrecords(str(images), str(out), 1, validation_dir=str(images))
    return str(out)


def _images(folder, config, is_training):
    inputs = data.inputs(folder, image_size=32, global_batch_size=8, dtype="uint8", config=config)
    pipeline = inputs.train if is_training else inputs.validation
    images = next(iter(pipeline.dataset()))[0].numpy()
    assert images.shape == (8, 32, 32, 3)
    return images


@pytest.mark.parametrize("level", ["none", "translate", "shift", "light"])
def test_levels_below_imagenets_show_the_whole_image(records, level):
    config = Recipe(64, "sgd", 0.1, 1.0, augmentation=level).input_config(
        data.InputConfig(seed=0, deterministic=True)
    )
    assert config.aspect_ratio == "stretch"
    # Evaluation shows all four corners of every image, at every level.
    for image in _images(records, config, is_training=False):
        assert corners_shown(image) == set(CORNERS)
    # Training shows it too at "none"; "translate" shifts it by up to an eighth (a marker's side),
    # "shift" and "light" draw boxes of three quarters or half of it.
    if level == "none":
        for image in _images(records, config, is_training=True):
            assert corners_shown(image) == set(CORNERS)


@pytest.mark.parametrize("aspect_ratio", ["stretch", "pad"])
def test_the_whole_image_is_shown_stretched_or_padded(records, aspect_ratio):
    config = data.InputConfig(**dict(AUGMENTATIONS["none"], aspect_ratio=aspect_ratio, seed=0))
    for is_training in (True, False):
        for image in _images(records, config, is_training):
            assert corners_shown(image) == set(CORNERS)
    # A centred square cuts the corners of every image off.
    crop = config.replace(aspect_ratio="crop")
    for is_training in (True, False):
        for image in _images(records, crop, is_training):
            assert corners_shown(image) != set(CORNERS)


def smooth(height, width):
    """A smooth colour image: resizes of it differ by their sampling, not by sharp edges."""
    y, x = np.mgrid[:height, :width]
    channels = [
        128 + 100 * np.sin(x / 9.0) * np.cos(y / 7.0),
        128 + 100 * np.cos(x / 11.0 + y / 13.0),
        60 + 0.5 * x + 0.5 * y,
    ]
    return np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)


KERAS_FITS = {
    "stretch": {},
    "crop": dict(crop_to_aspect_ratio=True),
    "pad": dict(pad_to_aspect_ratio=True),
}


@pytest.mark.parametrize("shape", [(60, 90), (90, 60), (45, 80), (33, 100)])
def test_the_whole_image_agrees_with_keras_resizing(shape):
    import keras

    pixels = smooth(*shape)
    png = tf.io.encode_png(pixels)
    theirs = {
        fit: keras.layers.Resizing(32, 32, **options)(pixels.astype("float32")).numpy()
        for fit, options in KERAS_FITS.items()
    }
    for fit in KERAS_FITS:
        ours = image_ops.decode_and_center_crop(png, 32, crop_fraction=1.0, aspect_ratio=fit)
        distance = {other: np.abs(ours.numpy() - theirs[other]).mean() for other in KERAS_FITS}
        if fit == "stretch":  # the same resize of the same pixels
            np.testing.assert_allclose(ours, theirs[fit], atol=1e-3)
        # "crop" rounds the centred square's offset up, Keras down; Keras pads before its resize,
        # the input after it (less to resize). Within those rows and columns they agree, and each
        # is far nearer Keras's own fit than the other two.
        assert distance[fit] < 8.0, distance
        assert distance[fit] < 0.5 * min(d for other, d in distance.items() if other != fit)


def test_training_boxes_of_the_images_own_shape():
    # Boxes drawn relative to the image's shape: a box of the whole area is the whole image, and
    # every box of a 16:9 image is between 3/4 and 4/3 of 16:9.
    for seed in range(50):
        window = image_ops._crop_window_from_draws(
            90,
            160,
            tf.random.stateless_uniform([image_ops._draws_per_window(10)], [seed, 0]),
            (0.5, 1.0),
            image_ops.ASPECT_RATIO_RANGE,
            10,
            relative=True,
        ).numpy()
        y, x, h, w = window
        assert 0 <= y and y + h <= 90 and 0 <= x and x + w <= 160
        assert 0.5 * 90 * 160 * 0.95 <= h * w
        assert 0.75 * 0.95 <= (w / h) / (160 / 90) <= 4 / 3 * 1.05


@pytest.mark.parametrize("shape", [(1, 2000), (4000, 3), (100, 1000), (1, 1)])
@pytest.mark.parametrize("aspect_ratio", ["stretch", "pad", "crop"])
def test_extreme_shapes_give_a_square(shape, aspect_ratio):
    rng = np.random.default_rng(0)
    png = tf.io.encode_png(rng.integers(0, 256, shape + (3,), dtype=np.uint8))
    seed = tf.constant([1, 2])
    for area_range in (None, (0.5, 1.0), (0.08, 1.0)):
        image = image_ops.decode_and_random_crop(
            png, 32, seed, area_range=area_range, aspect_ratio=aspect_ratio, scaled_decode=True
        )
        assert image.shape == (32, 32, 3) and np.isfinite(image.numpy()).all()
    image = image_ops.decode_and_center_crop(png, 32, crop_fraction=1.0, aspect_ratio=aspect_ratio)
    assert image.shape == (32, 32, 3)


def test_the_imagenet_level_reads_as_before():
    # The ImageNet level's reading: Inception's box from `sample_crop_window`, decoded, resized to
    # the square and flipped by the draw after the box; the evaluation's centred square of
    # 224 / 256 of the short side.
    config = AUGMENTATIONS["imagenet"]
    assert config["aspect_ratio"] == "crop" and config["center_crop_fraction"] == 224 / 256
    pixels = marked(75, 128)
    jpeg = tf.io.encode_jpeg(pixels, quality=95)
    for s in range(8):
        seed = tf.constant([s, 7])
        got = image_ops.decode_and_random_crop(jpeg, 32, seed, aspect_ratio="crop", flip=False)
        y, x, h, w = image_ops.sample_crop_window(75, 128, seed).numpy()
        window = tf.image.decode_and_crop_jpeg(jpeg, [y, x, h, w], channels=3)
        np.testing.assert_array_equal(got, tf.image.resize(window, [32, 32]))
    got = image_ops.decode_and_center_crop(jpeg, 32, aspect_ratio="crop")
    y, x, h, w = image_ops.center_crop_window(75, 128).numpy()
    assert (h, w) == (65, 65)
    window = tf.image.decode_and_crop_jpeg(jpeg, [y, x, h, w], channels=3)
    np.testing.assert_array_equal(got, tf.image.resize(window, [32, 32]))


def test_an_unknown_fit_names_the_choices():
    with pytest.raises(ValueError, match="stretch, pad, crop"):
        data.InputConfig(aspect_ratio="fill")
    with pytest.raises(ValueError, match="aspect_ratio"):
        Recipe(64, "sgd", 0.1, 1.0, aspect_ratio="fill")


def test_extreme_shapes_convert_and_train(tmp_path):
    # A 1x2000 strip, a 4000x3 line, a 10:1 panorama and a single pixel: converted (the PNGs
    # re-encoded as JPEG), then read at every fit, none skipped.
    rng = np.random.default_rng(0)
    shapes = {"strip.png": (1, 2000), "line.jpg": (4000, 3), "panorama.jpg": (100, 1000)}
    shapes["dot.png"] = (1, 1)
    for label in ("a", "b"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for name, shape in shapes.items():
            pixels = rng.integers(0, 256, shape + (3,), dtype=np.uint8)
            encoded = tf.io.encode_png(pixels) if name.endswith("png") else tf.io.encode_jpeg(pixels)
            tf.io.write_file(str(tmp_path / "images" / label / name), encoded)
    images = str(tmp_path / "images")
    summary = data.write_tfrecords(images, str(tmp_path / "records"), 1, validation_dir=images)
    assert summary.num_examples == 16 and summary.num_skipped == 0
    # The writer counts the images that are not square (all but the dots), for the recipe.
    assert summary.num_non_square == 12 and "not square: 12" in summary.describe()
    assert data.read_label_map(str(tmp_path / "records")).non_square_fraction == 0.75
    for fit in image_ops.ASPECT_RATIOS:
        config = data.InputConfig(aspect_ratio=fit, crop_area_range=(0.5, 1.0), seed=0)
        inputs = data.inputs(str(tmp_path / "records"), image_size=32, global_batch_size=8, config=config)
        assert next(iter(inputs.train.dataset()))[0].shape == (8, 32, 32, 3)
        assert next(iter(inputs.validation.dataset()))[0].shape == (8, 32, 32, 3)
        assert inputs.train.skipped_records == inputs.validation.skipped_records == 0


def test_square_images_read_the_same_at_every_fit():
    # On a square image the whole image is its centred square, and a box of the image's own shape
    # is a box of Inception's: "stretch" reads what "crop" (the reading before the fits) reads, so
    # square folders train as before; "pad" too, but for the random boxes it keeps the shape of.
    pixels = smooth(48, 48)
    for encoded in (tf.io.encode_png(pixels), tf.io.encode_jpeg(pixels, quality=95)):
        for area_range in (None, (0.5, 1.0), (0.08, 1.0)):
            for s in range(4):
                seed = tf.constant([s, 3])
                read = {
                    fit: image_ops.decode_and_random_crop(
                        encoded, 32, seed, area_range=area_range, aspect_ratio=fit
                    ).numpy()
                    for fit in image_ops.ASPECT_RATIOS
                }
                np.testing.assert_array_equal(read["stretch"], read["crop"])
                if area_range is None:
                    np.testing.assert_array_equal(read["pad"], read["crop"])
        read = {
            fit: image_ops.decode_and_center_crop(encoded, 32, crop_fraction=1.0, aspect_ratio=fit)
            for fit in image_ops.ASPECT_RATIOS
        }
        np.testing.assert_array_equal(read["stretch"], read["crop"])
        np.testing.assert_array_equal(read["pad"], read["crop"])
