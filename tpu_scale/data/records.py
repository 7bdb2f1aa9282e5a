"""A run's data, the one way in: `inputs(source, ...)` -> training and validation inputs, their
counts, their label map and the exact evaluation that counts every validation example once.

`source` is what a user has: a folder of TFRecord shards written by `write_tfrecords` (its
`labels.json` gives the classes, the label offset and the counts), the classic ImageNet files
(`train-00000-of-01024` ..., 1-based labels, 1000 classes), any other folder of `train-*` /
`validation-*` shards with `num_classes` given, a folder of class folders of images (converted to
records on first use and read from them after), or a TFDS dataset (`"tfds:imagenet2012"`). What
cannot train is refused with the fix: a missing folder, records without a validation split, an
unknown number of classes.
"""

import dataclasses
import functools
import logging
import os

import tensorflow as tf

from tpu_scale._files import is_local
from tpu_scale.data._removed import removed
from tpu_scale.data.convert import image_folder_records
from tpu_scale.data.evaluation import exact_evaluation
from tpu_scale.data.image_folder import IMAGE_EXTENSIONS
from tpu_scale.data.input_config import InputConfig
from tpu_scale.data.input_pipeline import ImageNetInput
from tpu_scale.data.names import as_bytes, inline
from tpu_scale.data.schema import LabelMap, read_label_map
from tpu_scale.data.sources import TFDS_PREFIX, TFDSSplit

logger = logging.getLogger(__name__)

