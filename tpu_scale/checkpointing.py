"""Surviving kills and preemption: backups never half-written, failures that say who failed.

Three pieces, for `model.fit` under any `tf.distribute` strategy:

* `BackupAndRestore`, a Keras callback. Every save writes the weights (with the optimizer state) and
  the training position into a fresh temporary folder, checksums them, and renames the folder into
  place in one step, so a kill at any instant leaves either the previous backup or the new one,
  never a mixture. The newest `2` backups are kept; a restore takes the newest one whose checksums
  hold, and names every damaged one it passed over in a warning. Under `MultiWorkerMirroredStrategy`
  every worker restores exactly the backup the chief chose, read from the same `backup_dir`, and the
  workers check this before training.
* Preemption: on SIGTERM the callback saves a backup at the next train step that every worker
  reaches, then the process exits with `PREEMPTED_EXIT_CODE`. Several workers agree on that step
  through TensorFlow's coordination service, as
  `tf.distribute.experimental.PreemptionCheckpointHandler` does. Running the same command again
  resumes from that step, on every worker.
* `peer_failures_explained(strategy)`, a context manager around `model.fit` that turns the runtime's
  collective errors after a worker died or froze into a `PeerFailureError` naming the task(s) and
  what to do.

    callback = checkpointing.BackupAndRestore(os.path.join(model_dir, "backup"))
    with checkpointing.peer_failures_explained(strategy):
        model.fit(dataset, epochs=90, steps_per_epoch=1251, callbacks=[callback])

Layout of `backup_dir` (written by the chief only):

    backup-000007/model.weights.h5   the weights, as `Model.save_weights` writes them
    backup-000007/backup.json        epoch, step, and each file's size and SHA-256; written last
    .tmp-backup-000008-<pid>/        a save in progress (or killed): never read, removed later
"""

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import keras
import tensorflow as tf
from absl import logging
from tensorflow.python.eager import context as tf_context

PREEMPTED_EXIT_CODE = 143
"""Exit code after a preemption backup: 128 + SIGTERM, what a shell reports for a job ended by
SIGTERM and what TensorFlow's `PreemptionCheckpointHandler` uses on Google Cloud. A process killed
by the signal itself shows as -15 to `subprocess`, so the two stay distinguishable there."""

WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "backup.json"
_FORMAT = 1
_NAME = re.compile(r"^backup-(\d{6,})$")
_TEMP_PREFIX = ".tmp-backup-"
_KEY_PREFIX = "tpu_scale/checkpointing"
_STOP = "stop"
_fit_counter = itertools.count()


# --------------------------------------------------------------------------- backups on disk


@dataclasses.dataclass(frozen=True)
class Backup:
    """One complete backup in a `backup_dir`.

    Attributes:
      path: the backup's folder.
      epoch: the epoch training resumes in (0-based; all earlier epochs are done).
      step: train steps of `epoch` already done (0 after an end-of-epoch save).
      sequence: the save's number; higher is newer.
      reason: why it was saved: `"epoch"`, `"batch"` or `"preemption"`.
      sha256: the weights file's SHA-256.
    """

    path: str
    epoch: int
    step: int
    sequence: int
    reason: str
    sha256: str


class DamagedBackupError(OSError):
    """A backup folder whose metadata is unreadable or whose files do not match their checksums."""


def _is_local(path):
    return "://" not in path


def _sha256(path):
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as f:
        while True:
            chunk = f.read(1 << 22)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def _sequences(backup_dir):
    """The backups' `(sequence, path)` in `backup_dir`, newest first."""
    if not tf.io.gfile.isdir(backup_dir):
        return []
    found = []
    for name in tf.io.gfile.listdir(backup_dir):
        match = _NAME.match(name.rstrip("/"))
        if match:
            found.append((int(match.group(1)), os.path.join(backup_dir, name.rstrip("/"))))
    return sorted(found, reverse=True)


