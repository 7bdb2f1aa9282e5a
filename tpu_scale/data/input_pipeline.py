"""The ImageNet input builder: sharded TFRecord / TFDS reads, fused decode-and-crop, batching,
tf.data service.

`ImageNetInput` builds the host-side pipeline of the supercomputer-scale ResNet-50 recipe:

    files (sharded per input pipeline, shuffled) -> parallel interleave with a large read buffer
    -> [cache raw records] -> shuffle -> repeat
    -> batches of 128 records: parse, check (one assertion), crop seeds (one draw) -> unbatch
    -> parallel map: fused JPEG decode-and-crop, resize, flip, normalize  } fused by tf.data
    -> batch(drop_remainder=True)                                         }
    -> [tf.data service] -> prefetch

Every stage runs on the host CPU. `dataset(input_context)` is meant to be given to
`strategy.distribute_datasets_from_function`, which calls it once per input pipeline with the
pipeline's id and per-replica batch size.
"""

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_scale.data import image_ops, sources
from tpu_scale.data.schema import IMAGE_KEY, LABEL_KEY, LABEL_MAP_FILE, read_label_map
from tpu_scale.data.sources import (
    Shard,
    TFDSSource,
    TFRecordSource,
    expand_patterns,
    shuffle_each_epoch,
)

AUTOTUNE = tf.data.AUTOTUNE


def _pipeline_options(*, deterministic, threadpool_size):
    options = tf.data.Options()
    # No autotuning: the decode runs on every thread of the pool (`_decode`), which is what
    # autotuning settles on for a CPU-bound map, and the model that autotuning keeps (a clock read
    # and a bookkeeping step around every element of every stage, and its own thread) cost the
    # uint8 training path 7% of its CPU per image on 2 cores (benchmarks/README.md).
    options.autotune.enabled = False
    # One private pool sized to the host: the pipeline's threads do not compete with TF's inter-op
    # pool.
    options.threading.private_threadpool_size = threadpool_size
    # Parallelism comes from many examples in flight, not from splitting one resize across threads.
    options.threading.max_intra_op_parallelism = 1
    options.experimental_optimization.map_and_batch_fusion = True
    options.deterministic = deterministic
    return options


