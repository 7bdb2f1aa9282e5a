"""Image operations of the input builder: fused JPEG decode-and-crop, center crop, normalization.

The training crop reads only the JPEG header to learn the image shape, samples the crop window from
that shape, and then decodes only the window (`tf.image.decode_and_crop_jpeg`): the pixels outside
the window are never produced, which is what makes the host CPU fast enough to feed the accelerator.

All randomness is stateless and driven by an explicit `seed` (a `[2]` int tensor), so a pipeline can
be made reproducible by seeding its per-example seeds, and never depends on op-level random state.
"""

import functools
import math

import numpy as np
import tensorflow as tf

# Per-channel ImageNet statistics on the 0-255 scale.
IMAGENET_MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)

# The reference evaluation crop at 224: the center square of 224 / (224 + 32) of the short side.
# The same fraction at every output size (the reference's `size / (size + 32)` would keep half the
# short side at 32 pixels, where small images lose most of what they show).
CENTER_CROP_FRACTION = 224 / (224 + 32)

# The Inception-style random box of the reference ResNet-50 training recipe.
AREA_RANGE = (0.08, 1.0)
ASPECT_RATIO_RANGE = (3.0 / 4.0, 4.0 / 3.0)
MAX_ATTEMPTS = 10

# How an image that is not square becomes the square input (`InputConfig.aspect_ratio`): the
# whole image resized to the square (Keras's default), resized with its shape kept and padded
# with zeros (Keras's `pad_to_aspect_ratio`), or its centred square (`crop_to_aspect_ratio`, and
# the reference ImageNet evaluation crop).
ASPECT_RATIOS = ("stretch", "pad", "crop")

# How far from the end of a record the JPEG end-of-image marker may sit (some encoders append
# padding).
_EOI_SEARCH_BYTES = 1024


def center_crop_window(image_height, image_width, crop_fraction=CENTER_CROP_FRACTION):
    """The reference evaluation crop: a centered square of `crop_fraction` (by default 224 / 256) of
    the short side, at every output size.

    Args:
      image_height: int32 scalar tensor, the full image height.
      image_width: int32 scalar tensor, the full image width.
      crop_fraction: float in (0, 1], the square's side as a fraction of the short side.

    Returns:
      An int32 `[4]` tensor `[offset_y, offset_x, crop_height, crop_width]`.
    """
    short_side = tf.cast(tf.minimum(image_height, image_width), tf.float32)
    crop_size = tf.cast(short_side * crop_fraction, tf.int32)
    # A 1-pixel image would otherwise give an empty crop.
    crop_size = tf.maximum(crop_size, 1)
    offset_y = (image_height - crop_size + 1) // 2
    offset_x = (image_width - crop_size + 1) // 2
    return tf.stack([offset_y, offset_x, crop_size, crop_size])


def evaluation_window(image_height, image_width, crop_fraction=1.0, aspect_ratio="crop"):
    """The evaluation window: `center_crop_window` for "crop"; for "stretch" and "pad", the
    centred box of `crop_fraction` of each side (the whole image at 1.0).

    Returns:
      An int32 `[4]` tensor `[offset_y, offset_x, crop_height, crop_width]`.
    """
    if aspect_ratio == "crop":
        return center_crop_window(image_height, image_width, crop_fraction)
    size = tf.maximum(
        tf.cast(
            tf.cast(tf.stack([image_height, image_width]), tf.float32) * crop_fraction, tf.int32
        ),
        1,
    )
    offsets = (tf.stack([image_height, image_width]) - size + 1) // 2
    return tf.concat([offsets, size], 0)


