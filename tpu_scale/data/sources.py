"""Where records come from: TFRecord files or a TFDS dataset, sharded per input pipeline.

Each source yields record elements for one pipeline's shard and knows how to `parse` them into
`(origin, record_index, image_bytes, label, fault)`; `origin` names the file (or TFDS split) so that
every record-level error can say where the record is, and `fault` is one of the codes below (`OK`
for a record whose features were read). Parsing never raises on the common bad records: they come
out with their fault code, and the pipeline skips, counts and names them (or, in strict mode, fails
naming the first).
"""

import concurrent.futures
import dataclasses
import os
import warnings

import tensorflow as tf
from google.protobuf.message import DecodeError

from tpu_scale import _workarounds
from tpu_scale.data.schema import is_serialized_example

AUTOTUNE = tf.data.AUTOTUNE

# Record faults, found by the source (the first three) or by the pipeline's checks.
OK = 0
TRUNCATED_FILE = 1
NOT_AN_EXAMPLE = 2
MISSING_FEATURE = 3
NOT_AN_IMAGE = 4
NEGATIVE_LABEL = 5
LABEL_TOO_LARGE = 6
UNDECODABLE = 7
WRONG_FEATURE_TYPE = 8
FAULT_NAMES = (
    "ok",
    "truncated TFRecord file",
    "not a tf.train.Example",
    "missing feature",
    "not a complete image",
    "negative label",
    "label >= num_classes",
    "undecodable image",
    "feature of the wrong type",
)

# Defaults that mark a feature missing from a record (no real JPEG or label takes these values).
_MISSING_IMAGE = b"\x00tpu_scale: missing image feature"
_MISSING_LABEL = -(2**63)
# Stands for the end of a file in the record stream; see `TFRecordSource._read_file`.
_END_OF_FILE = b"\x00tpu_scale: end of file"
# Stands for the end of a file whose record count is known, followed by that count in 20 digits;
# see `TFRecordSource._read_counted_file`. Every such marker has the same length, so a batch of
# records finds its markers by their lengths alone.
_COUNTED_END = b"\x00tpu_scale: end of file; records: "
_COUNT_DIGITS = 20
# Bytes a TFRecord adds to each record: its length, the length's CRC and the data's CRC.
_RECORD_OVERHEAD_BYTES = 16
_PROBE_RECORDS = 16
# Records of one file numbered and counted per step of `TFRecordSource._read_file` (each file in
# the interleave holds this many records ahead: about 1.8 MB of ImageNet JPEGs).
_RECORDS_PER_COUNT = 16


def graph_function(fn):
    """`fn`, for a tf.data transformation, traced as written: without AutoGraph's conversion.

    tf.data runs AutoGraph's source-to-source conversion on every function it is given, and on
    every function those call, unless told not to. The pipeline's functions express all control
    flow on tensors with TensorFlow ops (`tf.cond`, `tf.where`), so the conversion would change
    nothing; it would only add seconds to each pipeline's construction at every start.
    """
    return tf.autograph.experimental.do_not_convert(fn)


