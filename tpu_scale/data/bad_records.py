"""Bad records of the input pipeline: named in the log, counted, and a stop when there are too many.

`ImageNetInput` skips a record it cannot use (a truncated file, a record that is not an Example, a
missing feature or one of another type, a label out of range, bytes that are no complete image, an
image the decoder rejects) and hands it to a `BadRecordLog`, which logs it once as a warning of the
"tpu_scale" logger, naming the file, the record and the reason, and counts it. The run stops, with
an error naming the first bad records and the fix, when the bad records are more than
`max_bad_fraction` of the records read and at least `MIN_BAD_RECORDS_TO_STOP` (so that one broken
file in a small dataset does not stop it), or at the first one in strict mode.

The pipeline's stage that does it is here too: `record_faults` classifies a batch of parsed records
(`explanations` says what each fault means and how to fix it), and `decode_skipping_bad` parses,
checks, decodes and batches the records, naming and counting those it drops, the decoder's rejects
included.

`SkippedRecordsLogger` is a Keras callback that logs the counts at the end of every epoch.
"""

import logging
import threading

import keras
import tensorflow as tf

from tpu_scale.data import image_ops, sources
from tpu_scale.data.schema import LABEL_MAP_FILE
from tpu_scale.data.sources import graph_function

logger = logging.getLogger("tpu_scale")

# A run never stops for fewer bad records than this, whatever fraction of the records read they are.
MIN_BAD_RECORDS_TO_STOP = 10
# Bad records an error message names.
_NAMES_IN_ERROR = 5
# A record's key in the table of names: the number of its iterator above these bits, its place
# in that iterator's stream below them.
SEQUENCE_BITS = 40
# The place of the marker that ends an evaluation pass (after every record's).
END_SEQUENCE = 2**SEQUENCE_BITS - 1
# Records handed to the decode at once per thread of the pool (see `decode_skipping_bad`).
DECODES_IN_FLIGHT = 4
# Records parsed and checked per call (about 14 MB of ImageNet JPEGs per batch in flight).
PARSE_BATCH = 128


class BadRecordLog:
    """Counts and names the bad records an input's pipelines skip; says when the run must stop.

    Thread-safe: the pipelines report from their tf.data threads.

    Args:
      explanations: what each fault code (`sources.FAULT_NAMES`) means and how to fix it.
      strict: stop at the first bad record.
      max_bad_fraction: stop when the bad records exceed this fraction of the records read (and
        number at least `MIN_BAD_RECORDS_TO_STOP`).
    """

    def __init__(self, explanations, *, strict, max_bad_fraction):
        self.explanations = dict(explanations)
        self.strict = strict
        self.max_bad_fraction = max_bad_fraction
        self._lock = threading.Lock()
        self._logged = set()
        self.first = []
        self.counts = [0] * len(sources.FAULT_NAMES)
        self.stop_message = ""

    def reset(self):
        """Sets the counts to zero (records already named are not named again)."""
        with self._lock:
            self.counts = [0] * len(sources.FAULT_NAMES)
            self.first = []
            self.stop_message = ""

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def distinct(self) -> int:
        """The different records named since the log was made, each once however often read."""
        with self._lock:
            return len(self._logged)

    def by_reason(self) -> dict:
        with self._lock:
            return {name: count for name, count in zip(sources.FAULT_NAMES, self.counts) if count}

    def report(self, names, codes, records_read):
        """Counts and names bad records; returns the error message that stops the run, or b"".

        Called from the pipeline (`tf.py_function`) with tensors: `names` (strings such as
        "Record 2 of /data/train-00001-of-01024"), their fault `codes`, and the records read so far.
        Never raises: an exception here would be taken for a bad record by the pipeline.
        """
        try:
            names = [name.decode("utf-8", "replace") for name in names.numpy().tolist()]
            codes = codes.numpy().tolist()
            return self._report(names, codes, int(records_read.numpy())).encode()
        except Exception as error:  # noqa: BLE001 - the pipeline must get a message, not a raise
            logger.exception("tpu_scale: counting bad records failed")
            return f"Counting bad records failed: {error!r}".encode()

    def _report(self, names, codes, records_read):
        with self._lock:
            for name, code in zip(names, codes):
                self.counts[code] += 1
                if len(self.first) < _NAMES_IN_ERROR and name not in dict(self.first):
                    self.first.append((name, code))
                if name not in self._logged:
                    self._logged.add(name)
                    logger.warning("Skipped %s: it %s", name, self.explanations[code])
            if not self.stop_message:
                self.stop_message = self._stop_message(records_read)
            return self.stop_message

    def _stop_message(self, records_read):
        total = sum(self.counts)
        if self.strict and total:
            name, code = self.first[0]
            return (
                f"strict=True: {name} {self.explanations[code]} Run without strict=True to skip, "
                "count and name bad records."
            )
        if total < MIN_BAD_RECORDS_TO_STOP or total <= self.max_bad_fraction * records_read:
            return ""
        named = ", ".join(f"{name} ({sources.FAULT_NAMES[code]})" for name, code in self.first)
        return (
            f"{total} bad records among the {records_read} records read, more than "
            f"max_bad_fraction={self.max_bad_fraction:g} of them: this looks like damaged files or "
            f"the wrong data rather than a few bad images. The first: {named} (the log names every "
            "one and says why). Rewrite the files "
            "(tpu_scale.data.write_tfrecords decodes every image and leaves out those it cannot), "
            "check the file pattern, or raise max_bad_fraction to train on the rest."
        )