def resize_to_square(image, image_size, aspect_ratio="stretch", method="bilinear"):
    """Resizes an `[h, w, c]` window to `[image_size, image_size, c]` (float32, 0-255 scale).

    "stretch" and "crop" resize it whole to the square (a "crop" window is square already, but
    for a rounding pixel); "pad" resizes it so that its long side is `image_size`, its shape kept
    (its short side at least one pixel, for a strip 1 pixel high), and centres it on zeros, as
    Keras's `pad_to_aspect_ratio` does.
    """
    if aspect_ratio != "pad":
        return tf.image.resize(image, [image_size, image_size], method=method)
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = image_size / tf.reduce_max(shape)
    size = tf.clip_by_value(tf.cast(tf.round(shape * scale), tf.int32), 1, image_size)
    resized = tf.image.resize(image, size, method=method)
    before = (image_size - size) // 2
    after = image_size - size - before
    padded = tf.pad(resized, [[before[0], after[0]], [before[1], after[1]], [0, 0]])
    return tf.ensure_shape(padded, [image_size, image_size, image.shape[-1]])


def sample_crop_window(
    image_height,
    image_width,
    seed,
    *,
    area_range=AREA_RANGE,
    aspect_ratio_range=ASPECT_RATIO_RANGE,
    max_attempts=MAX_ATTEMPTS,
):
    """Samples an Inception-style random crop window from an image shape alone.

    Each attempt draws an area fraction uniformly from `area_range` and an aspect ratio (width /
    height) log-uniformly from `aspect_ratio_range`; the first attempt whose box fits inside the
    image wins, and its position is uniform over the valid offsets. All attempts are drawn at once
    (they cost a few scalars), so there is no data-dependent loop. When no attempt fits (very
    elongated images), the window falls back to the evaluation center crop, as in the reference
    recipe.

    Args:
      image_height: int32 scalar tensor, the full image height.
      image_width: int32 scalar tensor, the full image width.
      seed: int32 or int64 `[2]` tensor, the stateless random seed of this example.
      area_range: (min, max) fraction of the image area covered by the crop.
      aspect_ratio_range: (min, max) of the crop's width / height.
      max_attempts: how many boxes to try before falling back to the center crop.

    Returns:
      An int32 `[4]` tensor `[offset_y, offset_x, crop_height, crop_width]`.
    """
    draws = tf.random.stateless_uniform([_draws_per_window(max_attempts)], seed)
    return _crop_window_from_draws(
        image_height,
        image_width,
        draws,
        area_range,
        aspect_ratio_range,
        max_attempts,
    )


def _draws_per_window(max_attempts):
    return 2 * max_attempts + 2  # an area and an aspect ratio per attempt, then the two offsets


def _crop_window_from_draws(
    image_height,
    image_width,
    draws,
    area_range,
    aspect_ratio_range,
    max_attempts,
    relative=False,
):
    # `relative`: the drawn aspect ratios are of the image's own (a box of the whole area is then
    # the whole image), and the fallback is the whole image, not its centred square.
    # Every random number of the window comes from one uniform draw: this runs once per image, and
    # each separate random op (seed split, key, draw, scaling) costs the map a few microseconds.
    height = tf.cast(image_height, tf.float32)
    width = tf.cast(image_width, tf.float32)
    area_draws, ratio_draws = draws[:max_attempts], draws[max_attempts : 2 * max_attempts]
    target_area = height * width * (area_range[0] + (area_range[1] - area_range[0]) * area_draws)
    log_low, log_high = math.log(aspect_ratio_range[0]), math.log(aspect_ratio_range[1])
    aspect_ratio = tf.exp(log_low + (log_high - log_low) * ratio_draws)
    if relative:
        aspect_ratio *= width / height
    crop_widths = tf.cast(tf.round(tf.sqrt(target_area * aspect_ratio)), tf.int32)
    crop_heights = tf.cast(tf.round(tf.sqrt(target_area / aspect_ratio)), tf.int32)
    fits = (
        (crop_heights >= 1)
        & (crop_widths >= 1)
        & (crop_heights <= image_height)
        & (crop_widths <= image_width)
    )

    any_fits = tf.reduce_any(fits)
    if relative:
        fallback = tf.stack([0, 0, image_height, image_width])
    else:
        fallback = center_crop_window(image_height, image_width)
    first_fit = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
    # Choosing the size before the offsets keeps the offset ranges non-empty when nothing fits.
    crop_height = tf.where(any_fits, crop_heights[first_fit], fallback[2])
    crop_width = tf.where(any_fits, crop_widths[first_fit], fallback[3])
    # Uniform over [0, image - crop]; the minimum guards the (measure-zero) draw of 1.0 after
    # rounding.
    slack = tf.cast(tf.stack([image_height - crop_height, image_width - crop_width]), tf.float32)
    offsets = tf.minimum(
        tf.cast(draws[2 * max_attempts : 2 * max_attempts + 2] * (slack + 1.0), tf.int32),
        tf.cast(slack, tf.int32),
    )
    sampled = tf.stack([offsets[0], offsets[1], crop_height, crop_width])
    return tf.where(any_fits, sampled, fallback)