def shuffle_each_epoch(dataset, buffer_size, seed):
    """Repeats `dataset` forever, shuffled anew in each epoch `e` with the seed `seed + e`.

    Unlike `shuffle(..., reshuffle_each_iteration=True).repeat()`, whose orders depend on how many
    iterators the dataset already had, every new iterator replays the same stream: a resumed run can
    skip to the step where it stopped and see what an uninterrupted run would have seen.
    """

    def epoch_order(epoch):
        with _workarounds.tensor_seeds():  # a tensor seed after tf.random.set_seed(0)
            return dataset.shuffle(buffer_size, seed=seed + epoch, reshuffle_each_iteration=False)

    return tf.data.Dataset.range(2**62).flat_map(graph_function(epoch_order))


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which part of the data one input pipeline reads."""

    index: int = 0
    count: int = 1


def _without_complete_ends(parts, at_end, file_fault):
    """The `parts` of a batch of records without its end markers, but for those that report a file
    that stopped early (`file_fault`)."""
    kept = tf.where(file_fault | tf.logical_not(at_end))[:, 0]
    return tuple(tf.gather(part, kept) for part in parts)


def expand_patterns(file_pattern):
    """The list of globs in `file_pattern` (one glob or several), with `~` expanded as a shell would
    (gfile does not); `gs://...` and other URLs are left as they are."""
    patterns = [file_pattern] if isinstance(file_pattern, (str, bytes)) else list(file_pattern)
    return [
        os.path.expanduser(p) if isinstance(p, str) and p.startswith("~") else p for p in patterns
    ]


class TFRecordSource:
    """TFRecord files of `tf.train.Example`s with JPEG bytes and an int64 label (the classic
    ImageNet layout).

    `record_counts` maps a file's path to the number of records written to it (`write_tfrecords`
    keeps them in `labels.json`). When every file's count is known, a file that stops early is
    found by comparing the records read with its count, which costs nothing per record; otherwise
    by adding up the bytes of its records (see `_read_file`).
    """

    def __init__(
        self,
        file_pattern,
        image_key,
        label_key,
        read_buffer_bytes,
        cycle_length,
        record_counts=None,
    ):
        self.patterns = expand_patterns(file_pattern)
        self.record_counts = dict(record_counts or {})
        if not self.patterns:
            raise ValueError("file_pattern is empty: give a glob such as '/data/imagenet/train-*'.")
        self.image_key = image_key
        self.label_key = label_key
        self.read_buffer_bytes = read_buffer_bytes
        self.cycle_length = cycle_length
        self.description = ", ".join(str(p) for p in self.patterns)

    def list_files(self):
        files = []
        for pattern in self.patterns:
            files.extend(tf.io.gfile.glob(pattern))
        if not files:
            raise ValueError(f"No files match the pattern {self.description!r}. Check the path, and that the glob names the TFRecord shards (for example '/data/imagenet/train-*').")
        return sorted(set(files))

    def check_features(self, first_file, strict=True):
        """Reads a record so that wrong feature keys fail now, with the keys that are there.

        The first record that is an Example with features is checked. A first record that is not one
        fails here, naming it, when `strict` (otherwise the next records are tried: the pipeline
        skips and names the bad one).
        """
        example = None
        try:
            for index, record in enumerate(
                tf.data.TFRecordDataset(first_file).take(_PROBE_RECORDS)
            ):
                try:
                    example = tf.train.Example.FromString(record.numpy())
                except DecodeError:
                    example = None
                if example is not None and example.features.feature:
                    break
                if strict:
                    raise ValueError(f"Record {index} of {first_file!r} is not a tf.train.Example with features: check that the file pattern names TFRecord files of Examples, or run without strict=True to skip, count and name such records.")
                example = None
        except tf.errors.DataLossError:
            pass  # a truncated file: the pipeline names it when it gets there
        if example is None:
            return
        found = dict(example.features.feature)
        problems = []
        if self.image_key not in found or found[self.image_key].WhichOneof("kind") != "bytes_list":
            problems.append(f"image_key={self.image_key!r} (a bytes feature)")
        if self.label_key not in found or found[self.label_key].WhichOneof("kind") != "int64_list":
            problems.append(f"label_key={self.label_key!r} (an int64 feature)")
        if problems:
            kinds = ", ".join(f"{k!r} ({v.WhichOneof('kind')})" for k, v in sorted(found.items()))
            raise ValueError(f"The records of {first_file!r} lack {' and '.join(problems)}. Keys found: {kinds}. Pass image_key=... and label_key=... naming the JPEG bytes and the integer label.")

    def records_per_shard(self, count):
        """The records each of `count` input pipelines reads, in pipeline order, or None when a
        file's count is unknown or there are fewer files than pipelines."""
        files = self.list_files()
        counts = [self.record_counts.get(path) for path in files]
        if len(files) < count or None in counts:
            return None
        return [sum(counts[index::count]) for index in range(count)]

    def records(self, shard, *, repeat, shuffle_files, deterministic, seed, strict=True):
        """A dataset of `(origin, record_index, serialized_example, file_fault)` for this shard
        (`(origin, record_index, serialized_example)` with end markers where every file's record
        count is known; `parse` takes either), plus whether the shard still has to be cut at
        record level. `strict`: a first record that is not an Example fails now."""
        files = self.list_files()
        with tf.init_scope():
            self.check_features(files[0], strict)
        record_level = len(files) < shard.count
        if record_level:
            warnings.warn(
                f"{len(files)} file(s) match {self.description!r} but there are {shard.count} "
                "input "
                "pipelines: every pipeline reads every file and keeps 1 record in "
                f"{shard.count}. Write at least as many shards as pipelines to read less.",
                stacklevel=3,
            )
        else:
            # Strided, deterministic assignment: pipeline i reads files i, i+n, i+2n, ... (balanced
            # shards).
            files = files[shard.index :: shard.count]
        # Each file's record count, or else its size, lets its reader tell a complete file from one
        # that stops early.
        counts = [self.record_counts.get(path) for path in files]
        if None in counts:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                sizes = list(pool.map(lambda path: tf.io.gfile.stat(path).length, files))
            dataset = tf.data.Dataset.from_tensor_slices((files, tf.constant(sizes, tf.int64)))
            read_file = self._read_file
        else:
            dataset = tf.data.Dataset.from_tensor_slices((files, tf.constant(counts, tf.int64)))
            read_file = self._read_counted_file
        # Record-level sharding needs every pipeline to see the same record order, so nothing is
        # shuffled before the cut.
        if shuffle_files and not record_level and deterministic and repeat:
            dataset = shuffle_each_epoch(dataset, len(files), seed)
            repeat = False
        elif shuffle_files and not record_level:
            dataset = dataset.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        if repeat:
            # Repeating the file list (not the records) lets the interleave run across epoch
            # boundaries.
            dataset = dataset.repeat()
        dataset = dataset.interleave(
            graph_function(read_file),
            cycle_length=min(self.cycle_length, len(files)),
            block_length=1,
            num_parallel_calls=AUTOTUNE,
            deterministic=True if record_level else deterministic,
        )
        return dataset, record_level

    def _read_file(self, filename, size):
        """The records of one file, numbered; a file that cannot be read to its end adds one faulty
        record where the reading stopped.

        The reader's own error (truncated or corrupted record) would not name the file, so reading
        simply stops there, and an end marker compares the bytes read with the file's size. Records
        are numbered and counted `_RECORDS_PER_COUNT` at a time: one function call per record would
        cost more than the counting.
        """
        records = tf.data.TFRecordDataset(filename, buffer_size=self.read_buffer_bytes)
        records = records.ignore_errors().concatenate(tf.data.Dataset.from_tensors(_END_OF_FILE))
        records = records.batch(_RECORDS_PER_COUNT)

        def number(state, batch):
            index, bytes_read = state
            count = tf.size(batch, out_type=tf.int64)
            lengths = tf.cast(tf.strings.length(batch), tf.int64) + _RECORD_OVERHEAD_BYTES
            read_before = bytes_read + tf.math.cumsum(lengths, exclusive=True)
            at_end = tf.equal(batch, _END_OF_FILE)
            file_fault = at_end & tf.not_equal(read_before, size)
            numbered = (tf.fill([count], filename), index + tf.range(count), batch, file_fault)
            # Only the batch that holds the end marker is masked: masking copies every record.
            numbered = tf.cond(
                tf.reduce_any(at_end),
                lambda: _without_complete_ends(numbered, at_end, file_fault),
                lambda: numbered,
            )
            return (index + count, bytes_read + tf.reduce_sum(lengths)), numbered

        records = records.scan(
            (tf.constant(0, tf.int64), tf.constant(0, tf.int64)), graph_function(number)
        )
        return records.unbatch()

    def _read_counted_file(self, filename, count):
        """The records of a file whose record count is known, numbered, and then an end marker that
        carries the count.

        Only TensorFlow's own datasets run per record (no function call): `parse` drops the marker
        where the records before it add up to the count, and reports the file where they do not.
        """
        records = tf.data.TFRecordDataset(filename, buffer_size=self.read_buffer_bytes)
        digits = tf.strings.as_string(count, width=_COUNT_DIGITS, fill="0")
        end = tf.strings.join([_COUNTED_END, digits])
        records = records.ignore_errors().concatenate(tf.data.Dataset.from_tensors(end))
        return tf.data.Dataset.zip(
            (tf.data.Dataset.from_tensors(filename).repeat(), tf.data.Dataset.range(2**62), records)
        )

    @staticmethod
    def _check_counted_ends(origin, index, serialized):
        """A batch of `_read_counted_file` records with its end markers checked: a marker whose
        file gave as many records as its count is dropped; one that did not stays, as the record
        where the file stopped, with its fault flag set."""
        may_end = tf.equal(tf.strings.length(serialized), len(_COUNTED_END) + _COUNT_DIGITS)

        def check():
            at_end = may_end & tf.equal(
                tf.strings.substr(serialized, 0, len(_COUNTED_END)), _COUNTED_END
            )
            digits = tf.strings.substr(serialized, len(_COUNTED_END), _COUNT_DIGITS)
            count = tf.strings.to_number(tf.where(at_end, digits, "0"), tf.int64)
            file_fault = at_end & tf.not_equal(index, count)
            parts = (origin, index, serialized, file_fault)
            return _without_complete_ends(parts, at_end, file_fault)

        # Only a batch that holds a marker is masked: masking copies every record.
        return tf.cond(
            tf.reduce_any(may_end),
            check,
            lambda: (origin, index, serialized, tf.zeros_like(may_end)),
        )

    def parse(self, record):
        """`(origin, index, image_bytes, label, fault)` of one record, or of a batch of them (each
        part then a vector; a batch of records from files of known counts comes out without its
        end markers, but for a file that stopped early)."""
        if len(record) == 3:
            record = self._check_counted_ends(*record)
        origin, index, serialized, file_fault = record
        is_example = is_serialized_example(serialized)
        # A record that is not an Example is parsed as an empty one, so the parser cannot fail on
        # it. Only then are the records copied: `tf.where` on strings copies every one.
        serialized = tf.cond(
            tf.reduce_all(is_example),
            lambda: serialized,
            lambda: tf.where(is_example, serialized, ""),
        )
        image_bytes, label, typed = _parse_features(
            serialized,
            {
                self.image_key: tf.io.FixedLenFeature([], tf.string, default_value=_MISSING_IMAGE),
                self.label_key: tf.io.FixedLenFeature([], tf.int64, default_value=_MISSING_LABEL),
            },
        )
        missing = tf.equal(image_bytes, _MISSING_IMAGE) | tf.equal(label, _MISSING_LABEL)
        fault = tf.where(missing, MISSING_FEATURE, OK)
        fault = tf.where(typed, fault, WRONG_FEATURE_TYPE)
        fault = tf.where(is_example, fault, NOT_AN_EXAMPLE)
        fault = tf.where(file_fault, TRUNCATED_FILE, fault)
        return origin, index, image_bytes, label, fault


