"""Backups on disk: written whole or not at all, read back with their checksums checked."""

import dataclasses
import gc
import hashlib
import json
import logging
import os
import re
import time

import tensorflow as tf

from tpu_scale._files import is_local, remove_tree

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 143
"""Exit code after a preemption backup: 128 + SIGTERM, what a shell reports for a job ended by
SIGTERM and what TensorFlow's `PreemptionCheckpointHandler` uses on Google Cloud. A process killed
by the signal itself shows as -15 to `subprocess`, so the two stay distinguishable there."""

WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "backup.json"
_FORMAT = 1
_NAME = re.compile(r"^backup-(\d{6,})$")
_TEMP_PREFIX = ".tmp-backup-"


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
        backup = Backup(
            path=path,
            epoch=int(metadata["epoch"]),
            step=int(metadata["step"]),
            sequence=int(metadata["sequence"]),
            reason=str(metadata["reason"]),
            sha256=str(record["sha256"]),
        )
    except (OSError, tf.errors.OpError, ValueError, KeyError, TypeError) as e:
        raise DamagedBackupError(f"its metadata {metadata_path} is unreadable ({e})") from e
    weights_path = os.path.join(path, WEIGHTS_FILE)
    try:
        size = tf.io.gfile.stat(weights_path).length
        if size != record["size"]:
            raise DamagedBackupError(
                f"{weights_path} holds {size} bytes, {record['size']} were written (truncated)"
            )
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
            outcome = (
                f"restoring the previous backup {chosen.path} instead (epoch "
                f"{chosen.epoch + 1}, step {chosen.step})"
            )
        else:
            outcome = "no complete backup is left, so training starts over from epoch 0"
        logger.warning(
            "Backup %s is damaged: %s; %s. Delete it once you have looked at it.",
            path,
            reason,
            outcome,
        )
    return chosen


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class BackupWriteError(OSError):
    """A backup could not be written (a full disk, a lost mount); the last good one is intact."""


def write_backup(model, backup_dir, epoch, step, reason, keep):
    """Saves `model` as a new backup and removes all but the newest `keep`; returns the `Backup`.

    Raises:
      BackupWriteError: the save failed (e.g. the disk is full). The partial save is removed, and
        the message names the folder, the space a backup takes and the last good backup, which a
        run of the same command resumes from.
    """
    tf.io.gfile.makedirs(backup_dir)
    existing = _sequences(backup_dir)
    sequence = existing[0][0] + 1 if existing else 1
    temp = os.path.join(backup_dir, f"{_TEMP_PREFIX}{sequence:06d}-{os.getpid()}")
    try:
        return _write(model, backup_dir, temp, sequence, epoch, step, reason, keep)
    except (OSError, tf.errors.OpError) as e:
        failure = _write_failure(model, backup_dir, e)
    # Out of the handler, the failed write's frames are gone, and with them the half-written HDF5
    # file Keras leaves open: collected now, it is closed here, not at interpreter exit.
    gc.collect()
    remove_tree(temp, best_effort=True)
    raise BackupWriteError(failure)


def _write_failure(model, backup_dir, error):
    """What a failed backup says: the folder, the space one takes, the last good backup."""
    need = sum(int(v.numpy().nbytes) for v in model.weights)
    optimizer = getattr(model, "optimizer", None)
    need += sum(int(v.numpy().nbytes) for v in getattr(optimizer, "variables", ()) or ())
    reason, free, last = write_failure_facts(backup_dir, backup_dir, error)
    if last is None:
        resume = "There is no earlier backup: the run starts from the beginning when run again."
    else:
        resume = f"The last good backup, {last.path} (epoch {last.epoch}, step {last.step}), is intact: run the same command again to resume from it."
    return f"Could not write a backup to {backup_dir!r} ({reason}); a backup of this model takes about {need / 1e6:.1f} MB{free}. Free space there (or pass another --model_dir). {resume}"


def write_failure_facts(folder, backup_dir, error):
    """What a failed write into `folder` tells the user: `(reason, free, last)`, the error's one-line
    reason, `", and N MB is free there"` (empty where the folder is not local), and the newest
    complete backup in `backup_dir` (None if there is none)."""
    import shutil

    reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
    free = ""
    if is_local(folder):
        free = f", and {shutil.disk_usage(folder).free / 1e6:.1f} MB is free there"
    return reason, free, latest_backup(backup_dir)


def _write(model, backup_dir, temp, sequence, epoch, step, reason, keep):
    name = f"backup-{sequence:06d}"
    remove_tree(temp, best_effort=True)
    tf.io.gfile.makedirs(temp)
    weights_path = os.path.join(temp, WEIGHTS_FILE)
    model.save_weights(weights_path)
    digest = _sha256(weights_path)
    metadata = {
        "format": _FORMAT,
        "epoch": epoch,
        "step": step,
        "sequence": sequence,
        "reason": reason,
        "saved_at": time.time(),
        "files": {WEIGHTS_FILE: {"size": tf.io.gfile.stat(weights_path).length, "sha256": digest}},
    }
    metadata_path = os.path.join(temp, METADATA_FILE)
    with tf.io.gfile.GFile(metadata_path, "w") as f:
        f.write(json.dumps(metadata, indent=1))
    final = os.path.join(backup_dir, name)
    if is_local(backup_dir):
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
    return Backup(
        path=final, epoch=epoch, step=step, sequence=sequence, reason=reason, sha256=digest
    )


def _prune(backup_dir, keep):
    """Removes interrupted saves and every backup older than the newest `keep` complete ones."""
    for name in tf.io.gfile.listdir(backup_dir):
        if name.startswith(_TEMP_PREFIX):
            remove_tree(os.path.join(backup_dir, name.rstrip("/")), best_effort=True)
    complete = 0
    for _, path in _sequences(backup_dir):
        if complete >= keep:
            remove_tree(path, best_effort=True)
            continue
        try:
            read_backup(path)
            complete += 1
        except DamagedBackupError:
            pass  # kept until enough newer complete backups exist: it is evidence