def is_complete_jpeg(image_bytes):
    """Cheap structural check that a record holds a whole JPEG file (it never raises).

    A JPEG starts with the start-of-image marker `FF D8 FF` and ends with the end-of-image marker
    `FF D9` (allowing up to 1 KiB of trailing padding). This catches the common bad records (other
    formats, empty or truncated files) before the decoder sees them, so the pipeline can name the
    record or skip it. A file that passes but has a corrupt header can still fail inside the
    decoder (the pipeline recovers from that too, see `ImageNetInput`).

    Args:
      image_bytes: string tensor of encoded images, any shape (one image, or a batch of them).

    Returns:
      A bool tensor of `image_bytes`'s shape.
    """
    length = tf.strings.length(image_bytes)
    zeros = tf.zeros_like(length)
    head = tf.strings.substr(image_bytes, zeros, zeros + 3)
    tail_start = tf.maximum(length - _EOI_SEARCH_BYTES, 0)
    # Padding to a fixed width lets `decode_raw` give a fixed-length vector per image.
    tail = tf.strings.substr(image_bytes, tail_start, zeros + _EOI_SEARCH_BYTES)
    tail = tf.io.decode_raw(tail, tf.uint8, fixed_length=_EOI_SEARCH_BYTES)
    has_end_marker = tf.reduce_any((tail[..., :-1] == 0xFF) & (tail[..., 1:] == 0xD9), axis=-1)
    return (length >= 4) & tf.equal(head, JPEG_START) & has_end_marker


def is_complete_jpeg_bytes(image_bytes):
    """`is_complete_jpeg` of one image's Python bytes, computed on the host (the writer's check)."""
    tail = image_bytes[-_EOI_SEARCH_BYTES:]
    return len(image_bytes) >= 4 and image_bytes[:3] == JPEG_START and b"\xff\xd9" in tail


