"""The ImageNet input builder: sharded TFRecord / TFDS reads, fused decode-and-crop, batching,
tf.data service.

`ImageNetInput` builds the host-side pipeline of the supercomputer-scale ResNet-50 recipe:

    files (sharded per input pipeline, shuffled) -> parallel interleave with a large read buffer
    -> [cache raw records] -> shuffle -> repeat
    -> the decode stage (`DecodeStage`), in parallel calls of 64 records each: parse, check, crop
       seeds, fused JPEG decode-and-crop, resize, flip, normalize; bad records dropped, named and
       counted
    -> batches (`drop_remainder=True` in training) -> prefetch

A bad record does not stop the run: it is skipped, named once in the log (warnings of the
"tpu_scale" logger: its file, its index in the file, the reason) and counted
(`ImageNetInput.skipped_records`, `skipped_by_reason`, against `records_read`); the run stops with
an error naming the first bad records when they are more than `max_bad_fraction` of the records
read (see `bad_records`). `strict=True` stops at the first one. With the tf.data service, whose
workers cannot report to this process, the first bad record stops the run.

Every stage runs on the host CPU. `dataset(input_context)` is meant to be given to
`strategy.distribute_datasets_from_function`, which calls it once per input pipeline with the
pipeline's id and per-replica batch size.
"""

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_scale.data import image_ops, sources
from tpu_scale.data._removed import removed
from tpu_scale.data.bad_records import BadRecords, explanations, record_faults
from tpu_scale.data.input_config import FIELDS, InputConfig
from tpu_scale.data.schema import IMAGE_KEY, LABEL_KEY, read_label_map
from tpu_scale.data.sources import (
    TFDS_PREFIX,
    Shard,
    TFDSSource,
    TFDSSplit,
    TFRecordSource,
    expand_patterns,
    graph_function,
    shuffle_each_epoch,
)

AUTOTUNE = tf.data.AUTOTUNE
# Records one call of the decode stage parses, checks and decodes (on one thread of the pool).
RECORDS_PER_CALL = 64


def _pipeline_options(*, deterministic, threadpool_size):
    options = tf.data.Options()
    # No autotuning: the decode runs on every thread of the pool (`DecodeStage`), which is what
    # autotuning settles on for a CPU-bound map, and the model that autotuning keeps (a clock read
    # and a bookkeeping step around every element of every stage, and its own thread) costs the
    # training path CPU per image.
    options.autotune.enabled = False
    # One private pool sized to the host: the pipeline's threads do not compete with TF's inter-op
    # pool.
    options.threading.private_threadpool_size = threadpool_size
    # Parallelism comes from many examples in flight, not from splitting one resize across threads.
    options.threading.max_intra_op_parallelism = 1
    options.deterministic = deterministic
    return options