IMAGENET_TRAIN_EXAMPLES = 1_281_167
IMAGENET_VALIDATION_EXAMPLES = 50_000
IMAGENET_CLASSES = 1000
_IMAGENET_TRAIN_FILES = 1024
CONVERT_COMMAND = "python -m tpu_scale.data.convert"
# Keywords a user might pass by the old words, with the new spelling ("validation" names the data
# split; "evaluation" only the act).
_RENAMED_KEYWORDS = {
    "eval_examples": "validation_examples",
    "cache_evaluation": "a field of the configuration: config=InputConfig(cache_validation=...)",
    "cache_validation": "a field of the configuration: config=InputConfig(cache_validation=...)",
}


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """A run's data, as `inputs` returns it. The pipelines are built on first use.

    Attributes:
      train: the training `ImageNetInput` (`is_training=True`).
      validation: the validation split's `ImageNetInput` (`is_training=False`), each example once.
      exact_evaluation: the `ExactEvaluation` of `validation` under `strategy`:
        `exact_evaluation.dataset` and `exact_evaluation.steps` for `fit`'s `validation_data` /
        `validation_steps` and `evaluate`, every example counted once whatever the replicas
        (`data.exact_evaluation`).
      num_classes: the number of classes (label ids are `0 .. num_classes - 1`).
      train_examples: training examples per epoch.
      validation_examples: examples in one pass over the validation split.
      label_map: the `LabelMap` next to the records (class names, counts), or None.
      config: the `InputConfig` of both inputs (`with_config` gives the same data with another).
      image_size, global_batch_size, dtype, strategy: as given to `inputs`.
    """

    train_data: "str | TFDSSplit"
    validation_data: "str | TFDSSplit"
    num_classes: int
    label_offset: int | None
    train_examples: int
    validation_examples: int
    label_map: LabelMap | None
    image_size: int
    global_batch_size: int
    dtype: str
    config: InputConfig
    strategy: tf.distribute.Strategy

    @functools.cached_property
    def train(self) -> ImageNetInput:
        return self._input(self.train_data, is_training=True)

    @functools.cached_property
    def validation(self) -> ImageNetInput:
        return self._input(self.validation_data, is_training=False)

    @functools.cached_property
    def exact_evaluation(self):
        return exact_evaluation(
            self.validation,
            self.strategy,
            self.validation_examples,
            cache=self.config.cache_validation,
        )

    evaluation = removed(
        'Inputs.evaluation is now Inputs.exact_evaluation (the act of evaluating; "validation" '
        "names the data split, Inputs.validation): validation_data=inputs.exact_evaluation.dataset, "
        "validation_steps=inputs.exact_evaluation.steps."
    )

    def with_config(self, config: InputConfig) -> "Inputs":
        """The same data with another configuration, e.g. the recipe's augmentation once the
        counts have chosen the recipe (`recipe.input_config(inputs.config)`): the records are not
        found and counted again."""
        return dataclasses.replace(self, config=config)

    def steps_per_epoch(self, global_batch_size: int | None = None) -> int:
        """Optimizer steps in one epoch: whole global batches of the training examples, at least 1.

        Args:
          global_batch_size: the examples per step; defaults to the inputs'.
        """
        return max(1, self.train_examples // (global_batch_size or self.global_batch_size))

    def _input(self, data, is_training):
        labels = dict(label_offset=self.label_offset, num_classes=self.num_classes)
        common = dict(
            is_training=is_training,
            image_size=self.image_size,
            global_batch_size=self.global_batch_size,
            dtype=self.dtype,
            config=self.config,
        )
        return ImageNetInput(data, **labels, **common)


def inputs(
    source: str,
    *,
    image_size: int,
    global_batch_size: int,
    strategy: tf.distribute.Strategy | None = None,
    config: InputConfig | None = None,
    dtype: str = "float32",
    num_classes: int | None = None,
    label_offset: int | None = None,
    train_examples: int | None = None,
    validation_examples: int | None = None,
    records_dir: str | None = None,
    tfds_data_dir: str | None = None,
    **renamed,
) -> Inputs:
    """The training and validation inputs of a run, with their counts, label map and evaluation.

    Example:

    ```python
    inputs = data.inputs("~/flowers", image_size=64, global_batch_size=128, strategy=strategy)
    model.fit(strategy.distribute_datasets_from_function(inputs.train.dataset),
              epochs=epochs, steps_per_epoch=inputs.steps_per_epoch(),
              validation_data=inputs.exact_evaluation.dataset,
              validation_steps=inputs.exact_evaluation.steps)
    ```

    Args:
      source: a folder of `train-*` and `validation-*` TFRecord shards (local or `gs://`; a
        leading `~` is expanded); a folder of class folders of images, converted by
        `write_tfrecords` (a stratified 10% validation split, `config.seed`, `config.strict`) into
        `records_dir` on first use and read from there after; or `"tfds:NAME"`, a TFDS dataset
        with `train` and `validation` splits.
      image_size: the height and width of the images the inputs produce.
      global_batch_size: examples per step over all replicas.
      strategy: the `tf.distribute` strategy of the evaluation (default: the current one).
      config: the `InputConfig` of both inputs (default: `InputConfig()`).
      dtype: the images' dtype (`ImageNetInput`'s `dtype`).
      num_classes: the number of classes; must agree with the label map if there is one. Without
        one: needed but for the classic ImageNet files (1000) and TFDS (its metadata).
      label_offset: the stored label of class 0; must agree with the label map if there is one.
        Defaults to the label map's, else 1 (the classic ImageNet files), 0 for TFDS.
      train_examples: overrides the training count (e.g. a partial epoch).
      validation_examples: overrides the validation count.
      records_dir: where a folder of images is converted (default: the folder's path with
        `_records` added).
      tfds_data_dir: TFDS's data directory (TFDS's default when None).

    Returns:
      An `Inputs`: `train`, `validation`, `exact_evaluation`, `num_classes`, `train_examples`,
      `validation_examples`, `label_map`.

    Raises:
      ValueError: with the fix, when the folder is missing, the number of classes is unknown, or
        a split is empty.
    """
    for name in renamed:
        if name in _RENAMED_KEYWORDS:
            raise TypeError(f"inputs(): {name} is now {_RENAMED_KEYWORDS[name]}.")
        raise TypeError(f"inputs() got an unexpected keyword argument {name!r}")
    config = InputConfig() if config is None else config
    common = dict(
        image_size=image_size,
        global_batch_size=global_batch_size,
        dtype=dtype,
        config=config,
        strategy=strategy or tf.distribute.get_strategy(),
    )
    counts = (num_classes, train_examples, validation_examples)
    source = os.fspath(source)
    if source.startswith(TFDS_PREFIX):
        name = source[len(TFDS_PREFIX) :]
        return Inputs(**_tfds(name, tfds_data_dir, label_offset, *counts), **common)
    folder = os.path.expanduser(source) if source.startswith("~") else source
    if not tf.io.gfile.isdir(folder):
        raise ValueError(f"The data folder {inline(folder)} does not exist (or is not a folder).")
    if _holds_class_folders(folder):
        records = records_dir or folder.rstrip("/") + "_records"
        folder = image_folder_records(folder, records, seed=config.seed or 0, strict=config.strict)
    found = Inputs(**_records(folder, label_offset, *counts), **common)
    _log(folder, found)
    return found


def _records(folder, label_offset, num_classes, train_examples, validation_examples):
    """The fields of `Inputs` that describe a folder of records."""
    train_pattern = os.path.join(folder, "train-*")
    validation_pattern = os.path.join(folder, "validation-*")
    label_map = read_label_map(folder)
    if label_map is not None:
        if num_classes not in (None, label_map.num_classes):
            raise ValueError(f"num_classes={num_classes} but the label map {inline(label_map.path)} lists {label_map.num_classes} classes. Drop num_classes (the label map gives it).")
        num_classes = label_map.num_classes
        counts = label_map.counts
        train_examples = train_examples or counts.get("train") or _count_records(train_pattern)
        validation_examples = (
            validation_examples or counts.get("validation") or _count_records(validation_pattern)
        )
        if validation_examples == 0:
            raise ValueError(f"The records in {inline(folder)} hold no validation split (its label map counts 0 validation images). Write them again with a validation set: {CONVERT_COMMAND} --image_dir IMAGES --output_dir {inline(folder)} --overwrite (it keeps at least one image of every class with two or more for validation).")
    else:
        imagenet = _is_classic_imagenet(train_pattern)
        if num_classes is None:
            if not imagenet:
                raise ValueError(f"{inline(folder)} has no label map (labels.json) and is not the classic ImageNet layout, so the number of classes is unknown. Write the records with {CONVERT_COMMAND} (it writes the label map), or pass num_classes.")
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
        raise ValueError(f"No training records match {inline(train_pattern)}.")
    if validation_examples == 0:
        raise ValueError(f"No validation records match {inline(validation_pattern)}. Write them with {CONVERT_COMMAND} (it splits off a validation set by default).")
    return dict(
        train_data=train_pattern,
        validation_data=validation_pattern,
        num_classes=num_classes,
        label_offset=label_offset,
        train_examples=train_examples,
        validation_examples=validation_examples,
        label_map=label_map,
    )


def _tfds(name, data_dir, label_offset, num_classes, train_examples, validation_examples):
    """The fields of `Inputs` that describe a TFDS dataset."""
    import tensorflow_datasets as tfds

    info = tfds.builder(name, data_dir=data_dir).info
    return dict(
        train_data=TFDSSplit(name, "train", data_dir),
        validation_data=TFDSSplit(name, "validation", data_dir),
        num_classes=num_classes or info.features["label"].num_classes,
        label_offset=0 if label_offset is None else label_offset,
        train_examples=train_examples or info.splits["train"].num_examples,
        validation_examples=validation_examples or info.splits["validation"].num_examples,
        label_map=None,
    )


def _log(folder, found):
    source = f"label map {inline(found.label_map.path)}" if found.label_map is not None else inline(folder)
    logger.info(
        "Records %s: %d classes, %d train / %d validation examples",
        source,
        found.num_classes,
        found.train_examples,
        found.validation_examples,
    )
    if found.train_examples < found.global_batch_size:
        logger.warning(
            "The training set (%d images) is smaller than the global batch (%d): every epoch is "
            "one step that repeats images. A smaller global batch trains better here.",
            found.train_examples,
            found.global_batch_size,
        )


def _count_records(pattern):
    files = tf.io.gfile.glob(pattern)
    return sum(1 for _ in tf.data.TFRecordDataset(files)) if files else 0


def _is_classic_imagenet(train_pattern):
    """The classic ImageNet files: 1024 training shards named train-NNNNN-of-01024."""
    files = tf.io.gfile.glob(train_pattern)
    suffix = f"-of-{_IMAGENET_TRAIN_FILES:05d}"
    return len(files) == _IMAGENET_TRAIN_FILES and all(f.endswith(suffix) for f in files)


def _list(folder):
    # A local folder through `os`, which hands a name that is not UTF-8 over with surrogates where
    # `tf.io.gfile.listdir` fails on it.
    if is_local(folder):
        return os.listdir(folder)
    return [name.rstrip("/") for name in tf.io.gfile.listdir(folder)]


def _holds_class_folders(folder):
    """Whether `folder` holds class folders of images rather than records."""
    if tf.io.gfile.glob(os.path.join(folder, "train-*")):
        return False
    for name in sorted(_list(folder))[:50]:
        path = os.path.join(folder, name)
        if tf.io.gfile.isdir(as_bytes(path)) and any(
            entry.lower().endswith(IMAGE_EXTENSIONS) for entry in _list(path)
        ):
            return True
    return False
