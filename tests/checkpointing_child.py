"""A tiny training run for tests/test_checkpointing.py, started as a process and killed there.

    python tests/checkpointing_child.py '{"backup_dir": ..., "out": ..., "epochs": 8, ...}'

Trains a two-layer model on fixed random data (no shuffling, fixed seeds: every run computes the
same weights) with `tpu_scale.checkpointing.BackupAndRestore`, inside `peer_failures_explained`.
Under `TF_CONFIG` it is one worker of a `MultiWorkerMirroredStrategy`; otherwise a
`MirroredStrategy` over 2 CPUs.

Prints, flushed, for the test to act on: `resumed <epoch> <step>` once restored, `step <epoch>
<step>` after each train step, `saved <epoch>` after each end-of-epoch backup, `sharded slots
<names>` and `done` at the end.
Writes the final weights to `out` (a .npz). Options: `slow_save` (seconds each `save_weights`
sleeps after writing, so a kill lands inside a backup write), `step_sleep` (seconds per train
step), `backup_dirs` (one backup_dir per worker, to play a filesystem the workers do not share),
`global_batch` (default 16), `weight_update_sharding` (shard SGD's update and momentum over every
replica, across the workers too).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(options):
    import numpy as np

    import tpu_scale

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ.get("TPU_SCALE_CPUS_PER_WORKER", 2)),
        gradient_reduction="native",
    )
    import keras
    import tensorflow as tf

    from tpu_scale import checkpointing

    if options.get("slow_save"):
        save_weights = keras.Model.save_weights

        def slow_save_weights(self, filepath, *args, **kwargs):
            save_weights(self, filepath, *args, **kwargs)
            print("wrote", filepath, flush=True)
            time.sleep(options["slow_save"])

        keras.Model.save_weights = slow_save_weights

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    backup_dir = options["backup_dir"]
    if options.get("backup_dirs"):
        backup_dir = options["backup_dirs"][json.loads(os.environ["TF_CONFIG"])["task"]["index"]]
    steps = options.get("steps", 4)
    # One endless stream of batches: a resumed run continues it where the backup's epoch began (as
    # examples/train_imagenet.py does); the callback drops the batches of a part-done epoch itself.
    resume = checkpointing.latest_backup(backup_dir)
    steps_done = resume.epoch * steps if resume else 0

    def dataset_fn(context):
        # Every input pipeline reads the same stream; a step takes a batch per replica it feeds.
        replicas_fed = context.num_replicas_in_sync // context.num_input_pipelines
        per_replica = context.get_per_replica_batch_size(options.get("global_batch", 16))
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .repeat()
            .batch(per_replica)
            .skip(steps_done * replicas_fed)
        )

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
        )
        optimizer = keras.optimizers.SGD(0.02, momentum=0.9)
        if options.get("weight_update_sharding"):
            optimizer = tpu_scale.DistributedOptimizer(optimizer, weight_update_sharding=True)
        model.compile(optimizer=optimizer, loss="mse")

    backup = checkpointing.BackupAndRestore(backup_dir, delete_checkpoint=False)

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            restored = backup.restored
            print(
                "resumed",
                restored.epoch if restored else 0,
                restored.step if restored else 0,
                flush=True,
            )

        def on_train_batch_end(self, batch, logs=None):
            print("step", self._epoch, batch + 1, flush=True)
            if options.get("step_sleep"):
                time.sleep(options["step_sleep"])

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            print("saved", epoch + 1, flush=True)

    with checkpointing.peer_failures_explained(strategy):
        model.fit(
            dataset,
            epochs=options["epochs"],
            steps_per_epoch=steps,
            callbacks=[backup, Report()],
            verbose=0,
            shuffle=False,
        )
    if options.get("out"):
        np.savez(options["out"], *[w.numpy() for w in model.weights])
    from tpu_scale.torus import weight_update
    print("sharded slots", *sorted(weight_update.slot_shards(model.optimizer)), flush=True)
    print("done", flush=True)
    return [w.numpy() for w in model.weights]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(json.loads(sys.argv[1]))