def _parse_features(serialized, spec):
    """`(image_bytes, label, typed)` of a batch of serialized Examples (or one), where `typed` is
    False for a record the parser rejects (a feature of another type than `spec` says).

    The parser fails a whole batch for one such record, so it runs inside a one-element dataset
    whose error is ignored; only when it fails is every record parsed again on its own, the same
    way, to find the ones it rejects (given the defaults of `spec`).
    """
    (image_key, image_spec), (label_key, label_spec) = spec.items()

    def parse(records):
        features = tf.io.parse_example(records, spec)
        return features[image_key], features[label_key], tf.ones_like(records, tf.bool)

    def parse_each(records):
        rejected = (
            tf.constant(image_spec.default_value),
            tf.constant(label_spec.default_value, tf.int64),
            tf.constant(False),
        )

        def parse_one(record):
            attempt = tf.data.Dataset.from_tensors(record).map(graph_function(parse))
            attempt = attempt.ignore_errors()
            fallback = tf.data.Dataset.from_tensors(rejected)
            return attempt.concatenate(fallback).take(1).get_single_element()

        if records.shape.rank == 0:
            return parse_one(records)
        return tf.map_fn(parse_one, records, fn_output_signature=(tf.string, tf.int64, tf.bool))

    attempt = tf.data.Dataset.from_tensors(serialized).map(graph_function(parse))
    attempt = attempt.ignore_errors()
    fallback = tf.data.Dataset.from_tensors(serialized).map(graph_function(parse_each))
    return attempt.concatenate(fallback).take(1).get_single_element()