def explanations(label_map, image_key, label_key, label_offset, num_classes):
    """What each fault code means and how to fix it (a dict by code), for `BadRecordLog`.

    Args:
      label_map: the `LabelMap` next to the files, or None.
      image_key: the feature holding the image.
      label_key: the feature holding the label.
      label_offset: subtracted from every stored label.
      num_classes: the labels' bound after `label_offset` (None: unchecked).
    """
    if label_map is not None:
        where = f"the label map {label_map.path} says {label_map.num_classes} classes"
    else:
        where = f"no {LABEL_MAP_FILE} is next to the files"
    return {
        sources.OK: "",
        sources.TRUNCATED_FILE: "is where the file stops being readable: it is truncated or "
        "corrupted (its records do not add up to its size, or to its count in "
        f"{LABEL_MAP_FILE}). Copy or write the file again.",
        sources.NOT_AN_EXAMPLE: "is not a serialized tf.train.Example. Check that the file "
        "pattern names TFRecord files of Examples only.",
        sources.MISSING_FEATURE: "lacks the image or the label feature (image_key="
        f"{image_key!r}, label_key={label_key!r}).",
        sources.NOT_AN_IMAGE: "is not a complete JPEG, PNG, GIF, BMP or WebP file (another "
        "format, empty or truncated). Re-encode it (tpu_scale.data.write_tfrecords decodes "
        "every image and re-encodes those that need it).",
        sources.NEGATIVE_LABEL: "has a negative label after subtracting label_offset="
        f"{label_offset}: use label_offset=0 for 0-based labels ({where}).",
        sources.LABEL_TOO_LARGE: f"has a label >= num_classes={num_classes} after "
        f"subtracting label_offset={label_offset} ({where}). Check num_classes and "
        "label_offset.",
        sources.UNDECODABLE: "holds an image the decoder rejects (e.g. a JPEG whose frame "
        "header says height 0, or whose Huffman tables are broken). Re-encode it from a good "
        "copy (tpu_scale.data.write_tfrecords decodes every image and leaves out those it "
        "cannot).",
        sources.WRONG_FEATURE_TYPE: f"has the image feature {image_key!r} or the "
        f"label feature {label_key!r} with another type than bytes and int64.",
    }


