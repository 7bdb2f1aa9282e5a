"""The parts of a training run around `model.fit`: its callbacks, its folder, its resume.

A run keeps everything in one `model_dir`:

    backup/          what a killed or preempted run resumes from (`checkpointing.BackupAndRestore`)
    checkpoints/     the weights of the newest epochs (`epoch_NNN.weights.h5`)
    logs/            TensorBoard
    settings.json    the settings the run started with (`record_settings`)
    final.keras      the trained model (`save_run`)
    run.json         the run's result (`save_run`; `finished_run` reads it)
    .tpu_scale.lock  held by the run that uses the folder (`folder_lock`)

The JSON files are written atomically (a reader finds the old file or the new one) and checked when
read back: a damaged or foreign one is an error naming the file and the fix.

With a script of its own, a user gets the run's guarantees from `run_callbacks`:

```python
callbacks = training.run_callbacks(model_dir, strategy)
with checkpointing.peer_failures_explained(strategy):
    model.fit(train, epochs=epochs, steps_per_epoch=steps, callbacks=callbacks,
              validation_data=validation.dataset, validation_steps=validation.steps)
```

The same command after a kill resumes from the last backup; a SIGTERM makes every worker save and
exit with `checkpointing.PREEMPTED_EXIT_CODE`; a diverging loss stops the run at its last good
weights; fit's validation, the checkpoints and the saved model see the same batch-norm statistics.
"""

import contextlib
import gc
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import time

import keras
import tensorflow as tf

from tpu_scale import _files, checkpointing
from tpu_scale.callbacks import AverageMovingStatistics, LossGuard
from tpu_scale.torus import weight_update

logger = logging.getLogger(__name__)

BACKUP_DIR = "backup"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
SETTINGS_FILE = "settings.json"
FINAL_MODEL = "final.keras"
RUN_FILE = "run.json"
LOCK_FILE = ".tpu_scale.lock"
CHECKPOINT_FILE = "epoch_{epoch:03d}.weights.h5"  # ModelCheckpoint's pattern
_CHECKPOINT_NAME = re.compile(r"epoch_(\d{3,})\.weights\.h5")  # what it writes, and nothing else


class FolderBusy(RuntimeError):
    """Another run holds the run's folder (`folder_lock`)."""


class FinalSaveError(OSError):
    """The final model could not be written (a full disk, a lost mount); the backups are intact."""


