"""`BackupAndRestore`: the Keras callback that saves, restores and acts on preemption notices."""

import itertools
import json
import logging
import os
import shutil
import sys
import tempfile

import keras
import tensorflow as tf

from tpu_scale import keras_hook
from tpu_scale._files import remove_tree
from tpu_scale.checkpointing.backups import (
    PREEMPTED_EXIT_CODE,
    WEIGHTS_FILE,
    DamagedBackupError,
    latest_backup,
    read_backup,
    write_backup,
)
from tpu_scale.checkpointing.preemption import (
    KEY_PREFIX,
    PreemptionCluster,
    PreemptionNotice,
    kv_get,
    kv_set,
)

logger = logging.getLogger(__name__)

_fit_counter = itertools.count()


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

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=True,
        delete_checkpoint=True,
        save_before_preemption=True,
        preemption_exit_code=PREEMPTED_EXIT_CODE,
        sync_timeout=300,
    ):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir, got an empty one.")
        batches = isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
        if not (save_freq == "epoch" or save_freq is False or batches):
            raise ValueError(f"save_freq={save_freq!r}: use 'epoch', a positive number of batches, or False (save only before preemption).")
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
            raise ValueError(f"BackupAndRestore needs a built model before fit(); {model.name} is not built. Build it first, e.g. with keras.Input in the model or model.build(input_shape).")
        self._cluster = PreemptionCluster.of(model.distribute_strategy)
        prefix = f"{KEY_PREFIX}/{next(_fit_counter)}"
        self._epoch, self._step, self._steps_done = 0, 0, 0
        self._batches_since_save = 0
        self._skip = 0
        keras_hook.set_initial_epoch(model, None)
        if self._cluster is None:
            backup = latest_backup(self.backup_dir)
            if backup is not None:
                self._load(backup)
        else:
            backup = self._restore_in_cluster(prefix)
        self.restored = backup
        if backup is not None:
            keras_hook.set_initial_epoch(model, backup.epoch)
            self._epoch, self._step = backup.epoch, backup.step
            if backup.step:
                self._skip_batches(backup.step)
            logger.info(
                "BackupAndRestore: resumed from %s (epoch %d, step %d).",
                backup.path,
                backup.epoch + 1,
                backup.step,
            )
        if self.save_before_preemption:
            self._notice = PreemptionNotice(self._cluster, prefix, self.sync_timeout)
            self._notice.start()

    def _load(self, backup):
        model = self.model
        try:
            with model.distribute_strategy.scope():
                if model.optimizer is not None and not model.optimizer.built:
                    model.optimizer.build(model.trainable_variables)
            model.load_weights(os.path.join(backup.path, WEIGHTS_FILE))
        except Exception as e:
            raise ValueError(f"Backup {backup.path} (epoch {backup.epoch + 1}, step {backup.step}) is complete but does not fit this model: {type(e).__name__}: {e}. The model or its optimizer changed since it was written (another model, number of classes or optimizer): train with the settings it was written with, write to another folder, or delete {self.backup_dir} to start over.") from e

    def _restore_in_cluster(self, prefix):
        """The chief picks the backup; every worker loads that one; all check the others did."""
        cluster = self._cluster
        choice_key = f"{prefix}/restore"
        if cluster.is_chief:
            backup = latest_backup(self.backup_dir)
            choice = (
                "none"
                if backup is None
                else json.dumps(
                    {
                        "name": os.path.basename(backup.path),
                        "epoch": backup.epoch,
                        "step": backup.step,
                        "sha256": backup.sha256,
                    }
                )
            )
            kv_set(choice_key, choice)
        else:
            choice = self._wait_for(
                choice_key,
                f"the chief {cluster.describe(cluster.chief)} to choose the backup to restore",
            )
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
        kv_set(f"{prefix}/restored/{cluster.me}", verdict)
        for task in cluster.tasks:
            other = (
                verdict
                if task == cluster.me
                else self._wait_for(
                    f"{prefix}/restored/{task}", f"{cluster.describe(task)} to restore its backup"
                )
            )
            if other != "ok":
                raise RuntimeError(
                    f"Resuming failed on {task}, so no worker starts training. {other}"
                ) from failure
        return backup

    def _find_chiefs_backup(self, chosen):
        path = os.path.join(self.backup_dir, chosen["name"])
        fix = (
            f"The chief restores {chosen['name']} (epoch {chosen['epoch'] + 1}, step "
            f"{chosen['step']}) from its backup_dir; every worker must read the same backup, so "
            f"backup_dir (model_dir) must be on a filesystem every worker reads, at the same "
            f"path (e.g. gs://... or an NFS mount)."
        )
        try:
            backup = read_backup(path)
        except DamagedBackupError as e:
            raise OSError(f"{self._cluster.me} cannot read {path}: {e}. {fix}") from e
        if backup.sha256 != chosen["sha256"]:
            raise OSError(
                f"{self._cluster.me} reads another {path} than the chief (different SHA-256). {fix}"
            )
        return backup

    def _wait_for(self, key, what):
        try:
            return kv_get(key, self.sync_timeout)
        except tf.errors.OpError as e:
            raise RuntimeError(f"{self._cluster.me} waited {self.sync_timeout} s for {what}, in vain ({type(e).__name__}: {(e.message or '').strip().splitlines()[:1]}). That worker is stopped, frozen or much slower; check its log, then relaunch every worker.") from e

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
            self.last_backup = write_backup(
                self.model, self.backup_dir, epoch, step, reason, self.keep
            )
            return self.last_backup
        # A private local folder made by the operating system (a name no other user can plant a
        # link at), removed after the save: no copy goes to a shared (possibly remote)
        # filesystem, and a killed save leaves only a folder of this user's in the temporary
        # folder.
        task = self._cluster.me.replace("/job:", "").replace("/replica:0/task:", "")
        private = tempfile.mkdtemp(prefix=f"tpu_scale_backup_{task}_")
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
        message = (
            f"Preempted (SIGTERM on {notice.origin}): saved the training state after epoch "
            f"{self._epoch + 1} step {self._step} to {where}. Exiting with code "
            f"{self.preemption_exit_code}; run the same command again to resume from there."
        )
        logger.warning(message)
        sys.exit(self.preemption_exit_code)

    def on_train_end(self, logs=None):
        if self._notice is not None:
            if self._notice.signalled:
                logger.warning(
                    "SIGTERM arrived as training ended; training is complete, so no "
                    "backup was saved for it."
                )
            self._notice.stop()
            self._notice = None
        keras_hook.set_initial_epoch(self.model, None)
        if self.delete_checkpoint and (self._cluster is None or self._cluster.is_chief):
            remove_tree(self.backup_dir, best_effort=True)