def read_backup(path):
    """Reads and verifies one backup folder.

    Args:
      path: a `backup-NNNNNN` folder.

    Returns:
      The `Backup`.

    Raises:
      DamagedBackupError: the metadata is missing or unreadable, or a file is missing, has another
        size or another SHA-256 than the metadata records.
    """
    metadata_path = os.path.join(path, METADATA_FILE)
    try:
        with tf.io.gfile.GFile(metadata_path) as f:
            metadata = json.load(f)
        record = metadata["files"][WEIGHTS_FILE]
        backup = Backup(path=path, epoch=int(metadata["epoch"]), step=int(metadata["step"]),
                        sequence=int(metadata["sequence"]), reason=str(metadata["reason"]),
                        sha256=str(record["sha256"]))
    except (OSError, tf.errors.OpError, ValueError, KeyError, TypeError) as e:
        raise DamagedBackupError(f"its metadata {metadata_path} is unreadable ({e})") from e
    weights_path = os.path.join(path, WEIGHTS_FILE)
    try:
        size = tf.io.gfile.stat(weights_path).length
        if size != record["size"]:
            raise DamagedBackupError(
                f"{weights_path} holds {size} bytes, {record['size']} were written (truncated)")
        if _sha256(weights_path) != backup.sha256:
            raise DamagedBackupError(f"{weights_path} does not match its SHA-256 (corrupted)")
    except (OSError, tf.errors.OpError) as e:
        if isinstance(e, DamagedBackupError):
            raise
        raise DamagedBackupError(f"{weights_path} is unreadable ({e})") from e
    return backup


def latest_backup(backup_dir):
    """The newest complete backup in `backup_dir`, warning about each damaged one passed over.

    What `BackupAndRestore` restores; call it before `fit` to place the input pipeline, e.g. skip
    `backup.epoch * steps_per_epoch` batches of a deterministic stream (the callback itself skips
    the `backup.step` batches of a part-done epoch).

    Args:
      backup_dir: the callback's `backup_dir`.

    Returns:
      A `Backup`, or `None` when there is no complete backup (training starts at epoch 0).
    """
    damaged = []
    chosen = None
    for _, path in _sequences(backup_dir):
        try:
            chosen = read_backup(path)
            break
        except DamagedBackupError as e:
            damaged.append((path, str(e)))
    for path, reason in damaged:
        if chosen is not None:
            outcome = (f"restoring the previous backup {chosen.path} instead (epoch "
                       f"{chosen.epoch + 1}, step {chosen.step})")
        else:
            outcome = "no complete backup is left, so training starts over from epoch 0"
        logging.warning("Backup %s is damaged: %s; %s. Delete it once you have looked at it.",
                        path, reason, outcome)
    return chosen


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _remove(path):
    try:
        if _is_local(path):
            shutil.rmtree(path, ignore_errors=True)
        elif tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
    except (OSError, tf.errors.OpError) as e:
        logging.warning("Could not remove %s (%s); it is not needed any more.", path, e)