class ImageNetInput:
    """Builds the ImageNet input pipeline for training or evaluation.

    Example:
        train = ImageNetInput("/data/imagenet/train-*", is_training=True, global_batch_size=1024)
        dataset = strategy.distribute_datasets_from_function(train.dataset)
        model.fit(dataset, steps_per_epoch=1251, epochs=90)

    Training: files sharded per input pipeline, file order shuffled, parallel interleave, optional
    cache of the raw records, shuffle, repeat, fused decode-and-crop (Inception random box), flip,
    normalize, batches with `drop_remainder=True` (static shapes), prefetch.
    Evaluation: every example exactly once in file order, center crop, no shuffle, no repeat; the
    last batch is smaller unless `pad_last_batch=True`.

    Args:
      file_pattern: a glob (or list of globs) of TFRecord files holding `tf.train.Example`s with
        JPEG bytes under `image_key` and an int64 label under `label_key`.
      is_training: selects the training path (random crops, shuffling, infinite repeat) or the eval
        path.
      global_batch_size: the batch size over all replicas; each pipeline produces
        `input_context.get_per_replica_batch_size(global_batch_size)` examples per batch.
      image_size: output height and width.
      label_offset: subtracted from every stored label. None (the default): the label map's (the
        `labels.json` that `write_tfrecords` puts next to the files), else 1, for the classic
        1-based ImageNet files. A value that disagrees with the label map is an error.
      num_classes: labels (after `label_offset`) must lie in `[0, num_classes)`; a record outside
        fails, naming its file and index (or is skipped with `skip_corrupt=True`). None: the label
        map's, else unchecked above. A value that disagrees with the label map is an error.
      dtype: the images' dtype: `"float32"` or `"bfloat16"`, normalized with ImageNet's mean and
        stddev; or `"uint8"`, the cropped, resized and flipped pixels rounded to 0-255 with no
        normalization, a quarter of float32's bytes per image, for a model that normalizes on the
        device (`tpu_scale.layers.ImageNormalization`, `models.resnet50(normalize_inputs=True)`).
        Labels are always int32.
      image_key: the feature holding the encoded JPEG.
      label_key: the feature holding the integer label.
      cache: keep the raw (encoded) records in host memory after the first epoch (training only
        needs about 150 GB for full ImageNet; use it for datasets that fit).
      shuffle_buffer_size: raw records in the shuffle buffer (training). The file shuffle and the
        interleave over `cycle_length` files already mix the data, so the reference recipe's 1024
        (about 110 MB of ImageNet JPEGs) suffices.
      cycle_length: files read at once by the interleave.
      read_buffer_bytes: read buffer of each file reader (large buffers suit network file systems;
        the readers hold `cycle_length x read_buffer_bytes` of host memory).
      deterministic: reproducible order and crops (slower). With `seed`, two runs give the same
        batches.
      seed: the seed of the file shuffle, the shuffle buffer and the per-example crop seeds.
      skip_corrupt: drop bad records (not an Example, a missing feature, a label out of range, not a
        decodable JPEG, the truncated end of a file) and count them in `skipped_records` and
        `skipped_by_reason`, instead of failing with the file and record named. The counts cover the
        batches the iterator has handed out, not what the pipeline read ahead.
      pad_last_batch: evaluation only: pad the last batch to full size so every batch has a static
        shape; the dataset then yields `(images, labels, weights)` with weight 0 for padding, which
        Keras `evaluate` uses as sample weights so padding does not count.
      data_service_address: a tf.data service dispatcher (`grpc://host:port`); the pipeline then
        runs on the service's workers, each file handed out once (dynamic sharding), and this host
        only receives batches. `skip_corrupt` counting needs the local pipeline and is refused here.
      data_service_job_name: share one service job between consumers (otherwise each `dataset()`
        call gets its own job).
      threadpool_size: size of the private tf.data thread pool (default: the host's CPU count).
      resize_method: a `tf.image.ResizeMethod` name.
      crop_area_range: training: (min, max) fraction of the image area the Inception random box
        covers; `(0.08, 1.0)` is the ImageNet recipe's, a larger minimum augments less (small
        datasets, short runs); None trains on the whole image. `schedules.recipe_for_batch` gives
        one that fits the run.
      random_flip: training: mirror half of the images left to right.
      center_crop_fraction: evaluation: the side of the center crop as a fraction of the short
        side (224 / 256 by default; 1.0 keeps a square image whole).
      scaled_decode: decode a crop window at least twice the output size (in both dimensions) at a
        libjpeg downscaling ratio of 2, 4 or 8 before the resize (`image_ops.decode_window`): less
        decode work for large photos, a measured PSNR bound against full-size decode + resize (see
        benchmarks/README.md). Off by default.
    """

    def __init__(
        self,
        file_pattern: str | Sequence[str] | None,
        *,
        is_training: bool,
        global_batch_size: int,
        image_size: int = 224,
        label_offset: int | None = None,
        num_classes: int | None = None,
        dtype: Any = tf.float32,
        image_key: str = IMAGE_KEY,
        label_key: str = LABEL_KEY,
        cache: bool = False,
        shuffle_buffer_size: int = 1024,
        cycle_length: int = 64,
        read_buffer_bytes: int = 8 * 1024 * 1024,
        deterministic: bool = False,
        seed: int | None = None,
        skip_corrupt: bool = False,
        pad_last_batch: bool = False,
        data_service_address: str | None = None,
        data_service_job_name: str | None = None,
        threadpool_size: int | None = None,
        resize_method: str = "bilinear",
        scaled_decode: bool = False,
        crop_area_range: tuple[float, float] | None = image_ops.AREA_RANGE,
        random_flip: bool = True,
        center_crop_fraction: float = image_ops.CENTER_CROP_FRACTION,
        _source: Any = None,
    ):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}.")
        if image_size < 1:
            raise ValueError(f"image_size must be at least 1, got {image_size}.")
        self.dtype = tf.dtypes.as_dtype(dtype)
        if self.dtype not in (tf.float32, tf.bfloat16, tf.uint8):
            raise ValueError(
                f"dtype must be float32, bfloat16 (normalized images) or uint8 (raw pixels), got "
                f"{self.dtype.name}."
            )
        if pad_last_batch and is_training:
            raise ValueError(
                "pad_last_batch=True is for evaluation: training batches are already full "
                "(drop_remainder=True). Pass is_training=False, or drop pad_last_batch."
            )
        if skip_corrupt and data_service_address:
            raise ValueError(
                "skip_corrupt=True counts dropped records in a variable of this process, which "
                "tf.data "
                "service workers cannot update. Clean the files (or run without "
                "data_service_address)."
            )
        if deterministic and seed is None:
            seed = 0
        self.is_training = is_training
        self.global_batch_size = global_batch_size
        self.image_size = image_size
        self.cache = cache
        self.shuffle_buffer_size = shuffle_buffer_size
        self.deterministic = deterministic
        self.seed = seed
        self.skip_corrupt = skip_corrupt
        self.pad_last_batch = pad_last_batch
        self.data_service_address = data_service_address
        self.data_service_job_name = data_service_job_name
        self.threadpool_size = threadpool_size
        self.resize_method = resize_method
        self.scaled_decode = scaled_decode
        if crop_area_range is not None and not 0 < crop_area_range[0] <= crop_area_range[1] <= 1:
            raise ValueError(
                f"crop_area_range={crop_area_range!r} must be (min, max) with 0 < min <= max <= 1, "
                "e.g. (0.08, 1.0) for ImageNet; None trains on the whole image."
            )
        if not 0 < center_crop_fraction <= 1:
            raise ValueError(
                f"center_crop_fraction={center_crop_fraction} must be in (0, 1]: 0.875 is the "
                "reference, 1.0 keeps the whole (square) image."
            )
        self.crop_area_range = None if crop_area_range is None else tuple(crop_area_range)
        self.random_flip = random_flip
        self.center_crop_fraction = center_crop_fraction
        self.label_map = read_label_map(expand_patterns(file_pattern)) if _source is None else None
        self.source = _source or TFRecordSource(
            file_pattern,
            image_key,
            label_key,
            read_buffer_bytes,
            cycle_length,
            record_counts=self.label_map and self.label_map.record_counts_by_path(),
        )
        self.label_offset, self.num_classes = _resolve_labels(
            self.label_map, label_offset, num_classes
        )
        with tf.init_scope():
            self._skipped = tf.Variable(
                tf.zeros([len(sources.FAULT_NAMES)], tf.int64),
                trainable=False,
                name="skipped_records",
            )

    @classmethod
    def from_tfds(
        cls,
        name: str,
        split: str,
        data_dir: str | None = None,
        *,
        label_offset: int = 0,
        image_key: str = "image",
        label_key: str = "label",
        cycle_length: int = 16,
        **kwargs,
    ) -> "ImageNetInput":
        """An input over a TFDS dataset (for example `imagenet2012`), with TFDS's image decoding
        skipped.

        TFDS yields the raw JPEG bytes and this pipeline's fused decode-and-crop runs on them. TFDS
        labels are 0-based, hence `label_offset=0`.

        Args:
          name: the TFDS dataset name.
          split: the split, e.g. `"train"` or `"validation"` (slicing such as `"train[:10%]"`
            works).
          data_dir: the TFDS data directory (TFDS's default when None).
          label_offset: subtracted from every label.
          image_key: the feature holding the image.
          label_key: the feature holding the class label.
          cycle_length: files TFDS reads at once.
          **kwargs: the other `ImageNetInput` arguments (`is_training`, `global_batch_size`, ...).

        Returns:
          An `ImageNetInput`.
        """
        source = TFDSSource(name, split, data_dir, image_key, label_key, cycle_length)
        return cls(None, label_offset=label_offset, _source=source, **kwargs)

    @property
    def skipped_records(self) -> int:
        """How many bad records (`skip_corrupt=True`) this input's datasets dropped before the
        batches their iterators handed out (a distribution strategy may fetch a batch or two
        ahead)."""
        return int(tf.reduce_sum(self._skipped).numpy())

    @property
    def skipped_by_reason(self) -> dict:
        """`skipped_records` by reason, e.g. `{"not a complete JPEG": 2, "truncated TFRecord file":
        1}`."""
        counts = self._skipped.numpy().tolist()
        return {name: count for name, count in zip(sources.FAULT_NAMES, counts) if count}

    @property
    def _threads(self):
        """The threads of the pipeline's pool: the decode's parallelism."""
        return self.threadpool_size or os.cpu_count() or 1

    def dataset(self, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """Builds the dataset of `(images, labels)` batches for one input pipeline.

        Args:
          input_context: given by `strategy.distribute_datasets_from_function`; selects this
            pipeline's shard of the data and its per-replica batch size. None means one pipeline and
            the global batch.

        Returns:
          A `tf.data.Dataset` of `(images [batch, size, size, 3] in dtype, labels [batch] int32)`,
          or `(images, labels, weights)` with `pad_last_batch=True`.

        Raises:
          ValueError: if no file matches, or the records lack the configured feature keys.
        """
        if input_context is None:
            shard, batch_size = Shard(), self.global_batch_size
        else:
            shard = Shard(input_context.input_pipeline_id, input_context.num_input_pipelines)
            batch_size = input_context.get_per_replica_batch_size(self.global_batch_size)
        deterministic = self.deterministic or not self.is_training
        # Different pipelines must draw different crops and shuffles even from one user seed.
        seed = None if self.seed is None else self.seed * 1_000_003 + shard.index

        records, record_level = self.source.records(
            shard,
            # A cache must see one finite pass, so the repeat then comes after it.
            repeat=self.is_training and not self.cache,
            shuffle_files=self.is_training,
            deterministic=deterministic,
            seed=seed,
            skip_corrupt=self.skip_corrupt,
        )
        if record_level:
            records = records.shard(shard.count, shard.index)
        if self.cache:
            records = records.cache()
        if self.is_training and self.cache and deterministic:
            records = shuffle_each_epoch(records, self.shuffle_buffer_size, seed)
        elif self.is_training:
            # Deterministic: the same stream from every new iterator (without a cache the buffer
            # runs over the repeated records, so the order still changes from one pass over the data
            # to the next).
            records = records.shuffle(
                self.shuffle_buffer_size, seed=seed, reshuffle_each_iteration=not deterministic
            )
            if self.cache:
                records = records.repeat()

        examples = self._decode(records, seed)
        examples = examples.batch(
            batch_size,
            # Training shapes must be static for the accelerator; evaluation keeps every example.
            drop_remainder=self.is_training,
        )
        if self.skip_corrupt:
            # The skip counts travel with the batches and are added by a sequential map after the
            # prefetch, which runs as the iterator hands each batch out: read-ahead is not counted.
            examples = examples.prefetch(AUTOTUNE).map(self._count_skipped)
            if not self.is_training:
                examples = examples.filter(lambda images, labels: tf.size(labels) > 0)
        if self.pad_last_batch:
            examples = examples.map(lambda images, labels: _pad_batch(images, labels, batch_size))
        options = _pipeline_options(deterministic=deterministic, threadpool_size=self._threads)
        if self.skip_corrupt:
            options.experimental_optimization.inject_prefetch = False  # would read past the count
        examples = examples.with_options(options)
        if self.data_service_address:
            examples = examples.apply(
                tf.data.experimental.service.distribute(
                    processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
                    service=self.data_service_address,
                    job_name=self.data_service_job_name,
                )
            )
        return examples if self.skip_corrupt else examples.prefetch(AUTOTUNE)

    def _decode(self, records, seed):
        """Parses, checks and decodes every record into a normalized `(image, label)` example.

        Parsing and the record checks run on batches of `_PARSE_BATCH` records (one function call,
        one parser call and one assertion per batch instead of per record), and each batch draws its
        crop seeds from one random value; then the records go one by one to the decode, which is
        fused with the batching that follows (map_and_batch_fusion).
        """
        if self.skip_corrupt:
            return self._decode_skipping_corrupt(records, seed)
        data = records.batch(_PARSE_BATCH)
        if self.is_training:
            data = tf.data.Dataset.zip((data, tf.data.Dataset.random(seed=seed)))
            data = data.map(self._parse_and_check, num_parallel_calls=AUTOTUNE)
        else:
            data = data.map(
                lambda *batch: self._parse_and_check(batch), num_parallel_calls=AUTOTUNE
            )
        data = data.unbatch()
        # One decode per thread of the pipeline's pool: autotuning is off (`_pipeline_options`),
        # and AUTOTUNE would then stay at its start value, at most 16 however many cores a host has.
        return data.map(self._decode_example, num_parallel_calls=self._threads)

    def _parse_and_check(self, records, draw=None):
        """Parses a batch of records, fails on any record fault, and gives each record its crop
        seed.

        Args:
          records: a batch of the source's records.
          draw: one random int64 for the batch's crop seeds (training); None for the center crop.

        Returns:
          `(image_bytes, labels, crop_seeds)`, vectors of the batch's size (seeds `[size, 2]`).
        """
        image_bytes, labels = self._checked(*self.source.parse(records))
        size = tf.size(labels)
        if draw is None:
            return image_bytes, labels, tf.zeros([size, 2], tf.int64)
        # One stateless draw of the batch's seed pairs, from its random value.
        seed = tf.stack([draw, tf.bitwise.invert(draw)])
        crop_seeds = tf.random.stateless_uniform(
            [size, 2], seed, minval=None, maxval=None, dtype=tf.int64
        )
        return image_bytes, labels, crop_seeds

    def _fault(self, origin, index, image_bytes, stored_label, fault):
        """The record's fault code (`sources.OK` when it is good) and its label after
        `label_offset`.

        The source's fault (truncated file, not an Example, missing feature) comes first, then the
        JPEG's structure, then the label's range. Computed with a few scalar ops and no assertion,
        so that the default path fuses all checks into one assertion and the skipping path can
        count.
        """
        label = stored_label - self.label_offset
        label_fault = tf.where(label < 0, sources.NEGATIVE_LABEL, sources.OK)
        if self.num_classes is not None:
            label_fault = tf.where(label >= self.num_classes, sources.LABEL_TOO_LARGE, label_fault)
        jpeg_fault = tf.where(
            image_ops.is_complete_jpeg(image_bytes), label_fault, sources.NOT_A_JPEG
        )
        return tf.where(tf.equal(fault, sources.OK), jpeg_fault, fault), tf.cast(label, tf.int32)

    def _checked(self, origin, index, image_bytes, stored_label, fault):
        """Fails, naming the file, the record and the fix, on any fault of a batch of records;
        returns their JPEG bytes and labels.

        One assertion for all checks of the batch, naming its first bad record, placed before the
        decoder so that a broken record fails here, with its name, rather than inside libjpeg.
        """
        fault, label = self._fault(origin, index, image_bytes, stored_label, fault)
        bad = tf.not_equal(fault, sources.OK)
        first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int32)
        problem = tf.gather(self._fault_messages(), fault[first])
        check = tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(bad)),
            [
                "Record",
                index[first],
                "of",
                origin[first],
                problem,
                "Its stored label:",
                stored_label[first],
            ],
        )
        with tf.control_dependencies([check]):
            return tf.identity(image_bytes), label

    def _fault_messages(self):
        """What each fault code means and how to fix it (indexed by code)."""
        if self.label_map is not None:
            where = f"the label map {self.label_map.path} says {self.label_map.num_classes} classes"
        else:
            where = f"no {LABEL_MAP_FILE} is next to the files"
        skip = " Or pass skip_corrupt=True to drop and count such records."
        messages = {
            sources.OK: "",
            sources.TRUNCATED_FILE: "is where the file stops being readable: it is truncated or "
            "corrupted (its records do not add up to its size, or to its count in "
            f"{LABEL_MAP_FILE}). Copy or write the file again." + skip,
            sources.NOT_AN_EXAMPLE: "is not a serialized tf.train.Example. Check that the file "
            "pattern "
            "names TFRecord files of Examples only." + skip,
            sources.MISSING_FEATURE: "lacks the image or the label feature (image_key="
            f"{self.source.image_key!r}, label_key={self.source.label_key!r})." + skip,
            sources.NOT_A_JPEG: _NOT_A_JPEG,
            sources.NEGATIVE_LABEL: "has a negative label after subtracting label_offset="
            f"{self.label_offset}: use label_offset=0 for 0-based labels ({where})." + skip,
            sources.LABEL_TOO_LARGE: f"has a label >= num_classes={self.num_classes} after "
            f"subtracting label_offset={self.label_offset} ({where}). Check num_classes and "
            "label_offset." + skip,
            sources.UNDECODABLE: "could not be parsed or decoded.",
        }
        return tf.constant([messages[code] for code in range(len(sources.FAULT_NAMES))])

    def _decode_example(self, image_bytes, label, crop_seed):
        # uint8 comes straight from the decode functions (rounded before the flip); the other
        # dtypes are normalized from their float32 pixels.
        pixels = tf.uint8 if self.dtype == tf.uint8 else tf.float32
        if self.is_training:
            image = image_ops.decode_and_random_crop(
                image_bytes,
                self.image_size,
                crop_seed,
                resize_method=self.resize_method,
                scaled_decode=self.scaled_decode,
                dtype=pixels,
                area_range=self.crop_area_range,
                flip=self.random_flip,
            )
        else:
            image = image_ops.decode_and_center_crop(
                image_bytes,
                self.image_size,
                resize_method=self.resize_method,
                scaled_decode=self.scaled_decode,
                dtype=pixels,
                crop_fraction=self.center_crop_fraction,
            )
        if self.dtype == tf.uint8:
            return image, label
        return image_ops.normalize_image(image, self.dtype), label

    def _decode_skipping_corrupt(self, records, seed):
        """Drops bad records instead of failing; each kept example carries the skips before it.

        Record faults are found by the same checks as on the default path; each decode then runs in
        its own one-element dataset whose errors are ignored, so a parser or decoder failure becomes
        a "failed" marker rather than an error. This costs roughly a tenth more CPU per image than
        the default path, hence only with `skip_corrupt=True`. A scan then hands the counts of the
        dropped records (by reason) to the next kept example; evaluation appends an end marker that
        carries the trailing ones and is removed from the last batch by `_count_skipped`.
        """
        if self.is_training:
            # One stateless crop seed per example, from a random stream that is seeded in
            # deterministic mode.
            examples = tf.data.Dataset.zip((records, tf.data.Dataset.random(seed=seed)))

            def with_crop_seed(record, draw):
                return record, tf.stack([draw, tf.bitwise.invert(draw)])

        else:
            examples = records

            def with_crop_seed(*record):
                return record, tf.zeros([2], tf.int64)  # the center crop is not random

        parse = self.source.parse
        blank = tf.zeros([self.image_size, self.image_size, 3], self.dtype)
        failed_marker = (blank, tf.constant(-1, tf.int32), tf.constant(sources.UNDECODABLE))

        def decode(record, crop_seed):
            _, _, image_bytes, _, _ = parsed = parse(record)
            fault, label = self._fault(*parsed)
            image, label = tf.cond(
                tf.equal(fault, sources.OK),
                lambda: self._decode_example(image_bytes, label, crop_seed),
                lambda: (blank, label),
            )
            return image, label, fault

        def guarded_decode(*element):
            attempt = (
                tf.data.Dataset.from_tensors(with_crop_seed(*element)).map(decode).ignore_errors()
            )
            return attempt.concatenate(tf.data.Dataset.from_tensors(failed_marker)).take(1)

        decoded = examples.interleave(
            guarded_decode,
            cycle_length=2 * self._threads,
            block_length=1,
            num_parallel_calls=self._threads,
        )
        if not self.is_training:
            end_marker = (blank, tf.constant(_END_LABEL, tf.int32), tf.constant(sources.OK))
            decoded = decoded.concatenate(tf.data.Dataset.from_tensors(end_marker))
        no_skips = tf.zeros([len(sources.FAULT_NAMES)], tf.int64)

        def carry_skips(pending, example):
            image, label, fault = example
            skipped = tf.not_equal(fault, sources.OK)
            pending += tf.one_hot(fault, len(sources.FAULT_NAMES), dtype=tf.int64) * tf.cast(
                skipped, tf.int64
            )
            kept = (image, label, tf.where(skipped, no_skips, pending), tf.logical_not(skipped))
            return tf.where(skipped, pending, no_skips), kept

        decoded = decoded.scan(no_skips, carry_skips)
        decoded = decoded.filter(lambda image, label, skips, kept: kept)
        return decoded.map(lambda image, label, skips, kept: (image, label, skips))

    def _count_skipped(self, images, labels, skips):
        """Adds a batch's skip counts as it is handed out; drops the evaluation end marker."""
        with tf.control_dependencies([self._skipped.assign_add(tf.reduce_sum(skips, axis=0))]):
            if self.is_training:
                return tf.identity(images), tf.identity(labels)
            real = tf.not_equal(labels, _END_LABEL)
            # Only the last batch holds the marker (as its last row).
            count = tf.reduce_sum(tf.cast(real, tf.int32))
            return images[:count], labels[:count]


