"""Bad records of the input pipeline: named in the log, counted, and a stop when there are too many.

`ImageNetInput`'s decode stage (`input_pipeline.DecodeStage`) skips a record it cannot use (a
truncated file, a record that is not an Example, a missing feature or one of another type, a label
out of range, bytes that are no complete image, an image the decoder rejects) and hands it to the
input's `BadRecords`, which logs it once as a warning of the "tpu_scale" logger, naming the file,
the record and the reason, and counts it. The run stops, with an error naming the first bad records
and the fix, when the bad records are more than `max_bad_fraction` of the records read and at least
`MIN_BAD_RECORDS_TO_STOP` (so that one broken file in a small dataset does not stop it), or at the
first one in strict mode. On the tf.data service, whose workers cannot report to this process, the
first bad record stops the run.

`record_faults` classifies a batch of parsed records, and `explanations` says what each fault means
and how to fix it. `SkippedRecordsLogger` is a Keras callback that logs the counts at the end of
every epoch.
"""

import logging
import threading

import keras
import tensorflow as tf

from tpu_scale.data import image_ops, sources
from tpu_scale.data.names import stored
from tpu_scale.data.schema import LABEL_MAP_FILE

logger = logging.getLogger("tpu_scale")

# A run never stops for fewer bad records than this, whatever fraction of the records read they are.
MIN_BAD_RECORDS_TO_STOP = 10
# Bad records an error message names.
_NAMES_IN_ERROR = 5
# The command that rewrites a folder of class folders as records, named in the fixes.
CONVERT_COMMAND = "python -m tpu_scale.data.convert"


class BadRecords:
    """The records read by one input's pipelines and the bad ones among them: named once, counted,
    and the run stopped when there are too many.

    The decode stage calls two methods, both graph ops: `count_read(n)` for every group of records
    it reads, and `report(names, codes)` for the bad ones among them, which fails (stopping the
    run) when the run must stop. The counts add up over every iterator of every dataset of the
    input (read-ahead included) until `reset`.

    Args:
      explanations: what each fault code (`sources.FAULT_NAMES`) means and how to fix it.
      strict: stop at the first bad record.
      max_bad_fraction: stop when the bad records exceed this fraction of the records read (and
        number at least `MIN_BAD_RECORDS_TO_STOP`).
      on_service: the pipeline runs on tf.data service workers, which cannot report to this
        process: `report` stops at the first bad record, with graph ops alone, and nothing is
        counted here.
    """

    def __init__(self, explanations, *, strict, max_bad_fraction, on_service=False):
        self.explanations = dict(explanations)
        self.strict = strict
        self.max_bad_fraction = max_bad_fraction
        self.on_service = on_service
        self._lock = threading.Lock()
        self._named = set()
        self._first = []
        self._counts = [0] * len(sources.FAULT_NAMES)
        self._stop = ""
        with tf.init_scope():
            self._read = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="records_read")

    @property
    def records_read(self) -> int:
        return int(self._read.numpy())

    @property
    def skipped(self) -> int:
        with self._lock:
            return sum(self._counts)

    @property
    def distinct(self) -> int:
        """The different records named since this was made, each once however often read."""
        with self._lock:
            return len(self._named)

    def by_reason(self) -> dict:
        with self._lock:
            return {name: n for name, n in zip(sources.FAULT_NAMES, self._counts) if n}

    def reset(self):
        """Sets the counts to zero (records already named are not named again)."""
        self._read.assign(0)
        with self._lock:
            self._counts = [0] * len(sources.FAULT_NAMES)
            self._first = []
            self._stop = ""

    def count_read(self, count):
        """Graph op: `count` (an int32 scalar) more records read."""
        if self.on_service:
            return tf.no_op()
        return self._read.assign_add(tf.cast(count, tf.int64))

    def report(self, names, codes):
        """Graph op: counts and names bad records (string and int vectors: "record 2 of
        /data/train-00001-of-01024" and its fault code), and fails with the message that stops the
        run when it must stop."""
        if self.on_service:
            return self._stop_on_service(names, codes)
        message = tf.py_function(self._report, [names, codes], tf.string)
        return tf.debugging.Assert(tf.equal(message, ""), [message])

    def _stop_on_service(self, names, codes):
        meanings = tf.constant([self.explanations[c] for c in range(len(sources.FAULT_NAMES))])
        message = tf.strings.join(
            [
                "On the tf.data service the first bad record stops the run (its workers cannot "
                "report skipped records): ",
                names[0],
                " ",
                tf.gather(meanings, codes[0]),
            ]
        )
        return tf.debugging.Assert(tf.equal(tf.size(names), 0), [message])

    def _report(self, names, codes):
        # Never raises: the pipeline must get a message.
        try:
            # Escaped: a file name holding a newline must not forge a line of the log.
            names = [stored(name) for name in names.numpy().tolist()]
            codes = codes.numpy().tolist()
            records_read = self.records_read
            with self._lock:
                for name, code in zip(names, codes):
                    self._counts[code] += 1
                    if len(self._first) < _NAMES_IN_ERROR and name not in dict(self._first):
                        self._first.append((name, code))
                    if name not in self._named:
                        self._named.add(name)
                        logger.warning("Skipped %s: it %s", name, self.explanations[code])
                if not self._stop:
                    self._stop = self._stop_message(records_read)
                return self._stop.encode()
        except Exception as error:  # noqa: BLE001 - the pipeline must get a message, not a raise
            logger.exception("tpu_scale: counting bad records failed")
            return f"Counting bad records failed: {error!r}".encode()

    def _stop_message(self, records_read):
        total = sum(self._counts)
        if self.strict and total:
            name, code = self._first[0]
            return (
                f"strict=True: {name} {self.explanations[code]} Run without strict=True to skip, "
                "count and name bad records."
            )
        if total < MIN_BAD_RECORDS_TO_STOP or total <= self.max_bad_fraction * records_read:
            return ""
        named = ", ".join(f"{name} ({sources.FAULT_NAMES[code]})" for name, code in self._first)
        return (
            f"{total} bad records among the {records_read} records read, more than "
            f"max_bad_fraction={self.max_bad_fraction:g} of them: this looks like damaged files or "
            f"the wrong data rather than a few bad images. The first: {named} (the log names every "
            f"one and says why). Rewrite the files ({CONVERT_COMMAND} decodes every image and "
            "leaves out those it cannot), check the file pattern, or raise max_bad_fraction to "
            "train on the rest."
        )


def explanations(label_map, image_key, label_key, label_offset, num_classes):
    """What each fault code means and how to fix it (a dict by code), for `BadRecords`.

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
        f"format, empty or truncated). Re-encode it ({CONVERT_COMMAND} decodes "
        "every image and re-encodes those that need it).",
        sources.NEGATIVE_LABEL: "has a negative label after subtracting label_offset="
        f"{label_offset}: use label_offset=0 for 0-based labels ({where}).",
        sources.LABEL_TOO_LARGE: f"has a label >= num_classes={num_classes} after "
        f"subtracting label_offset={label_offset} ({where}). Check num_classes and "
        "label_offset.",
        sources.UNDECODABLE: "holds an image the decoder rejects (e.g. a JPEG whose frame "
        "header says height 0, or whose Huffman tables are broken). Re-encode it from a good "
        f"copy ({CONVERT_COMMAND} decodes every image and leaves out those it "
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