def _write_backup(model, backup_dir, epoch, step, reason, keep):
    """Saves `model` as a new backup and removes all but the newest `keep`; returns the `Backup`."""
    tf.io.gfile.makedirs(backup_dir)
    existing = _sequences(backup_dir)
    sequence = existing[0][0] + 1 if existing else 1
    name = f"backup-{sequence:06d}"
    temp = os.path.join(backup_dir, f"{_TEMP_PREFIX}{sequence:06d}-{os.getpid()}")
    _remove(temp)
    tf.io.gfile.makedirs(temp)
    weights_path = os.path.join(temp, WEIGHTS_FILE)
    model.save_weights(weights_path)
    digest = _sha256(weights_path)
    metadata = {
        "format": _FORMAT, "epoch": epoch, "step": step, "sequence": sequence, "reason": reason,
        "saved_at": time.time(),
        "files": {WEIGHTS_FILE: {"size": tf.io.gfile.stat(weights_path).length, "sha256": digest}},
    }
    metadata_path = os.path.join(temp, METADATA_FILE)
    with tf.io.gfile.GFile(metadata_path, "w") as f:
        f.write(json.dumps(metadata, indent=1))
    final = os.path.join(backup_dir, name)
    if _is_local(backup_dir):
        # Durable before visible: after the rename, a crash of the machine (not only of the process)
        # must not expose a folder whose files are still only in the page cache.
        _fsync(weights_path)
        _fsync(metadata_path)
        os.replace(temp, final)
        directory = os.open(backup_dir, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    else:
        # Object stores have no atomic folder rename; `backup.json` is written last and every file
        # is checked against it on restore, so a partial copy reads as damaged, never as complete.
        tf.io.gfile.rename(temp, final)
    _prune(backup_dir, keep)
    return Backup(path=final, epoch=epoch, step=step, sequence=sequence, reason=reason,
                  sha256=digest)


def _prune(backup_dir, keep):
    """Removes interrupted saves and every backup older than the newest `keep` complete ones."""
    for name in tf.io.gfile.listdir(backup_dir):
        if name.startswith(_TEMP_PREFIX):
            _remove(os.path.join(backup_dir, name.rstrip("/")))
    complete = 0
    for _, path in _sequences(backup_dir):
        if complete >= keep:
            _remove(path)
            continue
        try:
            read_backup(path)
            complete += 1
        except DamagedBackupError:
            pass  # kept until enough newer complete backups exist: it is evidence


# --------------------------------------------------------------------------- the cluster


@dataclasses.dataclass(frozen=True)
class _Cluster:
    """This process's place in a multi-worker cluster."""

    tasks: tuple  # ("/job:worker/replica:0/task:0", ...), the chief first
    addresses: dict  # task name -> "host:port"
    me: str

    @property
    def chief(self):
        return self.tasks[0]

    @property
    def is_chief(self):
        return self.me == self.chief

    @classmethod
    def of(cls, strategy):
        """The cluster of `strategy`, or `None` for a single process."""
        resolver = getattr(strategy, "cluster_resolver", None)
        if resolver is None:
            return None
        spec = resolver.cluster_spec().as_dict()
        tasks, addresses = [], {}
        for job in ("chief", "worker"):
            jobs = spec.get(job, [])
            items = jobs.items() if isinstance(jobs, dict) else enumerate(jobs)
            for index, address in sorted(items):
                name = f"/job:{job}/replica:0/task:{index}"
                tasks.append(name)
                addresses[name] = address
        if len(tasks) < 2 or resolver.task_type not in ("chief", "worker"):
            return None
        me = f"/job:{resolver.task_type}/replica:0/task:{resolver.task_id}"
        return cls(tuple(tasks), addresses, me)

    def describe(self, task):
        return f"{task} ({self.addresses.get(task, 'unknown address')})"


def _kv_get(key, timeout_seconds):
    return tf_context.context().get_config_key_value(key, int(timeout_seconds * 1000))


def _kv_set(key, value):
    tf_context.context().set_config_key_value(key, value)


# --------------------------------------------------------------------------- preemption


class _PreemptionNotice:
    """Turns SIGTERM into "save at train step N", the same N on every worker.

    The signalled worker claims a key in the coordination service with the step after its current
    one and waits until every worker has acknowledged it; a watcher thread on each worker reads the
    key. Workers of a synchronous `fit` are at most one step apart (each step's all-reduce needs all
    of them), so every worker learns N before it finishes step N. One process alone saves at the
    step it is in.
    """

    def __init__(self, cluster, prefix, ack_timeout):
        self._cluster = cluster
        self._key = f"{prefix}/preempt"
        self._ack_prefix = f"{prefix}/preempt_ack"
        self._ack_timeout = ack_timeout
        self._signalled = threading.Event()
        self._agreed = threading.Event()
        self._claimed = False
        self.save_at = None
        self.origin = None
        self._previous_handler = None
        self._installed = False
        self._thread = None

    def start(self):
        if threading.current_thread() is not threading.main_thread():
            logging.warning("BackupAndRestore: fit runs outside the main thread, where no SIGTERM "
                            "handler can be installed; a preemption notice will not save a backup.")
            return
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        if self._cluster is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="tpu_scale-preemption-watcher")
            self._thread.start()

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self._signalled.set()

    @property
    def signalled(self):
        return self._signalled.is_set()

    def _watch(self):
        try:
            value = _kv_get(self._key, 0)  # blocks until a notice or the end of training
        except Exception:  # noqa: BLE001  the cluster is going down; the main thread reports that
            return
        if value == _STOP:
            return
        step, origin = value.split("|", 1)
        self.save_at, self.origin = int(step), origin
        self._agreed.set()
        try:
            _kv_set(f"{self._ack_prefix}/{self._cluster.me}", "1")
        except Exception as e:  # noqa: BLE001
            logging.warning("Could not acknowledge the preemption notice of %s: %s", origin, e)

    def due(self, steps_done, may_claim=True):
        """Whether to save now, after `steps_done` train steps of this `fit`."""
        if self._agreed.is_set():
            return steps_done >= self.save_at
        if not self._signalled.is_set():
            return False
        if self._cluster is None:
            self.save_at, self.origin = steps_done, "this process"
            return True
        if self._claimed or not may_claim:
            return False
        self._claimed = True
        me = self._cluster.me
        try:
            _kv_set(self._key, f"{steps_done + 1}|{me}")
        except tf.errors.AlreadyExistsError:
            return False  # another worker's notice came first; its step applies to everyone
        logging.warning("SIGTERM on %s: every worker saves a backup after train step %d.",
                        me, steps_done + 1)
        for task in self._cluster.tasks:
            try:
                _kv_get(f"{self._ack_prefix}/{task}", self._ack_timeout)
            except tf.errors.OpError as e:
                logging.warning("%s did not acknowledge the preemption notice within %d s (%s); "
                                "saving anyway.", self._cluster.describe(task), self._ack_timeout,
                                type(e).__name__)
        return False

    def stop(self):
        if self._thread is not None:
            try:
                _kv_set(self._key, _STOP)
            except tf.errors.OpError:
                pass  # a notice or another worker's stop is there already: the watcher has returned
            self._thread.join(timeout=5)
            self._thread = None
        if self._installed:
            previous = self._previous_handler
            # None: a handler installed outside Python (TensorFlow's own, which saves nothing).
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._installed = False