class ImageNetInput:
    """Builds the ImageNet input pipeline for training or evaluation.

    Example:
        train = ImageNetInput("/data/imagenet/train-*", is_training=True, image_size=224,
                              global_batch_size=1024, config=InputConfig(seed=0))
        dataset = strategy.distribute_datasets_from_function(train.dataset)
        model.fit(dataset, steps_per_epoch=1251, epochs=90)

    Training: files sharded per input pipeline, file order shuffled, parallel interleave, optional
    cache of the raw records, shuffle, repeat, fused decode-and-crop (Inception random box), flip,
    normalize, batches with `drop_remainder=True` (static shapes), prefetch.
    Evaluation: every example exactly once in file order, center crop, no shuffle, no repeat; the
    last batch is smaller (`exact_evaluation` fills it up with zero-weight examples).

    Args:
      data: a glob (or list of globs) of TFRecord files holding `tf.train.Example`s with an
        encoded image and an int64 label (`InputConfig.image_key` and `label_key`). A TFDS dataset
        is read through `data.inputs("tfds:NAME", ...)`, which builds its inputs.
      is_training: selects the training path (random crops, shuffling, infinite repeat) or the eval
        path.
      global_batch_size: the batch size over all replicas; each pipeline produces
        `input_context.get_per_replica_batch_size(global_batch_size)` examples per batch.
      image_size: output height and width.
      label_offset: subtracted from every stored label. None (the default): the label map's (the
        `labels.json` that `write_tfrecords` puts next to the files), else 1, for the classic
        1-based ImageNet files. A value that disagrees with the label map is an error.
      num_classes: labels (after `label_offset`) must lie in `[0, num_classes)`; a record outside
        is skipped and named (see `InputConfig.strict`). None: the label map's, else unchecked
        above. A value that disagrees with the label map is an error.
      dtype: the images' dtype: `"float32"` or `"bfloat16"`, normalized with ImageNet's mean and
        stddev; or `"uint8"`, the cropped, resized and flipped pixels rounded to 0-255 with no
        normalization, a quarter of float32's bytes per image, for a model that normalizes on the
        device (`tpu_scale.layers.ImageNormalization`, `models.resnet50(normalize_inputs=True)`).
        Labels are always int32.
      config: an `InputConfig`: the augmentation, the reading, the order and seed, the tf.data
        service, the bad-record policy and the validation's cache (None: the defaults). A
        keyword that used to be an argument here and is a field there (`cache=True`, ...) fails
        with a `TypeError` that says so.
    """

    def __init__(
        self,
        data: "str | Sequence[str] | TFDSSplit",
        *,
        is_training: bool,
        global_batch_size: int,
        image_size: int = 224,
        label_offset: int | None = None,
        num_classes: int | None = None,
        dtype: Any = tf.float32,
        config: InputConfig | None = None,
        **moved,
    ):
        if moved:
            raise TypeError(_moved_keywords_message(moved, config))
        config = InputConfig() if config is None else config
        if not isinstance(config, InputConfig):
            raise TypeError(f"config must be an InputConfig, got {type(config).__name__}.")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}.")
        if image_size < 1:
            raise ValueError(f"image_size must be at least 1, got {image_size}.")
        self.dtype = tf.dtypes.as_dtype(dtype)
        if self.dtype not in (tf.float32, tf.bfloat16, tf.uint8):
            raise ValueError(f"dtype must be float32, bfloat16 (normalized images) or uint8 (raw pixels), got {self.dtype.name}.")
        if config.deterministic and config.seed is None:
            config = config.replace(seed=0)
        self.config = config
        self.is_training = is_training
        self.global_batch_size = global_batch_size
        self.image_size = image_size
        self.source, self.label_map = _source_and_label_map(data, config)
        self.label_offset, self.num_classes = _resolve_labels(
            self.label_map, label_offset, num_classes
        )
        self._bad_records = BadRecords(
            explanations(
                self.label_map,
                self.source.image_key,
                self.source.label_key,
                self.label_offset,
                self.num_classes,
            ),
            strict=config.strict,
            max_bad_fraction=config.max_bad_fraction,
            on_service=bool(config.data_service_address),
        )

    from_tfds = removed(
        'ImageNetInput.from_tfds is gone: a TFDS dataset is a source of data.inputs, spelled '
        '"tfds:NAME": data.inputs("tfds:imagenet2012", image_size=..., global_batch_size=...) '
        "gives its train and validation inputs (.train, .validation) with their counts."
    )

    @property
    def skipped_records(self) -> int:
        """How many bad records this input's datasets skipped (since `reset_counts`): those they
        read, including read-ahead; after an evaluation pass, the records it left out."""
        return self._bad_records.skipped

    @property
    def distinct_skipped_records(self) -> int:
        """How many different bad records this input's datasets skipped since it was built, each
        counted once however often it was read (e.g. by a cached evaluation's first pass and the
        batch Keras reads ahead of it); `reset_counts` leaves it."""
        return self._bad_records.distinct

    @property
    def skipped_by_reason(self) -> dict:
        """`skipped_records` by reason, e.g. `{"not a complete image": 2, "undecodable image":
        1}`."""
        return self._bad_records.by_reason()

    @property
    def records_read(self) -> int:
        """How many records this input's datasets read (since `reset_counts`), bad ones included:
        after an evaluation pass, `records_read - skipped_records` examples were evaluated."""
        return self._bad_records.records_read

    def reset_counts(self):
        """Starts `skipped_records`, `skipped_by_reason` and `records_read` again from zero (e.g.
        before an evaluation pass); the threshold of `max_bad_fraction` then applies to the new
        counts."""
        self._bad_records.reset()

    @property
    def _threads(self):
        """The threads of the pipeline's pool: the decode's parallelism."""
        return self.config.threadpool_size or os.cpu_count() or 1

    def dataset(self, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """Builds the dataset of `(images, labels)` batches for one input pipeline.

        Args:
          input_context: given by `strategy.distribute_datasets_from_function`; selects this
            pipeline's shard of the data and its per-replica batch size. None means one pipeline and
            the global batch.

        Returns:
          A `tf.data.Dataset` of `(images [batch, size, size, 3] in dtype, labels [batch] int32)`.

        Raises:
          ValueError: if no file matches, or the records lack the configured feature keys.
        """
        if input_context is None:
            shard, batch_size = Shard(), self.global_batch_size
        else:
            shard = Shard(input_context.input_pipeline_id, input_context.num_input_pipelines)
            batch_size = input_context.get_per_replica_batch_size(self.global_batch_size)
        config = self.config
        deterministic = config.deterministic or not self.is_training
        # Different pipelines must draw different crops and shuffles even from one user seed.
        seed = None if config.seed is None else config.seed * 1_000_003 + shard.index

        records, record_level = self.source.records(
            shard,
            # A cache must see one finite pass, so the repeat then comes after it.
            repeat=self.is_training and not config.cache,
            shuffle_files=self.is_training,
            deterministic=deterministic,
            seed=seed,
            strict=config.strict or bool(config.data_service_address),
        )
        if record_level:
            records = records.shard(shard.count, shard.index)
        if config.cache:
            records = records.cache()
        if self.is_training and config.cache and deterministic:
            records = shuffle_each_epoch(records, config.shuffle_buffer_size, seed)
        elif self.is_training:
            # Deterministic: the same stream from every new iterator (without a cache the buffer
            # runs over the repeated records, so the order still changes from one pass over the data
            # to the next).
            records = records.shuffle(
                config.shuffle_buffer_size, seed=seed, reshuffle_each_iteration=not deterministic
            )
            if config.cache:
                records = records.repeat()

        stage = DecodeStage(
            parse=self.source.parse,
            decode_image=self._decode_image,
            bad_records=self._bad_records,
            label_offset=self.label_offset,
            num_classes=self.num_classes,
            random_crops=self.is_training,
        )
        examples = stage(
            records,
            batch_size=batch_size,
            # Training shapes must be static for the accelerator; evaluation keeps every example.
            drop_remainder=self.is_training,
            parallel_calls=self._threads,
            deterministic=deterministic,
            seed=seed,
        )
        options = _pipeline_options(deterministic=deterministic, threadpool_size=self._threads)
        examples = examples.with_options(options)
        if config.data_service_address:
            examples = examples.apply(
                tf.data.experimental.service.distribute(
                    processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
                    service=config.data_service_address,
                    job_name=config.data_service_job_name,
                )
            )
        return examples.prefetch(AUTOTUNE)

    def _decode_image(self, image_bytes, crop_seed):
        """One record's image: the fused decode-and-crop (random box in training, center crop in
        evaluation), resized, flipped, in the input's dtype (uint8 straight from the decode, rounded
        before the flip; the other dtypes normalized from their float32 pixels)."""
        pixels = tf.uint8 if self.dtype == tf.uint8 else tf.float32
        if self.is_training:
            image = image_ops.decode_and_random_crop(
                image_bytes,
                self.image_size,
                crop_seed,
                resize_method=self.config.resize_method,
                scaled_decode=self.config.scaled_decode,
                dtype=pixels,
                area_range=self.config.crop_area_range,
                flip=self.config.random_flip,
                translate_fraction=self.config.translate_fraction,
                aspect_ratio=self.config.aspect_ratio,
            )
        else:
            image = image_ops.decode_and_center_crop(
                image_bytes,
                self.image_size,
                resize_method=self.config.resize_method,
                scaled_decode=self.config.scaled_decode,
                dtype=pixels,
                crop_fraction=self.config.center_crop_fraction,
                aspect_ratio=self.config.aspect_ratio,
            )
        return image if self.dtype == tf.uint8 else image_ops.normalize_image(image, self.dtype)


class DecodeStage:
    """The pipeline's decode stage: records in, batches of `(images, labels)` out, bad records
    named and counted; the same for the local pipeline and the tf.data service.

    Each call of the stage takes `RECORDS_PER_CALL` records, on one thread of the pipeline's pool,
    and in one linear chain: parses them (`parse`, one parser call for all), checks them
    (`record_faults`: the source's faults, the image's structure, the label's range), gives each a
    crop seed (one draw per call), decodes the good ones one by one (`decode_image`), and hands
    the bad ones by name to `bad_records`, which counts and names them and stops the run when it
    must. An image the decoder rejects (a JPEG whose frame header says height 0, a broken Huffman
    table) fails inside a dataset of the call's records whose errors are ignored: it is missing
    from the call's results, and named by its place among the call's records. Nothing is kept
    between calls, so any number of iterators, left early or not, read the same dataset.

    Args:
      parse: the source's `parse`: a batch of its records -> `(origin, index, image_bytes,
        stored_label, fault)`.
      decode_image: `(image_bytes, crop_seed)` -> one image.
      bad_records: the input's `bad_records.BadRecords`.
      label_offset: subtracted from the stored labels.
      num_classes: labels must lie below it (None: unchecked).
      random_crops: draw crop seeds (training); zeros otherwise (the center crop needs none).
    """

    def __init__(
        self, *, parse, decode_image, bad_records, label_offset, num_classes, random_crops
    ):
        self.parse = parse
        self.decode_image = decode_image
        self.bad_records = bad_records
        self.label_offset = label_offset
        self.num_classes = num_classes
        self.random_crops = random_crops

    def __call__(self, records, *, batch_size, drop_remainder, parallel_calls, deterministic, seed):
        """Batches of `batch_size` examples of `records`.

        Args:
          records: the source's records (as `parse` takes them, batched).
          batch_size: examples per batch.
          drop_remainder: drop the last partial batch.
          parallel_calls: calls at once: the threads of the pipeline's pool (autotuning is off,
            see `_pipeline_options`, and AUTOTUNE would stay at its start value).
          deterministic: hand out the calls' examples in the records' order.
          seed: the seed of the per-call crop seed draws (with `random_crops`).
        """
        data = records.batch(RECORDS_PER_CALL)
        if self.random_crops:
            data = tf.data.Dataset.zip((data, tf.data.Dataset.random(seed=seed)))
            call = self._decode_records
        else:
            call = lambda *batch: self._decode_records(batch)  # noqa: E731
        data = data.map(
            graph_function(call), num_parallel_calls=parallel_calls, deterministic=deterministic
        )
        return data.rebatch(batch_size, drop_remainder=drop_remainder)

    def _decode_records(self, records, draw=None):
        """`(images, labels)` of the good records of a batch, the bad ones counted and named."""
        origin, index, image_bytes, stored_label, fault = self.parse(records)
        size = tf.size(index)
        counted = self.bad_records.count_read(size)
        fault, labels = record_faults(
            image_bytes, stored_label, fault, self.label_offset, self.num_classes
        )
        place = tf.range(size)
        good = tf.equal(fault, sources.OK)
        parts = (image_bytes, labels, self._crop_seeds(size, draw), place)
        # Only a batch that holds a bad record is masked: masking copies every record.
        parts = tf.cond(
            tf.reduce_all(good),
            lambda: parts,
            lambda: tuple(tf.gather(part, tf.where(good)[:, 0]) for part in parts),
        )
        images, labels, decoded = self._decode_each(parts)
        # The decoder's rejects: good records missing from its results.
        came_out = tf.scatter_nd(decoded[:, tf.newaxis], tf.ones_like(decoded), [size]) > 0
        fault = tf.where(good & tf.logical_not(came_out), sources.UNDECODABLE, fault)
        bad = tf.not_equal(fault, sources.OK)

        def report():
            at = tf.where(bad)[:, 0]
            at_index = tf.strings.as_string(tf.gather(index, at))
            names = tf.strings.join(["record ", at_index, " of ", tf.gather(origin, at)])
            with tf.control_dependencies([self.bad_records.report(names, tf.gather(fault, at))]):
                return tf.constant(True)

        with tf.control_dependencies([counted]):
            reported = tf.cond(tf.reduce_any(bad), report, lambda: tf.constant(False))
        with tf.control_dependencies([counted, reported]):
            return tf.identity(images), tf.identity(labels)

    def _decode_each(self, parts):
        """`(images, labels, places)` of the records of `parts` that the decoder accepts."""

        def decode(image_bytes, label, crop_seed, place):
            return self.decode_image(image_bytes, crop_seed), label, place

        decoded = tf.data.Dataset.from_tensor_slices(parts).map(graph_function(decode))
        decoded = decoded.ignore_errors().batch(RECORDS_PER_CALL)
        # Every record rejected, or none given: no batch, so an empty one stands in.
        none = tuple(tf.zeros([0, *s.shape[1:]], s.dtype) for s in decoded.element_spec)
        return decoded.concatenate(tf.data.Dataset.from_tensors(none)).take(1).get_single_element()

    def _crop_seeds(self, size, draw):
        """The crop seeds of `size` records: from one random value `draw` (training), zeros for the
        center crop."""
        if draw is None:
            return tf.zeros([size, 2], tf.int64)
        # One stateless draw of the batch's seed pairs, from its random value.
        seed = tf.stack([draw, tf.bitwise.invert(draw)])
        return tf.random.stateless_uniform(
            [size, 2], seed, minval=None, maxval=None, dtype=tf.int64
        )


def _source_and_label_map(data, config):
    """The input's source of records, and the label map next to its files (None for TFDS or
    files without one)."""
    if isinstance(data, str) and data.startswith(TFDS_PREFIX):
        raise ValueError(f"ImageNetInput reads TFRecord files; a TFDS dataset ({data!r}) is a source of data.inputs: data.inputs({data.split('/')[0]!r}, image_size=..., global_batch_size=...) gives its train and validation inputs.")
    if isinstance(data, TFDSSplit):
        source = TFDSSource(
            data.name,
            data.split,
            data.data_dir,
            config.image_key or "image",
            config.label_key or "label",
            config.cycle_length or 16,
        )
        return source, None
    label_map = read_label_map(expand_patterns(data))
    source = TFRecordSource(
        data,
        config.image_key or IMAGE_KEY,
        config.label_key or LABEL_KEY,
        config.read_buffer_bytes,
        config.cycle_length or 64,
        record_counts=label_map and label_map.record_counts_by_path(),
    )
    return source, label_map


def _moved_keywords_message(moved, config):
    """The `TypeError` message for keywords `ImageNetInput` no longer takes: those that are
    `InputConfig` fields, with where they go now; any other, as Python says it."""
    unknown = sorted(set(moved) - FIELDS)
    if unknown:
        return f"ImageNetInput() got an unexpected keyword argument {unknown[0]!r}."
    fields = ", ".join(f"{name}={value!r}" for name, value in moved.items())
    home = "config.replace" if config is not None else "InputConfig"
    return (
        f"ImageNetInput() no longer takes {', '.join(moved)}: the pipeline's settings are fields "
        f"of its configuration. Pass config={home}({fields})."
    )


def _resolve_labels(label_map, label_offset, num_classes):
    """`(label_offset, num_classes)` from the arguments and the label map; refuses disagreements."""
    if label_map is not None:
        for name, given, mapped in (
            ("label_offset", label_offset, label_map.label_offset),
            ("num_classes", num_classes, label_map.num_classes),
        ):
            if given is not None and given != mapped:
                raise ValueError(f"{name}={given} disagrees with the label map {label_map.path!r}, written with the files: it says {name}={mapped}. Drop {name}= (the label map is read automatically) or pass {name}={mapped}; if the label map is wrong, rewrite the files with tpu_scale.data.convert.")
        return label_map.label_offset, label_map.num_classes
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}.")
    return (1 if label_offset is None else label_offset), num_classes
