"""The input builder: ImageNet TFRecords / TFDS on tf.data with fused JPEG decode-and-crop.

ImageNetInput            the train / eval pipeline (`.dataset(input_context)`, `.from_tfds`)
SyntheticImageNetInput   random batches with no I/O (the input-free bound of a step)
write_tfrecords          class folders of images -> train/validation TFRecords + labels.json
read_label_map           the label map next to the shards: classes, label offset, counts
make_synthetic_imagenet  a small, learnable dataset of real JPEGs in that layout
image_ops                fused decode-and-crop, scaled decode, center crop, normalization
exif                     a JPEG's EXIF orientation, and the pixels turned upright (the writer's)
"""

import importlib

from tpu_scale.data import image_ops
from tpu_scale.data.input_pipeline import ImageNetInput
from tpu_scale.data.schema import LabelMap, read_label_map
from tpu_scale.data.synthetic import SyntheticImageNetInput, make_synthetic_imagenet


def __getattr__(name):
    # `write_tfrecords` is both a function and the module `python -m tpu_scale.data.write_tfrecords`
    # runs. Importing the module lazily keeps `-m` from finding it already imported; the public name
    # stays the function (importing a submodule would otherwise bind the module to it).
    if name in ("write_tfrecords", "TFRecordSummary"):
        module = importlib.import_module("tpu_scale.data.write_tfrecords")
        globals()["write_tfrecords"] = module.write_tfrecords
        globals()["TFRecordSummary"] = module.TFRecordSummary
        return globals()[name]
    raise AttributeError(f"module 'tpu_scale.data' has no attribute {name!r}")


__all__ = [
    "ImageNetInput",
    "LabelMap",
    "SyntheticImageNetInput",
    "TFRecordSummary",
    "image_ops",
    "make_synthetic_imagenet",
    "read_label_map",
    "write_tfrecords",
]
