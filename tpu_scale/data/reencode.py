"""Image files made into the JPEG bytes the writer stores: decoded in full, re-encoded if needed.

The input pipeline's fused decode reads JPEG only, and a file that is truncated or corrupt anywhere
must fail here rather than in training: every image is decoded in full. JPEGs are kept byte for
byte; other formats (PNG, GIF, BMP, WebP), CMYK JPEGs and JPEGs whose EXIF orientation tag says
they are rotated or mirrored (turned upright, as a viewer shows them) are re-encoded as RGB JPEGs.

No decoder sees an image of more than `max_pixels` pixels (a "decompression bomb": a few KB of file
that decodes to gigabytes): the size is read from the header first, by TensorFlow's
`extract_jpeg_shape` for a JPEG (before Pillow, which reads a photo's orientation and turns it, or
TensorFlow's decoder see it) and by Pillow's `Image.open`, which reads the header only, for the
other formats. Such a file is skipped (`TOO_MANY_PIXELS`). Pillow's own process-wide limit
(`Image.MAX_IMAGE_PIXELS`) is left as the user set it.
"""

import io
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tpu_scale.data import image_ops
from tpu_scale.data.names import shown

# Why a file was skipped (keys of the writer's `TFRecordSummary.skipped`).
UNDECODABLE = "not a decodable image"
CORRUPT_JPEG = "truncated or corrupt JPEG"
UNREADABLE = "unreadable file"
TOO_MANY_PIXELS = "image above the pixel cap (max_pixels, --max_pixels): a decompression bomb?"

# Pillow's own default limit (Image.MAX_IMAGE_PIXELS, a 0.25 GiB RGB image, about 9500 x 9500): an
# image this package takes never makes Pillow warn, and most camera photos (up to 89 megapixels)
# are below it.
DEFAULT_MAX_PIXELS = 89_478_485

_REENCODE_QUALITY = 95
_EXIF_ORIENTATION = 0x0112
# A JPEG holding none of these holds no orientation tag that Pillow's `getexif` reads (an EXIF
# segment starts "Exif", an XMP packet's tag is "tiff:Orientation"), so it is upright.
_ORIENTATION_MARKERS = (b"Exif\x00", b"Orientation")


class Decoded(NamedTuple):
    """What `decode_in_graph` made of a file's bytes: TensorFlow decoded them in full.

    Attributes:
      height: the image height.
      width: the image width.
      jpeg: the RGB JPEG re-encoding of an image in another format (PNG, GIF, BMP, WebP); empty
        for a JPEG, which `checked_jpeg` keeps as it is or re-encodes itself.
      channels: a JPEG's colour components as its header states them (1 grey, 3 colour, 4 CMYK);
        3 for the other formats, decoded to RGB.
    """

    height: int
    width: int
    jpeg: bytes
    channels: int