_END_LABEL = -2
# Records parsed and checked per call (about 14 MB of ImageNet JPEGs per batch in flight).
_PARSE_BATCH = 128

_NOT_A_JPEG = (
    "is not a complete JPEG file (another format, empty or truncated). Re-encode it "
    "(tpu_scale.data.write_tfrecords re-encodes images) or pass skip_corrupt=True to drop and "
    "count it."
)


def _pad_batch(images, labels, batch_size):
    """Pads a (last, partial) batch to `batch_size`, with weight 0 for the padding."""
    count = tf.shape(labels)[0]
    padding = batch_size - count
    images = tf.pad(images, [[0, padding], [0, 0], [0, 0], [0, 0]])
    labels = tf.pad(labels, [[0, padding]])
    weights = tf.pad(tf.ones([count], tf.float32), [[0, padding]])
    images = tf.ensure_shape(images, [batch_size] + images.shape[1:].as_list())
    return images, tf.ensure_shape(labels, [batch_size]), tf.ensure_shape(weights, [batch_size])


def _resolve_labels(label_map, label_offset, num_classes):
    """`(label_offset, num_classes)` from the arguments and the label map; refuses disagreements."""
    if label_map is not None:
        for name, given, mapped in (
            ("label_offset", label_offset, label_map.label_offset),
            ("num_classes", num_classes, label_map.num_classes),
        ):
            if given is not None and given != mapped:
                raise ValueError(
                    f"{name}={given} disagrees with the label map {label_map.path!r}, written with "
                    f"the files: it says {name}={mapped}. Drop {name}= (the label map is read "
                    f"automatically) or pass {name}={mapped}; if the label map is wrong, rewrite "
                    "the "
                    "files with tpu_scale.data.write_tfrecords."
                )
        return label_map.label_offset, label_map.num_classes
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}.")
    return (1 if label_offset is None else label_offset), num_classes
