"""Where records come from: TFRecord files or a TFDS dataset, sharded per input pipeline.

Each source yields `(origin, record_index, payload)` elements for one pipeline's shard and knows how to
`parse` them into `(origin, record_index, image_bytes, label)`; `origin` names the file (or TFDS split) so
that every record-level error can say where the record is.
"""

import dataclasses
import warnings

import tensorflow as tf

AUTOTUNE = tf.data.AUTOTUNE


def shuffle_each_epoch(dataset, buffer_size, seed):
    """Repeats `dataset` forever, shuffled anew in each epoch `e` with the seed `seed + e`.

    Unlike `shuffle(..., reshuffle_each_iteration=True).repeat()`, whose orders depend on how many iterators
    the dataset already had, every new iterator replays the same stream: a resumed run can skip to the step
    where it stopped and see what an uninterrupted run would have seen.
    """
    return tf.data.Dataset.range(2**62).flat_map(
        lambda epoch: dataset.shuffle(buffer_size, seed=seed + epoch, reshuffle_each_iteration=False)
    )


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which part of the data one input pipeline reads."""

    index: int = 0
    count: int = 1


class TFRecordSource:
    """TFRecord files of `tf.train.Example`s with JPEG bytes and an int64 label (the classic ImageNet layout)."""

    def __init__(self, file_pattern, image_key, label_key, read_buffer_bytes, cycle_length):
        self.patterns = [file_pattern] if isinstance(file_pattern, (str, bytes)) else list(file_pattern)
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
            raise ValueError(
                f"No files match the pattern {self.description!r}. Check the path, and that the glob "
                "names the TFRecord shards (for example '/data/imagenet/train-*')."
            )
        return sorted(set(files))

    def check_features(self, first_file):
        """Reads one record so that wrong feature keys fail now, with the keys that are there."""
        first = next(iter(tf.data.TFRecordDataset(first_file).take(1)), None)
        if first is None:
            return
        example = tf.train.Example.FromString(first.numpy())
        found = dict(example.features.feature)
        problems = []
        if self.image_key not in found or found[self.image_key].WhichOneof("kind") != "bytes_list":
            problems.append(f"image_key={self.image_key!r} (a bytes feature)")
        if self.label_key not in found or found[self.label_key].WhichOneof("kind") != "int64_list":
            problems.append(f"label_key={self.label_key!r} (an int64 feature)")
        if problems:
            kinds = ", ".join(f"{k!r} ({v.WhichOneof('kind')})" for k, v in sorted(found.items()))
            raise ValueError(
                f"The records of {first_file!r} lack {' and '.join(problems)}. Keys found: {kinds}. "
                "Pass image_key=... and label_key=... naming the JPEG bytes and the integer label."
            )

    def records(self, shard, *, repeat, shuffle_files, deterministic, seed):
        """A dataset of `(origin, record_index, serialized_example)` for this shard, plus whether the
        shard still has to be cut at record level."""
        files = self.list_files()
        with tf.init_scope():
            self.check_features(files[0])
        record_level = len(files) < shard.count
        if record_level:
            warnings.warn(
                f"{len(files)} file(s) match {self.description!r} but there are {shard.count} input "
                "pipelines: every pipeline reads every file and keeps 1 record in "
                f"{shard.count}. Write at least as many shards as pipelines to read less.",
                stacklevel=3,
            )
        else:
            # Strided, deterministic assignment: pipeline i reads files i, i+n, i+2n, ... (balanced shards).
            files = files[shard.index :: shard.count]
        dataset = tf.data.Dataset.from_tensor_slices(files)
        # Record-level sharding needs every pipeline to see the same record order, so nothing is shuffled
        # before the cut.
        if shuffle_files and not record_level and deterministic and repeat:
            dataset = shuffle_each_epoch(dataset, len(files), seed)
            repeat = False
        elif shuffle_files and not record_level:
            dataset = dataset.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        if repeat:
            # Repeating the file list (not the records) lets the interleave run across epoch boundaries.
            dataset = dataset.repeat()
        dataset = dataset.interleave(
            self._read_file,
            cycle_length=min(self.cycle_length, len(files)),
            block_length=1,
            num_parallel_calls=AUTOTUNE,
            deterministic=True if record_level else deterministic,
        )
        return dataset, record_level

    def _read_file(self, filename):
        records = tf.data.TFRecordDataset(filename, buffer_size=self.read_buffer_bytes)
        return records.enumerate().map(lambda index, record: (filename, index, record))

    def parse(self, record):
        origin, index, serialized = record
        features = tf.io.parse_single_example(
            serialized,
            {
                self.image_key: tf.io.FixedLenFeature([], tf.string),
                self.label_key: tf.io.FixedLenFeature([], tf.int64),
            },
        )
        return origin, index, features[self.image_key], features[self.label_key]


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

    def records(self, shard, *, repeat, shuffle_files, deterministic, seed):
        import tensorflow_datasets as tfds

        builder = tfds.builder(self.name, data_dir=self.data_dir)
        features = builder.info.features
        missing = [k for k in (self.image_key, self.label_key) if k not in features]
        if missing:
            raise ValueError(
                f"TFDS dataset {self.name!r} has no feature(s) {missing}. Keys found: "
                f"{sorted(features.keys())}. Pass image_key=... and label_key=..."
            )
        split = self.split
        if shard.count > 1:
            # Example-level even split: works for any number of files and reads only this pipeline's part.
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

        return dataset.enumerate().map(to_record), False

    def parse(self, record):
        origin, index, image_bytes, label = record
        return origin, index, image_bytes, tf.cast(label, tf.int64)
