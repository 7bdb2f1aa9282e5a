"""EXIF orientation of JPEG files: read the tag, turn the pixels upright.

Cameras and phones store the sensor's pixels as they were read out and an EXIF tag (0x0112) saying
how a viewer must turn them. TensorFlow's JPEG decoder ignores the tag, so `write_tfrecords` reads
it here and stores such photos upright.
"""

import tensorflow as tf

# How to turn decoded pixels upright, by EXIF orientation (1: as stored; 2-8: mirrored and/or
# rotated, as the EXIF standard numbers them).
_UPRIGHT = {
    1: lambda image: image,
    2: tf.image.flip_left_right,
    3: lambda image: tf.image.rot90(image, 2),
    4: tf.image.flip_up_down,
    5: tf.image.transpose,
    6: lambda image: tf.image.rot90(image, 3),  # 90 degrees clockwise
    7: lambda image: tf.image.rot90(tf.image.transpose(image), 2),
    8: lambda image: tf.image.rot90(image, 1),  # 90 degrees counter-clockwise
}


def orientation(jpeg_bytes: bytes) -> int:
    """The EXIF orientation tag of a JPEG file (1-8), 1 when it has none or it cannot be read.

    Walks the JPEG's marker segments up to the image data, finds the APP1 "Exif" segment and reads
    tag 0x0112 of its first image directory (TIFF layout, either byte order). Never raises.

    Args:
      jpeg_bytes: the JPEG file's bytes.

    Returns:
      An int from 1 to 8.
    """
    data = bytes(jpeg_bytes)
    position = 2  # past the start-of-image marker
    while position + 4 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker in (0xD9, 0xDA):  # end of image, start of the compressed data
            break
        length = int.from_bytes(data[position + 2 : position + 4], "big")
        segment = data[position + 4 : position + 2 + length]
        if marker == 0xE1 and segment.startswith(b"Exif\x00\x00"):
            return _tiff_orientation(segment[6:])
        position += 2 + length
    return 1


def upright(image, orientation_tag):
    """`image` (`[height, width, channels]`) turned as EXIF orientation `orientation_tag` says."""
    return _UPRIGHT[orientation_tag](image)


def _tiff_orientation(tiff):
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 1
    directory = int.from_bytes(tiff[4:8], order)
    count = int.from_bytes(tiff[directory : directory + 2], order)
    for entry in range(directory + 2, directory + 2 + 12 * count, 12):
        if int.from_bytes(tiff[entry : entry + 2], order) == 0x0112:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if value in _UPRIGHT else 1
    return 1
