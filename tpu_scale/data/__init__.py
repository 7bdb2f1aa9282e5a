"""The input builder: ImageNet TFRecords / TFDS on tf.data with fused JPEG decode-and-crop.

The way in is `inputs(source, ...)` with an `InputConfig`; everything else is what it is made of.

inputs                   a run's data, the one way in: a folder of records, a folder of class
                         folders of images (converted on first use) or "tfds:NAME" -> `Inputs`:
                         `.train` and `.validation` (`ImageNetInput`s), their counts, the label map
                         and `.exact_evaluation` (every validation example counted once)
InputConfig              the settings of both inputs: augmentation, reading, order, tf.data
                         service, bad records, the validation's cache (`cache_validation`)
ImageNetInput            the one reader under `inputs`: records -> batches
                         (`.dataset(input_context)`), for a glob of TFRecord files of your own
write_tfrecords          class folders of images -> train/validation TFRecords + labels.json, on
                         this machine or as a Beam pipeline (`beam_options`); the command:
                         python -m tpu_scale.data.convert
read_label_map           the label map next to the shards: classes, label offset, counts
exact_evaluation         the distributed evaluation that counts every example once (of any input),
                         filling the last batch with zero-weight examples
make_synthetic_imagenet  a small, learnable dataset of real JPEGs in that layout
image_ops                fused decode-and-crop, scaled decode, center crop, normalization
bad_records              skipped records named and counted; `SkippedRecordsLogger` logs the counts
image_folder             which files of a folder of class folders the writer converts, and which not
"""

from tpu_scale import _lazy

# Each public name and the module that defines it, imported on first use: `python -m
# tpu_scale.data.convert` then reaches its own module before anything imports TensorFlow (so that
# the command line can quiet TensorFlow's start-up lines), and a module that `-m` runs is not
# already imported.
_PUBLIC = {
    "ImageNetInput": "tpu_scale.data.input_pipeline",
    "InputConfig": "tpu_scale.data.input_config",
    "LabelMap": "tpu_scale.data.schema",
    "read_label_map": "tpu_scale.data.schema",
    "make_synthetic_imagenet": "tpu_scale.data.synthetic",
    "write_tfrecords": "tpu_scale.data.convert",
    "TFRecordSummary": "tpu_scale.data.convert",
    "SkippedRecordsLogger": "tpu_scale.data.bad_records",
    "Inputs": "tpu_scale.data.records",
    "inputs": "tpu_scale.data.records",
    "ExactEvaluation": "tpu_scale.data.evaluation",
    "evaluation_steps": "tpu_scale.data.evaluation",
    "exact_evaluation": "tpu_scale.data.evaluation",
}
_SUBMODULES = ("image_ops", "image_folder", "bad_records")

# Names the package no longer has, each with the way that replaced it.
_REMOVED = {
    "records_inputs": "tpu_scale.data.records_inputs is gone: data.inputs(source, image_size=..., "
    "global_batch_size=..., strategy=...) is the one way in.",
    "RecordInputs": "tpu_scale.data.RecordInputs is gone: data.inputs(...) returns a data.Inputs.",
    "SyntheticImageNetInput": "tpu_scale.data.SyntheticImageNetInput is gone from the package: "
    "random batches with no I/O are a test helper (tests/synthetic_input.py). A run without "
    "your own data trains on real JPEGs: data.make_synthetic_imagenet(folder) writes them and "
    "data.inputs(folder, ...) reads them.",
}

_public = _lazy.attributes(__name__, _PUBLIC, submodules=_SUBMODULES)


def __getattr__(name):
    if name in _REMOVED:
        raise AttributeError(_REMOVED[name])
    return _public(name)


__all__ = [
    "ExactEvaluation",
    "ImageNetInput",
    "InputConfig",
    "LabelMap",
    "Inputs",
    "SkippedRecordsLogger",
    "TFRecordSummary",
    "evaluation_steps",
    "exact_evaluation",
    "image_ops",
    "make_synthetic_imagenet",
    "read_label_map",
    "inputs",
    "write_tfrecords",
]
