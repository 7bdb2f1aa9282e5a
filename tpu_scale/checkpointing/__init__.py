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

`is_chief(strategy)` says whether this process is the one that writes a run's files.

    callback = checkpointing.BackupAndRestore(os.path.join(model_dir, "backup"))
    with checkpointing.peer_failures_explained(strategy):
        model.fit(dataset, epochs=90, steps_per_epoch=1251, callbacks=[callback])

Layout of `backup_dir` (written by the chief only):

    backup-000007/model.weights.h5   the weights, as `Model.save_weights` writes them
    backup-000007/backup.json        epoch, step, and each file's size and SHA-256; written last
    .tmp-backup-000008-<pid>/        a save in progress (or killed): never read, removed later
"""

from tpu_scale.checkpointing.backups import (
    METADATA_FILE,
    PREEMPTED_EXIT_CODE,
    WEIGHTS_FILE,
    Backup,
    BackupWriteError,
    DamagedBackupError,
    latest_backup,
    read_backup,
)
from tpu_scale.checkpointing.callback import BackupAndRestore
from tpu_scale.checkpointing.peers import (
    PeerFailureError,
    explain_peer_failure,
    peer_failures_explained,
    probe_task,
)
from tpu_scale.checkpointing.preemption import is_chief

__all__ = [
    "METADATA_FILE",
    "PREEMPTED_EXIT_CODE",
    "WEIGHTS_FILE",
    "Backup",
    "BackupAndRestore",
    "BackupWriteError",
    "DamagedBackupError",
    "PeerFailureError",
    "explain_peer_failure",
    "is_chief",
    "latest_backup",
    "peer_failures_explained",
    "probe_task",
    "read_backup",
]