class Skip(Exception):
    """A file the writer leaves out, with the reason (`UNDECODABLE`, `CORRUPT_JPEG`, ...)."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def as_rgb_jpeg(image_bytes, path="", *, max_pixels=DEFAULT_MAX_PIXELS):
    """Returns `(jpeg_bytes, height, width, reencoded)`: JPEG bytes the pipeline can decode.

    The image is decoded in full, so a file that is truncated or corrupt anywhere fails here rather
    than in training.

    Args:
      image_bytes: the file's bytes (JPEG, PNG, GIF, BMP or WebP).
      path: the file's path, for error messages.
      max_pixels: images with more pixels are refused before they are decoded.

    Returns:
      The JPEG bytes (unchanged for grey or RGB JPEGs), the image height and width, and whether it
      was re-encoded.

    Raises:
      ValueError: if the bytes are not a decodable image.
    """
    try:
        return checked_jpeg(image_bytes, max_pixels=max_pixels)
    except Skip as skip:
        raise ValueError(f"{shown(path)} is not usable: {skip.reason}.") from None


def checked_jpeg(image_bytes, decoded=None, *, max_pixels=DEFAULT_MAX_PIXELS):
    """`as_rgb_jpeg`, raising `Skip` with the reason for a file that is not usable.

    Args:
      image_bytes: the file's bytes.
      decoded: the `Decoded` that `decode_in_graph` returned for these bytes, when TensorFlow has
        already decoded them (the local writer decodes in a `tf.data` pipeline, off Python's lock);
        None to decode them here. Either way the same ops decide, so the result is the same.
        A `Decoded` with `channels` 0 (`decode_in_graph` left the image to this function) counts
        as None.
      max_pixels: images with more pixels are skipped (`TOO_MANY_PIXELS`) before any decoder
        sees them.
    """
    if decoded is not None and decoded.channels == NOT_DECODED:
        decoded = None
    if image_bytes[:3] == image_ops.JPEG_START:
        # The reader's structural check must accept what is stored: a JPEG without its end-of-image
        # marker is truncated even when libjpeg decodes the part that is there.
        if not image_ops.is_complete_jpeg_bytes(image_bytes):
            raise Skip(CORRUPT_JPEG)
        if decoded is None:
            # The size from the frame header, before Pillow's header parse or a decoder sees it.
            try:
                size = tf.io.extract_jpeg_shape(image_bytes).numpy().tolist()[:2]
            except tf.errors.InvalidArgumentError:
                raise Skip(CORRUPT_JPEG) from None
            check_pixels(*size, max_pixels)
        try:
            # The header (size, components, orientation), and TensorFlow's decoder, the one the
            # input pipeline runs, on the whole file.
            height, width, channels, orientation = _jpeg_header(image_bytes, decoded)
            pixels = None if decoded is not None else tf.io.decode_jpeg(image_bytes, channels=3)
        except _pillow_bomb_error():
            raise Skip(TOO_MANY_PIXELS) from None  # Pillow's own limit, lower than max_pixels
        except (tf.errors.InvalidArgumentError, OSError, SyntaxError, ValueError):
            raise Skip(CORRUPT_JPEG) from None
        # Cameras store the sensor's pixels and a tag saying how to turn them; the decoder
        # ignores the tag, so such photos are turned here, as a viewer shows them.
        if orientation != 1:
            del pixels  # TensorFlow's decode proved the file whole; Pillow's is the one kept
            try:
                image = _upright(image_bytes)
            except _pillow_bomb_error():
                raise Skip(TOO_MANY_PIXELS) from None
            except (OSError, SyntaxError, ValueError):
                raise Skip(CORRUPT_JPEG) from None
        elif channels in (1, 3):
            return image_bytes, height, width, False
        else:
            # CMYK: libjpeg's RGB conversion, re-encoded
            image = tf.io.decode_jpeg(image_bytes, channels=3) if pixels is None else pixels
    elif decoded is not None:
        return decoded.jpeg, decoded.height, decoded.width, True
    else:
        height, width, frames = header_size(image_bytes)
        check_pixels(height, width * frames, max_pixels)
        try:
            image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        except tf.errors.InvalidArgumentError:
            raise Skip(UNDECODABLE) from None
    jpeg = tf.io.encode_jpeg(image, quality=_REENCODE_QUALITY).numpy()
    return jpeg, int(image.shape[0]), int(image.shape[1]), True


def check_pixels(height, width, max_pixels):
    """Raises `Skip(TOO_MANY_PIXELS)` for an image of more than `max_pixels` pixels."""
    if height * width > max_pixels:
        raise Skip(TOO_MANY_PIXELS)


def _pillow_bomb_error():
    from PIL import Image

    return Image.DecompressionBombError


def header_size(image):
    """`(height, width, frames)` from an image's header, read by Pillow (`Image.open` reads the
    header only, whatever the file holds after it). `frames` counts a GIF's frames, which
    TensorFlow's GIF decoder decodes all of (an animation of many tiny frames on a large canvas is
    a bomb too; Pillow finds them by skipping through the file, without decoding); 1 for the other
    formats, whose first frame alone is decoded.

    Args:
      image: the file's bytes, or a binary file object (positioned at its start).

    Raises:
      Skip: `TOO_MANY_PIXELS` when Pillow's own limit refuses the header, `UNDECODABLE` when it
        cannot read one.
    """
    from PIL import Image

    source = io.BytesIO(image) if isinstance(image, (bytes, bytearray, memoryview)) else image
    try:
        with Image.open(source) as opened:
            width, height = opened.size
            frames = opened.n_frames if opened.format == "GIF" else 1
    except Image.DecompressionBombError:
        raise Skip(TOO_MANY_PIXELS) from None
    except Exception:  # noqa: BLE001 - a header Pillow cannot parse fails in many ways; all mean
        # the same here: no size, so the file is not decoded.
        raise Skip(UNDECODABLE) from None
    return height, width, frames


# `Decoded.channels` of an image `decode_in_graph` left to `checked_jpeg` (too many pixels for
# the pipeline, or a format whose header only Pillow reads).
NOT_DECODED = 0


def _graph_header_size(image_bytes):
    # A 0-d array of bytes when run eagerly, the bytes themselves in a tf.data pipeline.
    if isinstance(image_bytes, np.ndarray):
        image_bytes = image_bytes.item()
    try:
        height, width, frames = header_size(image_bytes)
    except Skip:
        # Above Pillow's own limit, or no header at all: left undecoded, as any image above the
        # cap, and `checked_jpeg` says which. (An exception raised here would reach the user as
        # TensorFlow's logged traceback of the pipeline's op.)
        height, width, frames = 2**31, 2**31, 1
    return np.int64(height), np.int64(width * frames)


def decode_in_graph(image_bytes, max_pixels=DEFAULT_MAX_PIXELS):
    """The decode of `checked_jpeg` as graph ops, for a `tf.data` map: `Decoded` as tensors.

    A JPEG is decoded by `tf.io.decode_jpeg`, any other format by `tf.io.decode_image` and
    re-encoded at `checked_jpeg`'s quality, so the bytes are those the eager path makes. Bytes
    TensorFlow cannot decode raise an error, as the eager decode does (a `tf.data` pipeline drops
    them with `ignore_errors`; `checked_jpeg` without `decoded` then says why).

    An image of more than `max_pixels` pixels (by its header: TensorFlow's for a JPEG, Pillow's for
    the other formats) is not decoded: its `Decoded` has `channels` `NOT_DECODED` (and a JPEG's
    size), and `checked_jpeg` decides what it is. The local writer passes a small `max_pixels`,
    so that the pipeline's parallel decodes stay small and larger images go to its
    memory-budgeted path.
    """

    def jpeg():
        header = tf.io.extract_jpeg_shape(image_bytes, output_type=tf.int64)

        def decode():
            shape = tf.shape(tf.io.decode_jpeg(image_bytes, channels=3), out_type=tf.int64)[:2]
            return shape, tf.constant(b""), tf.cast(header[2], tf.int32)

        def leave():
            return header[:2], tf.constant(b""), tf.constant(NOT_DECODED)

        return tf.cond(header[0] * header[1] <= max_pixels, decode, leave)

    def other():
        height, width = tf.numpy_function(
            _graph_header_size, [image_bytes], [tf.int64, tf.int64], stateful=False
        )

        def decode():
            pixels = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
            reencoded = tf.io.encode_jpeg(pixels, quality=_REENCODE_QUALITY)
            return tf.shape(pixels, out_type=tf.int64)[:2], reencoded, tf.constant(3)

        def leave():
            return tf.stack([height, width]), tf.constant(b""), tf.constant(NOT_DECODED)

        return tf.cond(height * width <= max_pixels, decode, leave)

    shape, reencoded, channels = tf.cond(image_ops.is_jpeg(image_bytes), jpeg, other)
    return Decoded(shape[0], shape[1], reencoded, channels)


def _jpeg_header(jpeg_bytes, decoded=None):
    """`(height, width, components, EXIF orientation)` of a JPEG (orientation 1, upright, when
    there is no tag).

    Pillow reads the orientation from the header's EXIF segment or XMP packet, and the size and
    components with it. A JPEG without either (most files that are not camera photos) is upright,
    and its size and components are those TensorFlow's decoder reads from the same header: from
    `decoded` when the pipeline has read them, else here. Pillow's header parse, in Python, is
    most of a small image's conversion time.
    """
    if not any(marker in jpeg_bytes for marker in _ORIENTATION_MARKERS):
        if decoded is None:
            height, width, channels = tf.io.extract_jpeg_shape(jpeg_bytes).numpy().tolist()
            return height, width, channels, 1
        return decoded.height, decoded.width, decoded.channels, 1
    return _pillow_header(jpeg_bytes)


def _pillow_header(jpeg_bytes):
    """`_jpeg_header`, read by Pillow."""
    from PIL import Image

    with Image.open(io.BytesIO(jpeg_bytes)) as image:
        width, height = image.size
        return height, width, len(image.getbands()), image.getexif().get(_EXIF_ORIENTATION, 1)


def _upright(jpeg_bytes):
    """A JPEG's pixels (RGB) turned as its EXIF orientation says (`ImageOps.exif_transpose`)."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(jpeg_bytes)) as image:
        upright = ImageOps.exif_transpose(image)
    # One copy fewer of a large photo: the file's pixels are let go before the array is made,
    # and an RGB image is not converted to RGB.
    del image
    return np.asarray(upright if upright.mode == "RGB" else upright.convert("RGB"))