# How `data.inputs` is given a TFDS dataset: "tfds:imagenet2012".
TFDS_PREFIX = "tfds:"


@dataclasses.dataclass(frozen=True)
class TFDSSplit:
    """A split of a TFDS dataset: what `data.inputs("tfds:NAME")` hands each of its
    `ImageNetInput`s (the one way a TFDS dataset is read)."""

    name: str
    split: str
    data_dir: str | None = None


class TFDSSource:
    """A TFDS image classification dataset read with TFDS's own image decoding skipped."""

    def __init__(self, name, split, data_dir, image_key, label_key, cycle_length):
        self.name = name
        self.split = split
        self.data_dir = data_dir
        self.image_key = image_key
        self.label_key = label_key
        self.cycle_length = cycle_length
        self.description = f"tfds:{name}/{split}"

    def records(self, shard, *, repeat, shuffle_files, deterministic, seed, strict=True):
        import tensorflow_datasets as tfds

        builder = tfds.builder(self.name, data_dir=self.data_dir)
        features = builder.info.features
        missing = [k for k in (self.image_key, self.label_key) if k not in features]
        if missing:
            raise ValueError(f"TFDS dataset {self.name!r} has no feature(s) {missing}. Keys found: {sorted(features.keys())}. Pass image_key=... and label_key=...")
        split = self.split
        if shard.count > 1:
            # Example-level even split: works for any number of files and reads only this pipeline's
            # part.
            split = tfds.even_splits(split, n=shard.count)[shard.index]
        read_config = tfds.ReadConfig(
            shuffle_seed=seed,
            interleave_cycle_length=self.cycle_length,
            interleave_block_length=1,
            try_autocache=False,
        )
        dataset = builder.as_dataset(
            split=split,
            decoders={self.image_key: tfds.decode.SkipDecoding()},
            shuffle_files=shuffle_files,
            read_config=read_config,
        )
        if repeat:
            dataset = dataset.repeat()
        origin = tf.constant(self.description)

        def to_record(index, example):
            return origin, index, example[self.image_key], example[self.label_key]

        return dataset.enumerate().map(graph_function(to_record)), False

    def parse(self, record):
        origin, index, image_bytes, label = record
        return origin, index, image_bytes, tf.cast(label, tf.int64), tf.zeros_like(label, tf.int32)