# --------------------------------------------------------------------------- the callback


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state so that a killed or preempted `fit` resumes where it stopped.

    Like `keras.callbacks.BackupAndRestore`, with these guarantees:

    * a kill at any instant leaves a restorable backup: each save goes to a fresh temporary folder,
      renamed into place when complete; the weights and the epoch always come from the same save;
    * the newest `2` backups are kept (`double_checkpoint`); a damaged one (truncated, corrupted,
      half-copied) is named in a warning and the previous one restored, or training starts over if
      none is left, said in the same warning;
    * a backup saved in the middle of an epoch resumes in the middle: the first `step` batches of
      that epoch are read from the input and dropped, so a deterministic input stream continues
      exactly;
    * under `MultiWorkerMirroredStrategy` the chief chooses the backup and every worker loads that
      same backup from its own `backup_dir` (the same path on a shared filesystem); a worker that
      cannot read it stops every worker with an error naming the path, before any training step;
    * on SIGTERM (`save_before_preemption`) every worker saves at the same train step and the
      process exits with `preemption_exit_code`; the same command resumes.

    Only the chief writes to `backup_dir`. The other workers write the same save (saving may read
    variables collectively) to a private temporary folder and delete it at once.

    Args:
      backup_dir: folder for the backups, used by nothing else. Under several workers it must be on
        a filesystem every worker reads (e.g. `gs://...` or NFS), at the same path.
      save_freq: `"epoch"` to save at the end of every epoch, an int to save every that many
        batches, or `False` to save only before preemption.
      double_checkpoint: keep the previous backup next to the newest (default, unlike Keras), so a
        damaged newest backup costs one save interval, not the run.
      delete_checkpoint: delete `backup_dir` when `fit` ends normally.
      save_before_preemption: on SIGTERM, save a backup at the next common step and exit.
      preemption_exit_code: the exit code after that save.
      sync_timeout: seconds a worker waits for the others while agreeing on the backup to restore or
        the step of a preemption save.

    Attributes:
      restored: the `Backup` the last `fit` resumed from, or `None`.
      last_backup: the newest `Backup` this callback wrote, or `None`.
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=True,
                 delete_checkpoint=True, save_before_preemption=True,
                 preemption_exit_code=PREEMPTED_EXIT_CODE, sync_timeout=300):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir, got an empty one.")
        batches = isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
        if not (save_freq == "epoch" or save_freq is False or batches):
            raise ValueError(f"save_freq={save_freq!r}: use 'epoch', a positive number of batches, "
                             f"or False (save only before preemption).")
        self.backup_dir = str(backup_dir)
        self.save_freq = save_freq
        self.keep = 2 if double_checkpoint else 1
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self.preemption_exit_code = preemption_exit_code
        self.sync_timeout = sync_timeout
        self.restored = None
        self.last_backup = None
        self._cluster = None
        self._notice = None

    # ------------------------------------------------------------ restore

    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise ValueError(
                f"BackupAndRestore needs a built model before fit(); {model.name} is not built. "
                f"Build it first, e.g. with keras.Input in the model or model.build(input_shape).")
        self._cluster = _Cluster.of(model.distribute_strategy)
        prefix = f"{_KEY_PREFIX}/{next(_fit_counter)}"
        self._epoch, self._step, self._steps_done = 0, 0, 0
        self._batches_since_save = 0
        self._skip = 0
        model._initial_epoch = None
        if self._cluster is None:
            backup = latest_backup(self.backup_dir)
            if backup is not None:
                self._load(backup)
        else:
            backup = self._restore_in_cluster(prefix)
        self.restored = backup
        if backup is not None:
            model._initial_epoch = backup.epoch
            self._epoch, self._step = backup.epoch, backup.step
            if backup.step:
                self._skip_batches(backup.step)
            logging.info("BackupAndRestore: resumed from %s (epoch %d, step %d).",
                         backup.path, backup.epoch + 1, backup.step)
        if self.save_before_preemption:
            self._notice = _PreemptionNotice(self._cluster, prefix, self.sync_timeout)
            self._notice.start()

    def _load(self, backup):
        model = self.model
        try:
            with model.distribute_strategy.scope():
                if model.optimizer is not None and not model.optimizer.built:
                    model.optimizer.build(model.trainable_variables)
            model.load_weights(os.path.join(backup.path, WEIGHTS_FILE))
        except Exception as e:
            raise ValueError(
                f"Backup {backup.path} (epoch {backup.epoch + 1}, step {backup.step}) is complete "
                f"but does not fit this model: {type(e).__name__}: {e}. The model or its optimizer "
                f"changed since it was written: use another backup_dir, or delete "
                f"{self.backup_dir} to start over.") from e

    def _restore_in_cluster(self, prefix):
        """The chief picks the backup; every worker loads that one; all check the others did."""
        cluster = self._cluster
        choice_key = f"{prefix}/restore"
        if cluster.is_chief:
            backup = latest_backup(self.backup_dir)
            choice = "none" if backup is None else json.dumps(
                {"name": os.path.basename(backup.path), "epoch": backup.epoch,
                 "step": backup.step, "sha256": backup.sha256})
            _kv_set(choice_key, choice)
        else:
            choice = self._wait_for(choice_key, f"the chief {cluster.describe(cluster.chief)} to "
                                    f"choose the backup to restore")
            backup = None
        failure = None
        try:
            if choice != "none":
                chosen = json.loads(choice)
                if not cluster.is_chief:
                    backup = self._find_chiefs_backup(chosen)
                self._load(backup)
        except Exception as e:  # noqa: BLE001  every failure must reach the other workers
            failure = e
        verdict = "ok" if failure is None else f"{type(failure).__name__}: {failure}"
        _kv_set(f"{prefix}/restored/{cluster.me}", verdict)
        for task in cluster.tasks:
            other = verdict if task == cluster.me else self._wait_for(
                f"{prefix}/restored/{task}", f"{cluster.describe(task)} to restore its backup")
            if other != "ok":
                raise RuntimeError(
                    f"Resuming failed on {task}, so no worker starts training. {other}"
                ) from failure
        return backup

    def _find_chiefs_backup(self, chosen):
        path = os.path.join(self.backup_dir, chosen["name"])
        fix = (f"The chief restores {chosen['name']} (epoch {chosen['epoch'] + 1}, step "
               f"{chosen['step']}) from its backup_dir; every worker must read the same backup, so "
               f"backup_dir (model_dir) must be on a filesystem every worker reads, at the same "
               f"path (e.g. gs://... or an NFS mount).")
        try:
            backup = read_backup(path)
        except DamagedBackupError as e:
            raise OSError(f"{self._cluster.me} cannot read {path}: {e}. {fix}") from e
        if backup.sha256 != chosen["sha256"]:
            raise OSError(f"{self._cluster.me} reads another {path} than the chief (different "
                          f"SHA-256). {fix}")
        return backup

    def _wait_for(self, key, what):
        try:
            return _kv_get(key, self.sync_timeout)
        except tf.errors.OpError as e:
            raise RuntimeError(
                f"{self._cluster.me} waited {self.sync_timeout} s for {what}, in vain "
                f"({type(e).__name__}: {(e.message or '').strip().splitlines()[:1]}). That "
                f"worker is stopped, frozen or much slower; check its log, then relaunch every "
                f"worker.") from e

    def _skip_batches(self, count):
        """Makes the first `count` train steps read their batches and drop them, not train."""
        model = self.model
        original = model.train_function
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        self._skip = count

        def drop_batches(iterator):
            for _ in range(min(per_call, self._skip)):
                if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                    if not iterator.get_next_as_optional().has_value():
                        raise StopIteration
                else:
                    next(iterator)
            self._skip -= per_call
            if self._skip <= 0:
                model.train_function = original
            return {}

        model.train_function = drop_batches

    # ------------------------------------------------------------ save

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._step = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        skipping = self._skip > 0  # batches of a part-done epoch still to drop
        self._step = batch + 1
        self._steps_done += 1
        if self._notice is not None and self._notice.due(self._steps_done, not skipping):
            self._save_and_exit()
        if isinstance(self.save_freq, int) and self.save_freq and not skipping:
            self._batches_since_save += 1
            if self._batches_since_save >= self.save_freq:
                self._batches_since_save = 0
                self._save(self._epoch, self._step, "batch")

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0, "epoch")

    def _save(self, epoch, step, reason):
        if self._cluster is None or self._cluster.is_chief:
            self.last_backup = _write_backup(self.model, self.backup_dir, epoch, step, reason,
                                             self.keep)
            return self.last_backup
        # One fixed local folder per worker and backup_dir: what a killed save leaves is replaced by
        # the next one, and no copy goes to a shared (possibly remote) filesystem.
        tag = hashlib.sha256(self.backup_dir.encode()).hexdigest()[:12]
        task = self._cluster.me.replace("/job:", "").replace("/replica:0/task:", "")
        private = os.path.join(tempfile.gettempdir(), f"tpu_scale_backup_{tag}_{task}")
        shutil.rmtree(private, ignore_errors=True)
        os.makedirs(private)
        try:
            self.model.save_weights(os.path.join(private, WEIGHTS_FILE))
        finally:
            shutil.rmtree(private, ignore_errors=True)
        return None

    def _save_and_exit(self):
        notice = self._notice
        saved = self._save(self._epoch, self._step, "preemption")
        notice.stop()
        where = saved.path if saved else f"the chief's {self.backup_dir}"
        message = (f"Preempted (SIGTERM on {notice.origin}): saved the training state after epoch "
                   f"{self._epoch + 1} step {self._step} to {where}. Exiting with code "
                   f"{self.preemption_exit_code}; run the same command again to resume from there.")
        logging.warning(message)
        sys.exit(self.preemption_exit_code)

    def on_train_end(self, logs=None):
        if self._notice is not None:
            if self._notice.signalled:
                logging.warning("SIGTERM arrived as training ended; training is complete, so no "
                                "backup was saved for it.")
            self._notice.stop()
            self._notice = None
        self.model._initial_epoch = None
        if self.delete_checkpoint and (self._cluster is None or self._cluster.is_chief):
            _remove(self.backup_dir)