@contextlib.contextmanager
def folder_lock(model_dir, strategy=None):
    """Holds `model_dir` for this run: a second run on the same folder fails at once, naming the
    first, where the two would delete each other's backups.

    The lock is an advisory lock (`fcntl.flock`) on `model_dir/.tpu_scale.lock`, which holds the
    holder's process id and host; the kernel drops it when the holder ends, however it ends, so a
    killed run's file does not block the next. Only the chief holds it (the workers of one run share
    the folder). A folder on a remote filesystem (`gs://...`) or a system without `fcntl` takes no
    lock: there, give each run its own folder.

    Args:
      model_dir: the run's folder; made if missing.
      strategy: the run's `tf.distribute` strategy, or None for one process.

    Raises:
      FolderBusy: another run holds the folder, naming its process and host and the fix.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        fcntl = None
    if fcntl is None or not _files.is_local(model_dir) or (strategy is not None and not checkpointing.is_chief(strategy)):
        yield
        return
    model_dir = _expand(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, LOCK_FILE)
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(handle, 256, 0).decode("utf-8", "replace").strip() or "a process"
            raise FolderBusy(f"{model_dir!r} is in use by another run ({holder}). Wait for it to end, or pass another --model_dir.") from None
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(handle)  # the kernel releases the lock with it


def run_callbacks(model_dir, strategy, *, keep_checkpoints=3, loss_guard=True, tensorboard=True):
    """The callbacks of a resumable, preemptible run that writes to `model_dir`, in their order.

    1. `AverageMovingStatistics`: every replica on the same batch-norm statistics before each
       validation, checkpoint and the final save, so the reported top-1 is the saved model's.
    2. `LossGuard` (unless `loss_guard` is falsy): a diverging loss stops or backs off the run.
    3. `checkpointing.BackupAndRestore` in `model_dir/backup`: atomic backups every epoch, kept
       at the end (a larger `epochs` continues a finished run); a restart resumes from the newest;
       SIGTERM saves on every worker and exits with `checkpointing.PREEMPTED_EXIT_CODE`.
    4. `keras.callbacks.ModelCheckpoint` into `model_dir/checkpoints`, keeping the newest
       `keep_checkpoints` epochs.
    5. `keras.callbacks.TensorBoard` into `model_dir/logs` (if `tensorboard`).

    Under several workers every worker runs them (saving may read variables collectively), but only
    the chief writes to `model_dir`: the others write their checkpoints and logs to a temporary
    folder, removed when `fit` ends. Wrap `fit` in `checkpointing.peer_failures_explained(strategy)`
    to have a dead or frozen worker named.

    Args:
      model_dir: the run's folder (local or `gs://`; on a filesystem every worker reads).
      strategy: the `tf.distribute` strategy the model runs under.
      keep_checkpoints: the newest per-epoch checkpoints kept (0 keeps none).
      loss_guard: True for a default `tpu_scale.callbacks.LossGuard`, a `LossGuard` to use (read
        its `stopped` and `message` after `fit`), or False / None for none.
      tensorboard: whether to write TensorBoard logs.

    Returns:
      A list of Keras callbacks; add your own after them.
    """
    model_dir = _expand(model_dir)
    out_dir = model_dir
    callbacks = [AverageMovingStatistics()]
    if loss_guard is True:
        loss_guard = LossGuard()
    if loss_guard:
        callbacks.append(loss_guard)
    callbacks.append(
        checkpointing.BackupAndRestore(os.path.join(model_dir, BACKUP_DIR), delete_checkpoint=False)
    )
    scratch = None
    if not checkpointing.is_chief(strategy):
        out_dir = scratch = tempfile.mkdtemp(prefix="tpu_scale_worker_")
    checkpoints = os.path.join(out_dir, CHECKPOINTS_DIR)
    if keep_checkpoints > 0:
        callbacks += [
            keras.callbacks.ModelCheckpoint(
                os.path.join(checkpoints, CHECKPOINT_FILE), save_weights_only=True
            ),
            _KeepNewest(checkpoints, keep_checkpoints),
        ]
    if tensorboard:
        callbacks.append(
            keras.callbacks.TensorBoard(os.path.join(out_dir, LOGS_DIR), update_freq="epoch")
        )
    if scratch:
        callbacks.append(_RemoveAtEnd(scratch))
    return callbacks


def train_dataset(strategy, train_input, model_dir=None, steps_per_epoch=None):
    """The distributed training dataset of `train_input`, placed where a resumed run continues.

    With a deterministic input (`InputConfig(deterministic=True)`) and a backup in `model_dir`, the
    batches of the epochs the backup finished are skipped, so the resumed run trains on the same
    batches the uninterrupted run would (`BackupAndRestore` skips those of a part-done epoch
    itself). Otherwise it is `strategy.distribute_datasets_from_function(train_input.dataset)`.

    Args:
      strategy: the `tf.distribute` strategy.
      train_input: an `ImageNetInput` (or any object with `dataset(input_context)`).
      model_dir: the run's folder, or None for a new run.
      steps_per_epoch: the steps of one epoch (needed to skip whole epochs).

    Returns:
      A distributed dataset for `model.fit`.
    """
    steps_done = 0
    deterministic = getattr(getattr(train_input, "config", train_input), "deterministic", False)
    if model_dir and steps_per_epoch and deterministic:
        backup = checkpointing.latest_backup(os.path.join(_expand(model_dir), BACKUP_DIR))
        steps_done = backup.epoch * steps_per_epoch if backup else 0

    def dataset(context):
        # Each step took one batch from this pipeline for every replica it feeds.
        replicas_fed = context.num_replicas_in_sync // context.num_input_pipelines
        return train_input.dataset(context).skip(steps_done * replicas_fed)

    return strategy.distribute_datasets_from_function(dataset)


def resuming_from(model_dir, epochs=None):
    """The backup a run in `model_dir` resumes from, or None for a new run; logs where it resumes.

    Args:
      model_dir: the run's folder.
      epochs: the run's epochs, for the log line.

    Returns:
      A `checkpointing.Backup`, or None.
    """
    backup = checkpointing.latest_backup(os.path.join(_expand(model_dir), BACKUP_DIR))
    if backup is not None:
        logger.info(
            "Resuming from the backup after epoch %d%s%s (%s)",
            backup.epoch,
            f" of {epochs}" if epochs else "",
            f" and {backup.step} steps" if backup.step else "",
            backup.path,
        )
    return backup


def record_settings(model_dir, settings, strategy):
    """Keeps the settings a run starts with; on resuming, warns about every one that changed.

    A new run (no backup in `model_dir`) writes `settings` to `model_dir/settings.json` (the chief
    only). A resumed run compares them with that file and warns, naming each setting that differs:
    the rest of the run trains with the new values.

    Args:
      model_dir: the run's folder.
      settings: a JSON-serializable dict of what decides how the run trains, e.g. flag values.
      strategy: the `tf.distribute` strategy (only the chief writes).

    Returns:
      The names of the settings that differ from the run's start (empty for a new run).
    """
    model_dir = _expand(model_dir)
    path = os.path.join(model_dir, SETTINGS_FILE)
    resuming = checkpointing.latest_backup(os.path.join(model_dir, BACKUP_DIR)) is not None
    if resuming and tf.io.gfile.exists(path):
        try:
            before = _files.read_json(path)
            if not isinstance(before, dict):
                raise ValueError(f"{path!r} holds no settings")
        except ValueError as e:
            # Only a comparison rests on it: the run resumes from its backups all the same.
            logger.warning("%s; the settings this run started with are unknown, so changes to them are not named.", e)
            return []
        changed = [k for k in settings if k in before and before[k] != settings[k]]
        if changed:
            logger.warning(
                "Resuming a run that started with other settings: %s. The rest of the run trains "
                "with the new ones; give the old values to go on as it began.",
                ", ".join(f"--{k} {before[k]} -> {settings[k]}" for k in changed),
            )
        return changed
    if not resuming and checkpointing.is_chief(strategy):
        tf.io.gfile.makedirs(model_dir)
        _files.write_json(path, settings)
    return []


# A run of fewer optimizer steps than this earns `short_run_hint`.
FEW_STEPS = 300


def short_run_hint(steps_per_epoch, epochs, few_steps=FEW_STEPS):
    """Advice for a run of fewer than `few_steps` steps in all (a small dataset or a large
    batch), naming the epochs that would reach them; "" for a longer run."""
    total = steps_per_epoch * epochs
    if total >= few_steps:
        return ""
    return (
        f"{epochs} epochs of {steps_per_epoch} steps are only {total} steps: a small dataset "
        f"learns more with more epochs (--epochs {math.ceil(few_steps / steps_per_epoch)}) or a "
        "smaller --global_batch_size."
    )


def finished_run(model_dir, epochs):
    """The record (`run.json`) of a run in `model_dir` that trained `epochs` or more, else None.

    Raises:
      ValueError: `run.json` is damaged (empty, truncated, not JSON), is not a record `save_run`
        wrote (no whole number of epochs, a top-1 outside [0, 1], ...), or describes a run whose
        final model is not in the folder; naming the file and the fix (move it aside: the run then
        resumes from its backups).
    """
    model_dir = _expand(model_dir)
    path = os.path.join(model_dir, RUN_FILE)
    if not tf.io.gfile.exists(path):
        return None
    try:
        record = _files.read_json(path)
        problem = _record_problem(record, model_dir)
    except ValueError as e:
        problem = str(e)
    if problem:
        raise ValueError(f"{path!r} is not the record of a run finished in this folder: {problem}. Move it aside (mv {path} {path}.bad) to resume the run from its backups, or pass another --model_dir.")
    return record if record["epochs"] >= epochs else None


def _record_problem(record, model_dir):
    """What makes `record` unlike a `run.json` that `save_run` wrote in `model_dir`; None if
    nothing."""

    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(record, dict):
        return f"it holds a {type(record).__name__}, not a record"
    epochs = record.get("epochs")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        return f"'epochs' is {epochs!r}, not a whole number of epochs"
    if "top_1" in record and not (number(record["top_1"]) and 0 <= record["top_1"] <= 1):
        return f"'top_1' is {record['top_1']!r}, not an accuracy between 0 and 1"
    for key in ("images_per_second", "wall_seconds"):
        if record.get(key) is not None and not (number(record[key]) and record[key] >= 0):
            return f"{key!r} is {record[key]!r}, not a rate or a time"
    if not tf.io.gfile.exists(os.path.join(model_dir, FINAL_MODEL)):
        return f"the run it describes left no {FINAL_MODEL} here"
    return None


def finished_message(model_dir, record):
    """What a run says when `model_dir` already holds `record`, a finished run (`finished_run`)."""
    top_1 = f" (top-1 {record['top_1']:.4f})" if "top_1" in record else ""
    return (
        f"{model_dir} already holds a finished run of {record['epochs']} epochs{top_1}; nothing to "
        "train. Pass a larger --epochs to continue it, or another --model_dir for a new run."
    )


def save_run(model_dir, model, record, strategy):
    """Saves the final model and the run's record in `model_dir` (the chief only).

    When saving the model's optimizer is a collective across workers (its update sharded over
    several workers, `weight_update.saving_gathers`), the other workers save the model to a scratch
    folder too, and remove it.

    Args:
      model_dir: the run's folder.
      model: the trained Keras model, saved as `final.keras`.
      record: a JSON-serializable dict of the run's result; it must hold `epochs` (what
        `finished_run` compares).
      strategy: the `tf.distribute` strategy (the chief writes `model_dir`).

    Returns:
      What was written where, as `{description: path}` (empty on other workers).
    """
    if not checkpointing.is_chief(strategy):
        if not weight_update.saving_gathers(model.optimizer):
            return {}
        scratch = tempfile.mkdtemp(prefix="tpu_scale_worker_")
        try:
            model.save(os.path.join(scratch, FINAL_MODEL))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {}
    model_dir = _expand(model_dir)
    outputs = {
        "final model": os.path.join(model_dir, FINAL_MODEL),
        "checkpoints": os.path.join(model_dir, CHECKPOINTS_DIR),
        "backup": os.path.join(model_dir, BACKUP_DIR),
        "TensorBoard logs": os.path.join(model_dir, LOGS_DIR),
        "run record": os.path.join(model_dir, RUN_FILE),
        "settings it started with": os.path.join(model_dir, SETTINGS_FILE),
    }
    # The model first: a run.json always describes a final model that was written whole.
    _save_whole(model, outputs["final model"], outputs["backup"])
    _files.write_json(outputs["run record"], dict(record, model_dir=model_dir, outputs=outputs))
    return outputs


def _save_whole(model, path, backup_dir):
    """`model.save(path)`, written to a temporary name and renamed, so that `path` is a whole
    model or absent; a failure is a `FinalSaveError` naming the folder, the space and the backup
    the same command resumes from."""
    folder = os.path.dirname(path)
    temp = os.path.join(folder, f".tmp-{os.getpid()}-{os.path.basename(path)}")  # Keras: .keras
    try:
        model.save(temp)
        tf.io.gfile.rename(temp, path, overwrite=True)
        return
    except (OSError, tf.errors.OpError) as e:
        error = e
    # Out of the handler the failed write's frames are gone, and with them the half-written file
    # Keras leaves open: collected now, it is closed here, not at interpreter exit.
    gc.collect()
    with contextlib.suppress(OSError, tf.errors.OpError):
        tf.io.gfile.remove(temp)
    need = sum(int(v.numpy().nbytes) for v in model.weights)
    reason, free, last = checkpointing.backups.write_failure_facts(folder, backup_dir, error)
    space = f"the model takes about {need / 1e6:.1f} MB{free}"
    if last is None:
        resume = "There is no backup to resume from."
    else:
        resume = f"The last good backup, {last.path} (epoch {last.epoch}, step {last.step}), is intact: free space and run the same command again to resume from it and save."
    raise FinalSaveError(f"Could not write the final model to {path!r} ({reason}); {space}. {resume}")


class EpochLogger(keras.callbacks.Callback):
    """Logs one line per epoch and measures the training rate.

    The line: `epoch E/N: R images/s (r per replica), loss L, top-1 T, val top-1 V` (`top_1` and
    `val_top_1` from the logs: compile a metric named `top_1`). Each epoch is timed from the end of
    its first step to the end of its last, so tracing and the input pipeline's warm-up do not
    count; a one-step epoch after the first is timed from its start. With `steps_per_execution`
    above 1 Keras reports once per execution, naming its last step: the first execution is the
    one left untimed, and the steps are counted from the names.

    Args:
      global_batch_size: examples per step.
      num_replicas: the replicas in sync (for the per-replica rate).
      epochs: the run's epochs (for the line).

    Attributes:
      images_per_second: the rate over all timed steps, or None when no step could be timed.
    """

    def __init__(self, global_batch_size, num_replicas, epochs):
        super().__init__()
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.epochs = epochs
        self.images, self.seconds = 0, 0.0
        self._first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self._step_ends = []
        self._began = time.perf_counter()
        if self._first_epoch is None:
            self._first_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._step_ends.append((batch, time.perf_counter()))

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        ends, batch = self._step_ends, self.global_batch_size
        images, seconds = 0, 0.0
        if len(ends) >= 2:
            (first_step, first_end), (last_step, last_end) = ends[0], ends[-1]
            images, seconds = (last_step - first_step) * batch, last_end - first_end
        elif ends and epoch > self._first_epoch:
            images, seconds = (ends[0][0] + 1) * batch, ends[0][1] - self._began
        rate = None
        if seconds > 0:
            self.images += images
            self.seconds += seconds
            rate = images / seconds
        logger.info(
            "epoch %d/%d: %s images/s (%s per replica), loss %.4f, top-1 %.4f, val top-1 %.4f",
            epoch + 1,
            self.epochs,
            _rate(rate),
            _rate(rate and rate / self.num_replicas, "%.1f"),
            logs.get("loss", float("nan")),
            logs.get("top_1", float("nan")),
            logs.get("val_top_1", float("nan")),
        )

    @property
    def images_per_second(self):
        return self.images / self.seconds if self.seconds else None


def summary_line(summary):
    """The run's last line: `top-1 X (chance Y) | N images/s (M per replica) | wall S s`, and the
    bad validation records skipped, if any.

    Args:
      summary: a dict with `top_1`, `num_classes`, `images_per_second`,
        `images_per_second_per_replica` (either None when not measured), `wall_seconds` and
        optionally `validation_skipped`.
    """
    line = (
        f"top-1 {summary['top_1']:.4f} (chance {1 / summary['num_classes']:.4f}) | "
        f"{_rate(summary['images_per_second'])} images/s "
        f"({_rate(summary['images_per_second_per_replica'], '%.1f')} per replica) | "
        f"wall {summary['wall_seconds']:.0f} s"
    )
    if summary.get("validation_skipped"):
        line += f" | {summary['validation_skipped']} bad validation records skipped"
    return line


def outputs_lines(outputs):
    """One line per output of `save_run` (`description: path`); None: nothing was kept."""
    if outputs is None:
        return ["outputs: none kept (no --model_dir)"]
    return [f"{name}: {path}" for name, path in outputs.items()]


def _rate(value, form="%.0f"):
    return "n/a" if value is None else form % value


class _KeepNewest(keras.callbacks.Callback):
    """Deletes all but the `keep` newest checkpoints of `folder` at each epoch's end: the files
    named as the run names them (`CHECKPOINT_FILE`), nothing else a user keeps there."""

    def __init__(self, folder, keep):
        super().__init__()
        self.folder, self.keep = folder, keep

    def on_epoch_end(self, epoch, logs=None):
        if tf.io.gfile.isdir(self.folder):
            ours = sorted(  # by epoch, oldest first
                (int(found.group(1)), name)
                for name in tf.io.gfile.listdir(self.folder)
                if (found := _CHECKPOINT_NAME.fullmatch(name))
            )
            for _, name in ours[: -self.keep]:
                tf.io.gfile.remove(os.path.join(self.folder, name))


class _RemoveAtEnd(keras.callbacks.Callback):
    """Removes a worker's scratch folder when `fit` ends."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_train_end(self, logs=None):
        shutil.rmtree(self.folder, ignore_errors=True)


def _expand(path):
    path = os.fspath(path)
    return os.path.expanduser(path) if path.startswith("~") else path
