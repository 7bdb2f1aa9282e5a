"""Image files made into the JPEG bytes the writer stores: decoded in full, re-encoded if needed.

The input pipeline's fused decode reads JPEG only, and a file that is truncated or corrupt anywhere
must fail here rather than in training: every image is decoded in full. JPEGs are kept byte for
byte; other formats (PNG, GIF, BMP, WebP), CMYK JPEGs and JPEGs whose EXIF orientation tag says
they are rotated or mirrored (turned upright, as a viewer shows them) are re-encoded as RGB JPEGs.
"""

import io
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tpu_scale.data import image_ops

# Why a file was skipped (keys of the writer's `TFRecordSummary.skipped`).
UNDECODABLE = "not a decodable image"
CORRUPT_JPEG = "truncated or corrupt JPEG"
UNREADABLE = "unreadable file"

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


def as_rgb_jpeg(image_bytes, path=""):
    """Returns `(jpeg_bytes, height, width, reencoded)`: JPEG bytes the pipeline can decode.

    The image is decoded in full, so a file that is truncated or corrupt anywhere fails here rather
    than in training.

    Args:
      image_bytes: the file's bytes (JPEG, PNG, GIF, BMP or WebP).
      path: the file's path, for error messages.

    Returns:
      The JPEG bytes (unchanged for grey or RGB JPEGs), the image height and width, and whether it
      was re-encoded.

    Raises:
      ValueError: if the bytes are not a decodable image.
    """
    try:
        return checked_jpeg(image_bytes)
    except Skip as skip:
        raise ValueError(f"{path!r} is not usable: {skip.reason}.") from None


def checked_jpeg(image_bytes, decoded=None):
    """`as_rgb_jpeg`, raising `Skip` with the reason for a file that is not usable.

    Args:
      image_bytes: the file's bytes.
      decoded: the `Decoded` that `decode_in_graph` returned for these bytes, when TensorFlow has
        already decoded them (the local writer decodes in a `tf.data` pipeline, off Python's lock);
        None to decode them here. Either way the same ops decide, so the result is the same.
    """
    if image_bytes[:3] == image_ops.JPEG_START:
        # The reader's structural check must accept what is stored: a JPEG without its end-of-image
        # marker is truncated even when libjpeg decodes the part that is there.
        if not image_ops.is_complete_jpeg_bytes(image_bytes):
            raise Skip(CORRUPT_JPEG)
        try:
            # The header (size, components, orientation), and TensorFlow's decoder, the one the
            # input pipeline runs, on the whole file.
            height, width, channels, orientation = _jpeg_header(image_bytes, decoded)
            pixels = None if decoded is not None else tf.io.decode_jpeg(image_bytes, channels=3)
        except (tf.errors.InvalidArgumentError, OSError, SyntaxError, ValueError):
            raise Skip(CORRUPT_JPEG) from None
        # Cameras store the sensor's pixels and a tag saying how to turn them; the decoder
        # ignores the tag, so such photos are turned here, as a viewer shows them.
        if orientation != 1:
            try:
                image = _upright(image_bytes)
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
        try:
            image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        except tf.errors.InvalidArgumentError:
            raise Skip(UNDECODABLE) from None
    jpeg = tf.io.encode_jpeg(image, quality=_REENCODE_QUALITY).numpy()
    return jpeg, int(image.shape[0]), int(image.shape[1]), True


def decode_in_graph(image_bytes):
    """The decode of `checked_jpeg` as graph ops, for a `tf.data` map: `Decoded` as tensors.

    A JPEG is decoded by `tf.io.decode_jpeg`, any other format by `tf.io.decode_image` and
    re-encoded at `checked_jpeg`'s quality, so the bytes are those the eager path makes. Bytes
    TensorFlow cannot decode raise an error, as the eager decode does (a `tf.data` pipeline drops
    them with `ignore_errors`; `checked_jpeg` without `decoded` then says why).
    """

    def jpeg():
        shape = tf.shape(tf.io.decode_jpeg(image_bytes, channels=3))[:2]
        return shape, tf.constant(b""), tf.io.extract_jpeg_shape(image_bytes)[2]

    def other():
        pixels = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        reencoded = tf.io.encode_jpeg(pixels, quality=_REENCODE_QUALITY)
        return tf.shape(pixels)[:2], reencoded, tf.constant(3)

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
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