# The first bytes of a JPEG, and of the other formats `tf.io.decode_image` reads (WebP: "RIFF", a
# size, "WEBP").
JPEG_START = b"\xff\xd8\xff"
_OTHER_FORMAT_STARTS = (b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM")


def is_jpeg(image_bytes):
    """Whether encoded images start like a JPEG file (`FF D8 FF`); never raises.

    Args:
      image_bytes: string tensor, any shape.

    Returns:
      A bool tensor of `image_bytes`'s shape.
    """
    return tf.equal(tf.strings.substr(image_bytes, 0, 3), JPEG_START)


def is_decodable_image(image_bytes):
    """Cheap structural check that a record holds an image the pipeline decodes (never raises).

    A complete JPEG (`is_complete_jpeg`), or a file that starts like a PNG, GIF, BMP or WebP file:
    those go to `tf.io.decode_image` instead of the fused JPEG decode (`decode_and_random_crop`).
    Empty records, text, truncated JPEGs and other formats fail the check.

    Args:
      image_bytes: string tensor, any shape (one image, or a batch of them).

    Returns:
      A bool tensor of `image_bytes`'s shape.
    """
    other = tf.zeros_like(image_bytes, tf.bool)
    for start in _OTHER_FORMAT_STARTS:
        other |= tf.equal(tf.strings.substr(image_bytes, 0, len(start)), start)
    # `substr` fails at a position past a string's end: the head is padded to 12 bytes first.
    head = tf.strings.join([tf.strings.substr(image_bytes, 0, 12), b" " * 12])
    webp = tf.equal(tf.strings.substr(head, 0, 4), b"RIFF") & tf.equal(
        tf.strings.substr(head, 8, 4), b"WEBP"
    )
    return is_complete_jpeg(image_bytes) | other | webp


def _decode_cropped(image_bytes, window_of_shape, image_size):
    """Decodes the window `window_of_shape(height, width)` of an image: fused for a JPEG, after a
    full `tf.io.decode_image` for another format.

    Args:
      image_bytes: string scalar tensor, an encoded image.
      window_of_shape: maps the image's height and width (int32 scalars) to its window, an int32
        `[4]` `[offset_y, offset_x, height, width]`.
      image_size: as for `decode_window` (None: no scaled decode).

    Returns:
      A uint8 `[h, w, 3]` tensor.
    """

    def jpeg():
        shape = tf.image.extract_jpeg_shape(image_bytes)
        return decode_window(image_bytes, window_of_shape(shape[0], shape[1]), image_size)

    def other_format():
        image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        shape = tf.shape(image)
        window = window_of_shape(shape[0], shape[1])
        return tf.slice(
            image, tf.stack([window[0], window[1], 0]), tf.stack([window[2], window[3], 3])
        )

    return tf.cond(is_jpeg(image_bytes), jpeg, other_format)


# DCT-domain downscaling factors libjpeg offers while decoding.
DECODE_RATIOS = (1, 2, 4, 8)


def scaled_decode_ratio(crop_height, crop_width, image_size):
    """The largest libjpeg downscaling ratio (1, 2, 4 or 8) for a crop that is resized to
    `image_size`.

    A crop at least `r` times the output size in both dimensions can be decoded at ratio `r`
    (libjpeg then computes each output pixel from an `r x r` block in the DCT domain, at a fraction
    of the work) and still be resized down, never up.

    Args:
      crop_height: int32 scalar tensor, the crop window's height in full-size pixels.
      crop_width: int32 scalar tensor, the crop window's width.
      image_size: Python int, the output size.

    Returns:
      An int32 scalar tensor, one of `DECODE_RATIOS`.
    """
    short = tf.minimum(crop_height, crop_width)
    ratio = tf.constant(1, tf.int32)
    for r in DECODE_RATIOS[1:]:
        ratio = tf.where(short >= r * image_size, tf.constant(r, tf.int32), ratio)
    return ratio


def decode_window(image_bytes, window, image_size=None):
    """Decodes only `window` of a JPEG; with `image_size`, at the largest ratio the window allows.

    `tf.image.decode_and_crop_jpeg(..., ratio=r)` takes its window in the downscaled image's
    coordinates while `extract_jpeg_shape` reports the full size, so the window is mapped here: its
    start and end are divided by `r` and rounded to the nearest pixel (an offset of at most half a
    downscaled pixel, a quarter of an output pixel or less at the ratios chosen).

    Args:
      image_bytes: string scalar tensor, a JPEG file.
      window: int32 `[4]` `[offset_y, offset_x, height, width]` in full-size pixels.
      image_size: Python int, the size the window will be resized to; None decodes at full size.

    Returns:
      A uint8 `[h, w, 3]` tensor: the window, downscaled by the chosen ratio.
    """
    if image_size is None:
        return tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)
    ratio = scaled_decode_ratio(window[2], window[3], image_size)

    def at(r):
        def decode():
            if r == 1:
                return tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)
            start = (window[:2] + r // 2) // r
            end = (window[:2] + window[2:] + r // 2) // r
            scaled = tf.concat([start, tf.maximum(end - start, 1)], 0)
            return tf.image.decode_and_crop_jpeg(image_bytes, scaled, channels=3, ratio=r)

        return decode

    index = tf.cast(tf.math.log(tf.cast(ratio, tf.float32)) / math.log(2.0) + 0.5, tf.int32)
    return tf.switch_case(index, [at(r) for r in DECODE_RATIOS])


def decode_and_random_crop(
    image_bytes,
    image_size,
    seed,
    *,
    resize_method="bilinear",
    scaled_decode=False,
    dtype=tf.float32,
    area_range=AREA_RANGE,
    flip=True,
    translate_fraction=0.0,
    aspect_ratio="crop",
):
    """Fused training decode: random Inception box from the header, decode only that window, resize,
    translate, flip.

    A JPEG's window is decoded alone (`decode_and_crop_jpeg`); a PNG, GIF, BMP or WebP file is
    decoded in full (`tf.io.decode_image`) and then cut to the same window.

    Args:
      image_bytes: string scalar tensor, a JPEG file (or a PNG, GIF, BMP or WebP file).
      image_size: Python int, the output height and width.
      seed: `[2]` int tensor, the stateless seed of this example.
      resize_method: a `tf.image.ResizeMethod` name.
      scaled_decode: decode crops at least twice the output size at a reduced ratio
        (`decode_window`).
      dtype: `tf.float32`, or `tf.uint8` for the pixels rounded by `to_uint8` (flipped after the
        rounding, a quarter of the bytes to move; the same values as rounding the float result).
      area_range: (min, max) fraction of the image area the random box covers; None takes the
        whole image (its centred square for "crop").
      flip: whether half of the images are mirrored left to right.
      translate_fraction: the largest shift, as a fraction of `image_size`, of a random
        translation after the resize (`random_translate`: zero padding on every side, then a
        random `image_size` square of the padded image); 0 shifts nothing.
      aspect_ratio: one of `ASPECT_RATIOS`. "crop": Inception's boxes, of aspect ratios 3/4 to 4/3
        in pixels, resized to the square (the reference recipe). "stretch" and "pad": boxes of
        3/4 to 4/3 of the image's own aspect ratio, so the whole area is the whole image, resized
        by `resize_to_square`.

    Returns:
      A `[image_size, image_size, 3]` tensor in `dtype` on the 0-255 scale.
    """
    # One draw for the window, the flip and the shift: its first values are those
    # `sample_crop_window(..., seed)` draws (counter-based generator), the next one decides the
    # flip, the last two the shift.
    window_draws = _draws_per_window(MAX_ATTEMPTS)
    draws = tf.random.stateless_uniform([window_draws + 3], seed)

    def window_of_shape(height, width):
        if area_range is None:
            return evaluation_window(height, width, 1.0, aspect_ratio)
        return _crop_window_from_draws(
            height,
            width,
            draws[:window_draws],
            tuple(area_range),
            ASPECT_RATIO_RANGE,
            MAX_ATTEMPTS,
            relative=aspect_ratio != "crop",
        )

    image = _decode_cropped(image_bytes, window_of_shape, image_size if scaled_decode else None)
    image = resize_to_square(image, image_size, aspect_ratio, resize_method)
    if tf.as_dtype(dtype) == tf.uint8:
        image = to_uint8(image, resize_method)
    if translate_fraction:
        image = random_translate(image, translate_fraction, draws[window_draws + 1 :])
    if not flip:
        return image
    return tf.cond(draws[window_draws] < 0.5, lambda: tf.reverse(image, [1]), lambda: image)


def random_translate(image, fraction, draws):
    """Shifts a square image by up to `fraction` of its side in each direction, the pad-and-crop
    translation of CIFAR training: `round(fraction * side)` pixels of zeros on every side, then
    the square of the original side at a random offset (each offset uniform over its
    `2 * pad + 1` values). No pixel is resized, so strokes keep their width, and the content moves
    by whole pixels; what leaves one edge is lost and zeros come in at the other.

    Args:
      image: `[side, side, channels]` tensor with a static side.
      fraction: Python float in [0, 0.5), the largest shift as a fraction of the side.
      draws: `[2]` float tensor of uniform [0, 1) values: the vertical and horizontal offsets.

    Returns:
      The shifted image, of the same shape and dtype.
    """
    side = int(image.shape[0])
    pad = int(round(fraction * side))
    if pad == 0:
        return image
    offsets = tf.minimum(tf.cast(draws[:2] * (2 * pad + 1), tf.int32), 2 * pad)
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
    return tf.slice(padded, [offsets[0], offsets[1], 0], [side, side, -1])


def decode_and_center_crop(
    image_bytes,
    image_size,
    *,
    resize_method="bilinear",
    scaled_decode=False,
    dtype=tf.float32,
    crop_fraction=CENTER_CROP_FRACTION,
    aspect_ratio="crop",
):
    """Evaluation decode: the reference center crop (or, for "stretch" and "pad", the centred box
    of `crop_fraction` of each side), decoded as a window, then resized.

    Args:
      image_bytes: string scalar tensor, a JPEG file (or a PNG, GIF, BMP or WebP file, decoded in
        full and then cut).
      image_size: Python int, the output height and width.
      resize_method: a `tf.image.ResizeMethod` name.
      scaled_decode: as for `decode_and_random_crop`.
      dtype: as for `decode_and_random_crop`.
      crop_fraction: the side of the centered square as a fraction of the short side; 1.0 with a
        square image keeps all of it.
      aspect_ratio: one of `ASPECT_RATIOS`; 1.0 with "stretch" or "pad" keeps every image whole.

    Returns:
      A `[image_size, image_size, 3]` tensor in `dtype` on the 0-255 scale.
    """
    image = _decode_cropped(
        image_bytes,
        lambda height, width: evaluation_window(height, width, crop_fraction, aspect_ratio),
        image_size if scaled_decode else None,
    )
    image = resize_to_square(image, image_size, aspect_ratio, resize_method)
    return to_uint8(image, resize_method) if tf.as_dtype(dtype) == tf.uint8 else image


def normalize_image(image, dtype=tf.float32):
    """Subtracts the ImageNet mean and divides by the standard deviation, per channel.

    Computed as one multiply and one add, `image * (1 / std) + (-mean / std)`. When the image shape
    is static, both factors are full-size constants: on CPU, broadcasting a 3-vector over the
    channel axis costs several times an element-wise operation of the same size, and this runs once
    per image.

    Args:
      image: float tensor `[..., 3]` on the 0-255 scale.
      dtype: the output dtype (`tf.float32` or `tf.bfloat16`); the arithmetic is done in float32.

    Returns:
      The normalized tensor in `dtype`.
    """
    image = tf.cast(image, tf.float32)
    scale, offset = _normalization_factors(
        tuple(image.shape) if image.shape.is_fully_defined() else (3,)
    )
    return tf.cast(image * scale + offset, dtype)


# Resize methods whose output pixels are weighted means of input pixels (weights >= 0, summing to
# 1), so they stay within 0-255; the others (bicubic, lanczos, ...) can overshoot.
_WITHIN_RANGE_RESIZES = ("bilinear", "nearest", "area")


def to_uint8(image, resize_method=None):
    """Rounds float pixels on the 0-255 scale to uint8.

    The raw-pixel output of the pipeline: normalizing it later
    (`tpu_scale.layers.ImageNormalization`) equals `normalize_image` of the float pixels within half
    a grey level.

    Args:
      image: float tensor on the 0-255 scale.
      resize_method: the `tf.image.ResizeMethod` name that made `image` from uint8 pixels, if one
        did. After "bilinear", "nearest" or "area" the values cannot leave 0-255, and the
        saturating clip (one more pass over every pixel on the host) is
        skipped; otherwise (None, or a method that can overshoot) the values are clipped first.

    Returns:
      The uint8 tensor.
    """
    if resize_method in _WITHIN_RANGE_RESIZES:
        return tf.cast(tf.round(image), tf.uint8)
    return tf.saturate_cast(tf.round(image), tf.uint8)


@functools.lru_cache(maxsize=8)
def _normalization_factors(shape):
    scale = 1.0 / np.asarray(IMAGENET_STDDEV_RGB, np.float32)
    offset = -np.asarray(IMAGENET_MEAN_RGB, np.float32) * scale
    return np.broadcast_to(scale, shape).copy(), np.broadcast_to(offset, shape).copy()