# --------------------------------------------------------------------------- peer failures


class PeerFailureError(RuntimeError):
    """Training stopped because another worker died, froze or became unreachable.

    Attributes:
      tasks: the task names the runtime or a probe points at (may be empty when nothing is known).
    """

    def __init__(self, message, tasks=()):
        super().__init__(message)
        self.tasks = tuple(tasks)


_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                tf.errors.InternalError, tf.errors.CancelledError)
_PEER_MARKERS = ("ollective", "heartbeat", "CoordinationService", "WorkerService", "/job:")
_TASK = r"/job:\w+/replica:\d+/task:\d+"


def probe_task(address, timeout=2.0):
    """Whether the gRPC server at `address` is alive: `"answers"`, `"refused"`, `"silent"`, ...

    Opens a TCP connection and sends the HTTP/2 preface. A live server answers with its settings at
    once; a dead process's port refuses the connection; a stopped or hung process's kernel still
    accepts it, but nothing answers.

    Args:
      address: `"host:port"`.
      timeout: seconds for the connection and for the answer.

    Returns:
      `"answers"`, `"refused"` (no process listens), `"silent"` (frozen), `"closed"` or
      `"unreachable: <error>"`.
    """
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            return "answers" if s.recv(9) else "closed"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "silent"
    except OSError as e:
        return f"unreachable: {e}"


