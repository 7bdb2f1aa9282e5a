"""A dataset on disk -> the training and validation inputs of a run, with their sizes.

`records_inputs` takes what a user has: a folder of TFRecord shards written by `write_tfrecords`
(its `labels.json` gives the classes, the label offset and the example counts), the classic
ImageNet files (`train-00000-of-01024` ..., 1-based labels, 1000 classes), any other folder of
`train-*` / `validation-*` shards with `num_classes` given, or a TFDS dataset. It returns the two
`ImageNetInput`s and the counts a run needs for its steps per epoch and an exact evaluation, and it
refuses, naming the fix, what cannot train: a folder of images not yet converted, a missing folder,
records without a validation split.
"""

import dataclasses
import os

import tensorflow as tf
from absl import logging

from tpu_scale.data.image_folder import IMAGE_EXTENSIONS
from tpu_scale.data.input_config import FIELDS, InputConfig
from tpu_scale.data.input_pipeline import ImageNetInput
from tpu_scale.data.schema import read_label_map

IMAGENET_TRAIN_EXAMPLES = 1_281_167
IMAGENET_VALIDATION_EXAMPLES = 50_000
IMAGENET_CLASSES = 1000
_IMAGENET_TRAIN_FILES = 1024


@dataclasses.dataclass(frozen=True)
class RecordInputs:
    """The inputs of a run and the sizes that go with them, as `records_inputs` returns them.

    Attributes:
      train: the training `ImageNetInput` (`is_training=True`).
      validation: the evaluation `ImageNetInput` (`is_training=False`), each example once.
      num_classes: the number of classes (label ids are `0 .. num_classes - 1`).
      train_examples: training examples per epoch.
      validation_examples: examples in one pass over the validation split.
      arguments: the `records_inputs` arguments these were built from.
    """

    train: ImageNetInput
    validation: ImageNetInput
    num_classes: int
    train_examples: int
    validation_examples: int
    arguments: dict = dataclasses.field(default_factory=dict, repr=False)

    def with_input_arguments(self, **input_kwargs):
        """The same data with other `ImageNetInput` arguments or `InputConfig` fields, e.g.
        `**recipe.input_arguments`.

        The recipe's augmentation depends on the dataset's size, known only once the records are
        found: this rebuilds both inputs with the arguments added, the counts kept.

        Returns:
          A new `RecordInputs`.
        """
        arguments = dict(self.arguments, **input_kwargs)
        arguments.update(
            train_examples=self.train_examples, validation_examples=self.validation_examples
        )
        return _records_inputs(arguments, log=False)

    def steps_per_epoch(self, global_batch_size=None):
        """Optimizer steps in one epoch: whole global batches of the training examples, at least 1.

        Args:
          global_batch_size: the examples per step; defaults to the training input's.
        """
        batch = global_batch_size or self.train.global_batch_size
        return max(1, self.train_examples // batch)


def records_inputs(
    data_dir=None,
    *,
    image_size,
    global_batch_size,
    tfds_name=None,
    tfds_data_dir=None,
    num_classes=None,
    label_offset=None,
    train_examples=None,
    validation_examples=None,
    **input_kwargs,
):
    """The training and validation inputs of a folder of records (or a TFDS dataset).

    The folder holds `train-*` and `validation-*` TFRecord shards. With a label map (`labels.json`,
    written by `write_tfrecords`) the classes, the label offset and the counts come from it; the
    classic ImageNet files (1024 training shards) are 1000 classes with 1-based labels and the
    known counts; any other folder needs `num_classes` and has its records counted. A TFDS dataset
    reads its classes and split sizes from TFDS's metadata.

    Example:

    ```python
    inputs = data.records_inputs("~/flowers_records", image_size=64, global_batch_size=128)
    train = strategy.distribute_datasets_from_function(inputs.train.dataset)
    steps_per_epoch = inputs.steps_per_epoch()
    ```

    Args:
      data_dir: the folder of shards (local or `gs://`; a leading `~` is expanded). Give this or
        `tfds_name`.
      image_size: the height and width of the images the inputs produce.
      global_batch_size: examples per step over all replicas.
      tfds_name: a TFDS dataset (e.g. `"imagenet2012"`) with `train` and `validation` splits.
      tfds_data_dir: TFDS's data directory (TFDS's default when None).
      num_classes: the number of classes; must agree with the label map if there is one.
      label_offset: the stored label of class 0; must agree with the label map if there is one.
        Defaults to the label map's, else 1 (the classic ImageNet files).
      train_examples: overrides the training count (e.g. a partial epoch).
      validation_examples: overrides the validation count.
      **input_kwargs: other `ImageNetInput` arguments, passed to both inputs: `dtype`, `config`
        (an `InputConfig`); and `InputConfig` fields (`deterministic`, `seed`, `strict`, the
        augmentation of `**recipe.input_arguments`, ...), which replace those of `config`.

    Returns:
      A `RecordInputs`: `train`, `validation`, `num_classes`, `train_examples`,
      `validation_examples`.

    Raises:
      ValueError: with the fix, when both or neither source is given, the folder is missing or
        holds images rather than records, the number of classes is unknown, or a split is empty.
    """
    arguments = dict(
        data_dir=data_dir,
        image_size=image_size,
        global_batch_size=global_batch_size,
        tfds_name=tfds_name,
        tfds_data_dir=tfds_data_dir,
        num_classes=num_classes,
        label_offset=label_offset,
        train_examples=train_examples,
        validation_examples=validation_examples,
        **input_kwargs,
    )
    return _records_inputs(arguments, log=True)


def _records_inputs(arguments, log):
    """`records_inputs` on a dict of its arguments; logs what it found if `log`."""
    given = arguments
    arguments = dict(arguments)
    data_dir, tfds_name = arguments.pop("data_dir"), arguments.pop("tfds_name")
    tfds_data_dir = arguments.pop("tfds_data_dir")
    num_classes, label_offset = arguments.pop("num_classes"), arguments.pop("label_offset")
    train_examples = arguments.pop("train_examples")
    validation_examples = arguments.pop("validation_examples")
    # image_size, global_batch_size, dtype and config; InputConfig fields given here go into it.
    common = {k: v for k, v in arguments.items() if k not in FIELDS}
    settings = {k: v for k, v in arguments.items() if k in FIELDS}
    common["config"] = (common.get("config") or InputConfig()).replace(**settings)
    if (data_dir is None) == (tfds_name is None):
        raise ValueError("Give data_dir (a folder of TFRecords) or tfds_name, exactly one of them.")
    if tfds_name is not None:
        inputs = _tfds_inputs(
            tfds_name, tfds_data_dir, num_classes, train_examples, validation_examples, common
        )
        return dataclasses.replace(inputs, arguments=given)
    data_dir = os.fspath(data_dir)
    if data_dir.startswith("~"):
        data_dir = os.path.expanduser(data_dir)
    if not tf.io.gfile.isdir(data_dir):
        raise ValueError(f"data_dir {data_dir} does not exist (or is not a folder).")
    train_pattern = os.path.join(data_dir, "train-*")
    validation_pattern = os.path.join(data_dir, "validation-*")
    _refuse_image_folder(data_dir, train_pattern)
    label_map = read_label_map(data_dir)
    if label_map is not None:
        if num_classes not in (None, label_map.num_classes):
            raise ValueError(f"num_classes={num_classes} but the label map {label_map.path} lists {label_map.num_classes} classes. Drop num_classes (the label map gives it).")
        num_classes = label_map.num_classes
        counts = label_map.counts
        train_examples = train_examples or counts.get("train") or _count_records(train_pattern)
        validation_examples = (
            validation_examples or counts.get("validation") or _count_records(validation_pattern)
        )
        if validation_examples == 0:
            raise ValueError(f"The records in {data_dir} hold no validation split (its label map counts 0 validation images). Write them again with a validation set: python -m tpu_scale.data.convert --image_dir IMAGES --output_dir {data_dir} --overwrite (it keeps at least one image of every class with two or more for validation).")
    else:
        imagenet = _is_classic_imagenet(train_pattern)
        if num_classes is None:
            if not imagenet:
                raise ValueError(f"{data_dir} has no label map (labels.json) and is not the classic ImageNet layout, so the number of classes is unknown. Write the records with python -m tpu_scale.data.convert (it writes the label map), or pass num_classes.")
            num_classes = IMAGENET_CLASSES
        imagenet = imagenet and num_classes == IMAGENET_CLASSES
        if label_offset is None:
            label_offset = 1
        train_examples = train_examples or (
            IMAGENET_TRAIN_EXAMPLES if imagenet else _count_records(train_pattern)
        )
        validation_examples = validation_examples or (
            IMAGENET_VALIDATION_EXAMPLES if imagenet else _count_records(validation_pattern)
        )
    if train_examples == 0:
        raise ValueError(f"No training records match {train_pattern}.")
    if validation_examples == 0:
        raise ValueError(f"No validation records match {validation_pattern}. Write them with python -m tpu_scale.data.convert (it splits off a validation set by default).")
    labels = dict(label_offset=label_offset, num_classes=num_classes)
    train = ImageNetInput(train_pattern, is_training=True, **labels, **common)
    validation = ImageNetInput(validation_pattern, is_training=False, **labels, **common)
    inputs = RecordInputs(
        train, validation, num_classes, train_examples, validation_examples, given
    )
    if log:
        _log(data_dir, label_map, inputs)
    return inputs


def _tfds_inputs(name, data_dir, num_classes, train_examples, validation_examples, common):
    import tensorflow_datasets as tfds

    info = tfds.builder(name, data_dir=data_dir).info
    num_classes = num_classes or info.features["label"].num_classes
    train = ImageNetInput.from_tfds(
        name, "train", data_dir, is_training=True, num_classes=num_classes, **common
    )
    validation = ImageNetInput.from_tfds(
        name, "validation", data_dir, is_training=False, num_classes=num_classes, **common
    )
    return RecordInputs(
        train,
        validation,
        num_classes,
        train_examples or info.splits["train"].num_examples,
        validation_examples or info.splits["validation"].num_examples,
    )


def _log(data_dir, label_map, inputs):
    source = f"label map {label_map.path}" if label_map is not None else data_dir
    logging.info(
        "Records %s: %d classes, %d train / %d validation examples",
        source,
        inputs.num_classes,
        inputs.train_examples,
        inputs.validation_examples,
    )
    if inputs.train_examples < inputs.train.global_batch_size:
        logging.warning(
            "The training set (%d images) is smaller than the global batch (%d): every epoch is "
            "one step that repeats images. A smaller global batch trains better here.",
            inputs.train_examples,
            inputs.train.global_batch_size,
        )


def _count_records(pattern):
    files = tf.io.gfile.glob(pattern)
    return sum(1 for _ in tf.data.TFRecordDataset(files)) if files else 0


def _is_classic_imagenet(train_pattern):
    """The classic ImageNet files: 1024 training shards named train-NNNNN-of-01024."""
    files = tf.io.gfile.glob(train_pattern)
    suffix = f"-of-{_IMAGENET_TRAIN_FILES:05d}"
    return len(files) == _IMAGENET_TRAIN_FILES and all(f.endswith(suffix) for f in files)


def _refuse_image_folder(data_dir, train_pattern):
    """Raises, naming the conversion command, when `data_dir` holds class folders of images."""
    if tf.io.gfile.glob(train_pattern):
        return
    for name in sorted(tf.io.gfile.listdir(data_dir))[:50]:
        folder = os.path.join(data_dir, name.rstrip("/"))
        if tf.io.gfile.isdir(folder) and any(
            entry.lower().endswith(IMAGE_EXTENSIONS) for entry in tf.io.gfile.listdir(folder)
        ):
            records = data_dir.rstrip("/") + "_records"
            raise ValueError(f"data_dir {data_dir} holds folders of images (e.g. {name.rstrip('/')}/), not TFRecords. Train on them as they are (examples/train_imagenet.py --image_dir {data_dir}; data.image_folder_records in a script), or convert them once: python -m tpu_scale.data.convert --image_dir {data_dir} --output_dir {records}, then train on {records}.")
