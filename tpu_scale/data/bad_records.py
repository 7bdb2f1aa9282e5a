"""Bad records of the input pipeline: named in the log, counted, and a stop when there are too many.

`ImageNetInput` skips a record it cannot use (a truncated file, a record that is not an Example, a
missing feature or one of another type, a label out of range, bytes that are no complete image, an
image the decoder rejects) and hands it to a `BadRecordLog`, which logs it once as a warning of the
"tpu_scale" logger, naming the file, the record and the reason, and counts it. The run stops, with
an error naming the first bad records and the fix, when the bad records are more than
`max_bad_fraction` of the records read and at least `MIN_BAD_RECORDS_TO_STOP` (so that one broken
file in a small dataset does not stop it), or at the first one in strict mode.

`SkippedRecordsLogger` is a Keras callback that logs the counts at the end of every epoch.
"""

import logging
import threading

import keras

from tpu_scale.data import sources

logger = logging.getLogger("tpu_scale")

# A run never stops for fewer bad records than this, whatever fraction of the records read they are.
MIN_BAD_RECORDS_TO_STOP = 10
# Bad records an error message names.
_NAMES_IN_ERROR = 5


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