_PROBE_WORDS = {
    "refused": "is not running (its port refuses connections)",
    "silent": "accepts connections but does not answer: frozen (stopped, hung or overloaded)",
    "closed": "closes connections at once (shutting down)",
}


def explain_peer_failure(error, cluster, probe_timeout=2.0):
    """A `PeerFailureError` for `error`, naming the failed task(s) of `cluster`.

    Args:
      error: the `tf.errors.OpError` from a collective or from the coordination service.
      cluster: the `_Cluster` this process belongs to.
      probe_timeout: seconds per liveness probe of each other task.

    Returns:
      The `PeerFailureError` (not raised).
    """
    message = error.message or str(error)
    blamed = []

    def blame(task, why):
        task = re.sub(r"^/job:(\w+)/task:", r"/job:\1/replica:0/task:", task)
        if task != cluster.me:
            blamed.append((task, why))

    unhealthy = re.search(r"unhealthy \(stopped sending heartbeats\):\s*((?:" + _TASK + r"\s*)+)",
                          message)
    if unhealthy:
        for task in re.findall(_TASK, unhealthy.group(1)):
            blame(task, "stopped sending heartbeats to the coordination service")
    for task in re.findall(r"from remote target (" + _TASK + ")", message):
        blame(task, "failed an RPC from this task")
    if "CoordinationService/Heartbeat" in message:
        blame(cluster.chief, "hosts the coordination service, which stopped answering heartbeats")
    probes = {task: probe_task(cluster.addresses[task], probe_timeout)
              for task in cluster.tasks if task != cluster.me}
    for task, state in probes.items():
        if state != "answers":
            blame(task, _PROBE_WORDS.get(state, state))
    tasks = list(dict.fromkeys(task for task, _ in blamed))
    lines = [f"{cluster.describe(task)}: " + "; ".join(why for t, why in blamed if t == task)
             for task in tasks]
    first_line = next((line for line in message.splitlines() if "aborted by" in line),
                      message.splitlines()[0] if message else "")
    first_line = re.sub(r"\{\{[^}]*\}\}\s*", "", first_line)  # the op's own device
    headline = (f"Training on {cluster.me} stopped because "
                + (f"{'a peer' if len(tasks) == 1 else 'peers'} failed:\n  " + "\n  ".join(lines)
                   if tasks else "of a failure the runtime could not attribute to a task (every "
                   "other task still answers)"))
    return PeerFailureError(
        f"{headline}\nRuntime error ({type(error).__name__}): {first_line.strip()}\n"
        f"What to do: read the log of the task named above (an earlier error, an out-of-memory "
        f"kill or the scheduler's preemption); then relaunch every worker with the same command, "
        f"which resumes from the last backup in backup_dir.", tasks)


