"""The record schema shared by the writer and the reader: feature keys and `make_example`.

A record is one `tf.train.Example` in the classic ImageNet TFRecord layout: the JPEG bytes under
`IMAGE_KEY`, the integer class label under `LABEL_KEY`, and the class name, file name and image size
beside them.
"""

import tensorflow as tf

IMAGE_KEY = "image/encoded"
LABEL_KEY = "image/class/label"


def _bytes_feature(value):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int64_feature(value):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def make_example(jpeg_bytes, label, *, height, width, synset="", filename=""):
    """One `tf.train.Example` in the classic ImageNet layout.

    Args:
      jpeg_bytes: the encoded JPEG.
      label: the integer class label, as stored (1-based in the classic files).
      height: image height in pixels.
      width: image width in pixels.
      synset: the class name (the ImageNet synset id, or a folder name).
      filename: the image's file name.

    Returns:
      A `tf.train.Example`.
    """
    feature = {
        IMAGE_KEY: _bytes_feature(jpeg_bytes),
        "image/format": _bytes_feature(b"JPEG"),
        LABEL_KEY: _int64_feature(int(label)),
        "image/class/synset": _bytes_feature(synset.encode()),
        "image/filename": _bytes_feature(filename.encode()),
        "image/height": _int64_feature(int(height)),
        "image/width": _int64_feature(int(width)),
        "image/colorspace": _bytes_feature(b"RGB"),
        "image/channels": _int64_feature(3),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature))