def record_faults(image_bytes, stored_label, fault, label_offset, num_classes):
    """The records' fault codes (`sources.OK` for a good one) and their labels after
    `label_offset`.

    The source's fault (truncated file, not an Example, missing feature) comes first, then the
    image's structure, then the label's range. Computed with a few vector ops per batch and no
    assertion.

    Args:
      image_bytes: the records' image bytes (a vector).
      stored_label: their labels as stored (int64).
      fault: the source's fault code of each record.
      label_offset: subtracted from every stored label.
      num_classes: labels at or above it are faults (None: unchecked).

    Returns:
      `(fault, label)`: int vectors, the labels as int32.
    """
    label = stored_label - label_offset
    label_fault = tf.where(label < 0, sources.NEGATIVE_LABEL, sources.OK)
    if num_classes is not None:
        label_fault = tf.where(label >= num_classes, sources.LABEL_TOO_LARGE, label_fault)
    image_fault = tf.where(
        image_ops.is_decodable_image(image_bytes), label_fault, sources.NOT_AN_IMAGE
    )
    return tf.where(tf.equal(fault, sources.OK), image_fault, fault), tf.cast(label, tf.int32)


def decode_skipping_bad(
    records,
    log,
    *,
    parse,
    label_offset,
    num_classes,
    make_crop_seeds,
    decode_example,
    records_read,
    iterators_started,
    is_training,
    seed,
    batch_size,
    threads,
    image_size,
):
    """Parses, checks, decodes and batches the records, skipping, naming and counting bad ones.

    Parsing and the record checks run on batches of `PARSE_BATCH` records (one function call,
    one parser call per batch instead of per record); the bad records of a batch are reported
    to `log` (one `tf.py_function` call for a batch that holds any) and dropped, and
    each good one gets a sequence number and its name in a table. Then the records go one by
    one to the decode, whose errors (an image the decoder rejects) drop the record
    (`ignore_errors`): per batch of examples, the sequence numbers that came out are taken off
    the table, and those left behind by a later record are the decoder's rejects, reported by
    name as soon as the next record comes out. An evaluation pass ends with a marker that
    reports the last ones. Whether the run must stop is checked once per batch.

    Every iterator of the dataset numbers its records in a stream of its own: the table's keys
    carry the iterator's number (counted in `iterators_started` when it starts) above
    `SEQUENCE_BITS`. An iterator takes out only its own records, and drops without a report
    those an earlier iterator left behind, e.g. the iterator `model.fit` draws a first batch from
    to build the model and then discards while its threads still parse.

    The records come out of the parse and of the decode in order (whatever `deterministic`
    says), so that a number left behind is a reject and not a record still being decoded. The
    order costs no CPU time, and the decode keeps every thread busy while one slow image holds
    the head: it takes `DECODES_IN_FLIGHT` records per thread of the pool at once, which wait
    in the pool's queue, and their results in order behind the slow one.

    Args:
      records: the source's records (serialized, as `parse` takes them).
      log: the `BadRecordLog` that names and counts the bad records.
      parse: the source's `parse`: a batch of records -> `(origin, index, image_bytes,
        stored_label, fault)`.
      label_offset: subtracted from the stored labels.
      num_classes: labels must lie below it (None: unchecked).
      make_crop_seeds: `(size, draw)` -> the crop seeds of a batch of `size` records.
      decode_example: `(image_bytes, label, crop_seed)` -> `(image, label)`.
      records_read: the int64 variable counting the records read.
      iterators_started: the int64 variable counting the iterators started (of this dataset or
        of others: each iterator gets a number no other one had).
      is_training: drop the last partial batch (evaluation keeps it, and ends with a marker that
        reports the decoder's last rejects).
      seed: the seed of the per-batch crop seed draws (training).
      batch_size: examples per batch.
      threads: the threads of the pipeline's pool.
      image_size: the images' height and width.

    Returns:
      A dataset of `(images, labels)` batches.
    """
    with tf.init_scope():
        names = tf.lookup.experimental.MutableHashTable(tf.int64, tf.string, "")
        # The message that stops the run, once `log` gives one (key 0).
        stop = tf.lookup.experimental.MutableHashTable(tf.int64, tf.string, "")

    def report(record_names, codes):
        message = tf.py_function(
            log.report,
            [record_names, codes, records_read.read_value()],
            tf.string,
        )
        return stop.insert(tf.constant([0], tf.int64), tf.reshape(message, [1]))

    # Every iterator draws its number once, when it starts, and has it with each batch of records.
    # (The number travels with the records, not in a `flat_map` over the whole pipeline: a
    # pipeline built inside a function is built again at every iterator's start.)
    start = tf.data.Dataset.from_tensors(tf.constant(1, tf.int64))
    start = start.map(graph_function(lambda one: iterators_started.assign_add(one)))
    numbers = start.flat_map(graph_function(lambda n: tf.data.Dataset.from_tensors(n).repeat()))
    if not is_training:
        with tf.init_scope():
            # The image of the marker that ends an evaluation pass: decodable, and cut off.
            end_image = tf.io.encode_jpeg(tf.zeros([image_size, image_size, 3], tf.uint8))

    def parse_and_screen(numbered, iterator, draw=None):
        number, records = numbered
        origin, index, image_bytes, stored_label, fault = parse(records)
        size = tf.size(index)
        counted = records_read.assign_add(tf.cast(size, tf.int64))
        first_key = tf.bitwise.left_shift(iterator, SEQUENCE_BITS)
        sequence = first_key + number * PARSE_BATCH + tf.range(size, dtype=tf.int64)
        record_names = tf.strings.join(["record ", tf.strings.as_string(index), " of ", origin])
        # Every record is in the table from here on: one that goes missing is still named.
        listed = names.insert(sequence, record_names)
        with tf.control_dependencies([listed]):
            fault, labels = record_faults(
                image_bytes, stored_label, fault, label_offset, num_classes
            )
        crop_seeds = make_crop_seeds(size, draw)
        bad = tf.not_equal(fault, sources.OK)
        parts = (image_bytes, labels, crop_seeds, sequence)

        def drop_bad():
            with tf.control_dependencies([counted]):
                at = tf.where(bad)[:, 0]
                reported = report(tf.gather(record_names, at), tf.gather(fault, at))
            with tf.control_dependencies([reported]):
                unlisted = names.remove(tf.gather(sequence, at))
            with tf.control_dependencies([unlisted]):
                # One index vector for every part (a boolean mask would build its own for each).
                good = tf.where(tf.logical_not(bad))[:, 0]
                return tuple(tf.gather(part, good) for part in parts)

        # Only a batch that holds a bad record is masked: masking copies every record.
        parts = tf.cond(tf.reduce_any(bad), drop_bad, lambda: parts)
        if not is_training:
            # The pass's last element (number -1, no records) adds its end marker.
            ends = tf.cast(tf.less(number, 0), tf.int32)
            end = (end_image, tf.constant(-1, tf.int32), tf.zeros([2], tf.int64))
            end += (first_key + END_SEQUENCE,)
            parts = tuple(tf.concat([part, e[tf.newaxis][:ends]], 0) for part, e in zip(parts, end))
        with tf.control_dependencies([counted, listed]):
            return tuple(tf.identity(part) for part in parts)

    data = records.batch(PARSE_BATCH).enumerate()
    if is_training:
        data = tf.data.Dataset.zip((data, numbers, tf.data.Dataset.random(seed=seed)))
    else:
        empty = tuple(tf.zeros([0], spec.dtype) for spec in data.element_spec[1])
        data = data.concatenate(tf.data.Dataset.from_tensors((tf.constant(-1, tf.int64), empty)))
        data = tf.data.Dataset.zip((data, numbers))
    data = data.map(
        graph_function(parse_and_screen), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    data = data.unbatch()

    def decode(image_bytes, label, crop_seed, sequence):
        return (*decode_example(image_bytes, label, crop_seed), sequence)

    # Decodes on every thread of the pipeline's pool: autotuning is off (the input pipeline's
    # options), and AUTOTUNE would then stay at its start value, at most 16 however many
    # cores a host has. The errors ignored after it are those of the decode alone: the
    # stages before it never fail (the reader stops at a broken file, the parser is guarded,
    # see `sources`).
    examples = data.map(
        graph_function(decode),
        num_parallel_calls=DECODES_IN_FLIGHT * threads,
        deterministic=True,
    ).ignore_errors()
    examples = examples.batch(
        batch_size,
        # Training shapes must be static for the accelerator; evaluation keeps every example.
        drop_remainder=is_training,
    )

    def account(images, labels, sequence):
        # A batch holds the records of one iterator, whose number is above their places.
        iterator = tf.bitwise.right_shift(sequence[0], SEQUENCE_BITS)
        end_key = tf.bitwise.left_shift(iterator, SEQUENCE_BITS) + END_SEQUENCE
        taken = names.remove(sequence)
        with tf.control_dependencies([taken]):
            waiting, waiting_names = names.export()
        waiting, waiting_names = tf.reshape(waiting, [-1]), tf.reshape(waiting_names, [-1])
        owner = tf.bitwise.right_shift(waiting, SEQUENCE_BITS)
        lost = tf.equal(owner, iterator) & (waiting < tf.reduce_max(sequence))
        # Left behind by an earlier iterator, which no longer takes records out.
        abandoned = owner < iterator

        def report_lost():
            lost_names = tf.boolean_mask(waiting_names, lost)
            codes = tf.fill(tf.shape(lost_names), sources.UNDECODABLE)
            with tf.control_dependencies([report(lost_names, codes)]):
                return tf.constant(True)

        gone = lost | abandoned

        def remove_gone():
            with tf.control_dependencies([names.remove(tf.boolean_mask(waiting, gone))]):
                return tf.constant(True)

        reported = tf.cond(tf.reduce_any(lost), report_lost, lambda: tf.constant(False))
        with tf.control_dependencies([reported]):
            removed = tf.cond(tf.reduce_any(gone), remove_gone, lambda: tf.constant(False))
        with tf.control_dependencies([removed]):
            message = stop.lookup(tf.constant([0], tf.int64))[0]
        check = tf.debugging.Assert(tf.equal(message, ""), [message])
        with tf.control_dependencies([check]):
            if is_training:
                return tf.identity(images), tf.identity(labels)
            # Only the last batch holds the end marker (as its last row).
            count = tf.reduce_sum(tf.cast(tf.not_equal(sequence, end_key), tf.int32))
            return images[:count], labels[:count]

    examples = examples.map(graph_function(account))
    if not is_training:
        examples = examples.filter(graph_function(lambda images, labels: tf.size(labels) > 0))
    return examples


class SkippedRecordsLogger(keras.callbacks.Callback):
    """Logs, at the end of every epoch and of training, the records each input skipped.

    Example:
        model.fit(train.dataset(), ..., callbacks=[SkippedRecordsLogger(train, validation)])

    logs "epoch 3: train skipped 2 of 1281167 records read (not a complete image: 1, undecodable
    image: 1)" as a warning of the "tpu_scale" logger when an input skipped records, as info
    otherwise. The counts add up over the run (`ImageNetInput.reset_counts` starts them again).

    Args:
      *inputs: the `ImageNetInput`s to report on.
      names: a name for each input in the log (default "train" for a training input, else
        "validation").
    """

    def __init__(self, *inputs, names=None):
        super().__init__()
        self.inputs = inputs
        self.names = (
            list(names)
            if names is not None
            else ["train" if getattr(i, "is_training", False) else "validation" for i in inputs]
        )
        if len(self.names) != len(self.inputs):
            raise ValueError(f"{len(self.inputs)} inputs but {len(self.names)} names.")

    def describe(self) -> str:
        """One line per input: its skipped records, of how many read, by reason."""
        lines = []
        for name, data in zip(self.names, self.inputs):
            reasons = ", ".join(f"{k}: {v}" for k, v in data.skipped_by_reason.items())
            lines.append(
                f"{name} skipped {data.skipped_records} of {data.records_read} records read"
                + (f" ({reasons})" if reasons else "")
            )
        return "; ".join(lines)

    def _log(self, when):
        level = logging.WARNING if any(i.skipped_records for i in self.inputs) else logging.INFO
        logger.log(level, "%s: %s", when, self.describe())

    def on_epoch_end(self, epoch, logs=None):
        self._log(f"epoch {epoch + 1}")

    def on_train_end(self, logs=None):
        self._log("end of training")