@contextlib.contextmanager
def peer_failures_explained(strategy=None, probe_timeout=2.0):
    """Turns collective errors caused by another worker into a `PeerFailureError` that names it.

    Around `model.fit` (or any training loop) under `MultiWorkerMirroredStrategy`. The runtime
    reports a dead or frozen peer as an `UnavailableError`, `DeadlineExceededError`, `AbortedError`
    or `InternalError` that often names no task, or only this one; this names the failed task(s)
    from what the message says and from a liveness probe of every other task, keeping the original
    as `__cause__`. Other errors, and every error of a single-process strategy, pass through
    unchanged.

    Args:
      strategy: the strategy training runs under; default: the current one.
      probe_timeout: seconds per liveness probe of each other task.

    Raises:
      PeerFailureError: training failed because of another task.
    """
    try:
        yield
    except _PEER_ERRORS as e:
        cluster = _Cluster.of(strategy or tf.distribute.get_strategy())
        message = e.message or ""
        if cluster is None or not any(marker in message for marker in _PEER_MARKERS):
            raise
        raise explain_peer_failure(e, cluster, probe_timeout) from e


__all__ = ["PREEMPTED_EXIT_CODE", "Backup", "BackupAndRestore", "DamagedBackupError",
           "PeerFailureError", "explain_peer_failure", "latest_backup", "peer_failures_explained",
           "probe_task", "read_backup"]
