"""A user's own `fit` script on the public API: `data.inputs` and its exact evaluation,
`run_callbacks`. Killed after its first epoch and run again, it ends on the weights of the run that
was not killed, and its evaluation counts every validation example once."""

import json
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_scale
from tpu_scale import checkpointing, data, models, training

EPOCHS, BATCH, SIZE = 2, 32, 16


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("records"))
    # 37 validation examples in per-replica batches of 16: the last step gives one replica 5
    # examples and the other an empty batch.
    data.make_synthetic_imagenet(
        folder, num_classes=10, train_examples=128, validation_examples=37, image_shape=(SIZE, SIZE)
    )
    return folder


@pytest.fixture(scope="module")
def strategy():
    return tpu_scale.create_strategy(num_cpu_replicas=2, mesh_shape=(1, 2))


class Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise KeyboardInterrupt("preempted")


def user_script(records, strategy, model_dir, settings, extra_callbacks=()):
    """What a user writes: inputs, exact evaluation, model, the run's callbacks, `fit`."""
    keras.utils.set_random_seed(3)
    inputs = data.inputs(
        records,
        image_size=SIZE,
        global_batch_size=BATCH,
        strategy=strategy,
        config=data.InputConfig(deterministic=True, seed=3),
    )
    steps = inputs.steps_per_epoch()
    validation = inputs.exact_evaluation
    training.record_settings(model_dir, settings, strategy)
    top_1 = keras.metrics.SparseCategoricalAccuracy(name="top_1")
    with strategy.scope():
        model = models.small_resnet(inputs.num_classes, input_shape=(SIZE, SIZE, 3))
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[top_1],
        )
    logger = training.EpochLogger(BATCH, strategy.num_replicas_in_sync, EPOCHS)
    callbacks = training.run_callbacks(model_dir, strategy, keep_checkpoints=1)
    model.fit(
        training.train_dataset(strategy, inputs.train, model_dir, steps),
        epochs=EPOCHS,
        steps_per_epoch=steps,
        validation_data=validation.dataset,
        validation_steps=validation.steps,
        callbacks=callbacks + [logger, *extra_callbacks],
        verbose=0,
    )
    return model, validation, inputs, logger, top_1


def test_a_fit_script_resumes_to_the_same_weights_and_evaluates_every_example_once(
    records, strategy, tmp_path, caplog
):
    straight_dir = str(tmp_path / "straight")
    model, validation, inputs, logger, top_1 = user_script(
        records, strategy, straight_dir, {"image_size": SIZE}
    )
    assert logger.images_per_second > 0
    results = model.evaluate(
        validation.dataset, steps=validation.steps, return_dict=True, verbose=0
    )
    # The metric counted each of the 37 examples once (its count is the sum of the weights).
    assert float(top_1.count.numpy()) == 37
    correct = 0
    for images, labels in inputs.validation.dataset():
        correct += int((np.argmax(model(images, training=False), -1) == labels.numpy()).sum())
    assert round(results["top_1"] * 37) == pytest.approx(results["top_1"] * 37, abs=1e-4)
    assert abs(round(results["top_1"] * 37) - correct) <= 1  # a near-tie may round either way
    assert len(os.listdir(os.path.join(straight_dir, training.CHECKPOINTS_DIR))) == 1
    assert os.listdir(os.path.join(straight_dir, training.LOGS_DIR))

    resumed_dir = str(tmp_path / "resumed")
    with pytest.raises(KeyboardInterrupt):
        user_script(records, strategy, resumed_dir, {"image_size": SIZE}, [Interrupt()])
    assert training.resuming_from(resumed_dir, EPOCHS).epoch == 1
    with caplog.at_level("WARNING"):
        resumed, *_ = user_script(records, strategy, resumed_dir, {"image_size": SIZE + 1})
    assert "started with other settings: --image_size 16 -> 17." in caplog.text
    for a, b in zip(model.weights, resumed.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)

    outputs = training.save_run(resumed_dir, resumed, {"epochs": EPOCHS, "top_1": 0.5}, strategy)
    assert os.path.exists(outputs["final model"])
    with open(outputs["settings it started with"]) as f:
        assert json.load(f) == {"image_size": SIZE}
    assert training.finished_run(resumed_dir, EPOCHS)["top_1"] == 0.5
    assert training.finished_run(resumed_dir, EPOCHS + 1) is None


def test_a_short_run_gets_the_epochs_that_would_make_it_long_enough():
    assert training.short_run_hint(2, 30) == (
        "30 epochs of 2 steps are only 60 steps: a small dataset learns more with more epochs "
        "(--epochs 150) or a smaller --global_batch_size."
    )
    assert training.short_run_hint(7, 10, few_steps=70) == ""
    assert training.short_run_hint(7, 10, few_steps=71).startswith("10 epochs of 7 steps")


def test_the_callbacks_keep_moving_statistics_first_and_the_guard_given():
    guard = tpu_scale.callbacks.LossGuard()
    strategy = tf.distribute.get_strategy()
    callbacks = training.run_callbacks("/tmp/unused", strategy, loss_guard=guard, tensorboard=False)
    kinds = [type(c).__name__ for c in callbacks]
    assert kinds[:3] == ["AverageMovingStatistics", "LossGuard", "BackupAndRestore"]
    assert callbacks[1] is guard and "ModelCheckpoint" in kinds and "TensorBoard" not in kinds
    assert "LossGuard" not in [
        type(c).__name__ for c in training.run_callbacks("/tmp/unused", strategy, loss_guard=None)
    ]


@pytest.mark.parametrize(
    "jobs,task,chief",
    [
        ({"worker": ["a:1", "b:1"]}, ("worker", 0), True),
        ({"worker": ["a:1", "b:1"]}, ("worker", 1), False),
        ({"chief": ["c:1"], "worker": ["a:1"]}, ("worker", 0), False),
        ({"chief": ["c:1"], "worker": ["a:1"]}, ("chief", 0), True),
        ({}, (None, None), True),
    ],
)
def test_the_chief_is_the_chief_task_else_worker_0(jobs, task, chief):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(jobs), task_type=task[0], task_id=task[1]
    )
    assert checkpointing.is_chief(types.SimpleNamespace(cluster_resolver=resolver)) is chief


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_the_epoch_logger_counts_every_timed_image(steps_per_execution):
    """The rate's images are the steps after the first execution, whatever `steps_per_execution`
    (Keras then reports once per execution): 12 steps of 8 images in executions of 4 time 8
    steps, not 2."""
    x = np.random.default_rng(0).normal(size=(96, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=steps_per_execution)
    logger = training.EpochLogger(8, 1, 2)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[logger], verbose=0)
    assert logger.images == 2 * (12 - steps_per_execution) * 8
    assert logger.images_per_second > 0


# --------------------------------------------------------------------------- the run's folder


def _finished_folder(tmp_path, record, final_model=True):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / training.RUN_FILE).write_text(
        record if isinstance(record, str) else json.dumps(record)
    )
    if final_model:
        (folder / training.FINAL_MODEL).write_bytes(b"PK")
    return str(folder)


@pytest.mark.parametrize(
    "record, final_model, problem",
    [
        ("", True, "not valid JSON (empty)"),
        ('{"epochs": 3, "top_1": 0.8', True, "not valid JSON"),
        ([1, 2], True, "holds a list, not a record"),
        ({"top_1": 0.9}, True, "'epochs' is None"),
        ({"epochs": "3"}, True, "'epochs' is '3'"),
        ({"epochs": 3, "top_1": 7}, True, "'top_1' is 7"),
        ({"epochs": 3, "top_1": 0.9, "images_per_second": -1}, True, "'images_per_second'"),
        # Planted: a finished run that never trained here.
        ({"epochs": 99, "top_1": 0.999, "images_per_second": 1e9}, False, "left no final.keras"),
    ],
)
def test_a_damaged_or_planted_run_record_names_the_file_and_the_fix(
    tmp_path, record, final_model, problem
):
    folder = _finished_folder(tmp_path, record, final_model)
    with pytest.raises(ValueError) as raised:
        training.finished_run(folder, 3)
    message = str(raised.value)
    assert problem in message and os.path.join(folder, training.RUN_FILE) in message
    assert "Move it aside" in message and "resume the run from its backups" in message


def test_a_record_save_run_wrote_is_read_back(tmp_path):
    folder = _finished_folder(tmp_path, {"epochs": 3, "top_1": 0.75, "images_per_second": None})
    assert training.finished_run(folder, 3)["top_1"] == 0.75
    assert training.finished_run(folder, 4) is None
    assert "finished run of 3 epochs (top-1 0.7500)" in training.finished_message(
        folder, training.finished_run(folder, 3)
    )


def test_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from tpu_scale import _files

    path = str(tmp_path / "run.json")
    _files.write_json(path, {"epochs": 1})

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _files.write_json(path, {"epochs": 2, "padding": "x" * 10000})
    assert _files.read_json(path) == {"epochs": 1}  # the old file, whole
    assert os.listdir(tmp_path) == ["run.json"]  # no partial file left behind


def test_a_damaged_settings_file_does_not_block_resuming(tmp_path, caplog, monkeypatch, strategy):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / training.SETTINGS_FILE).write_text("{trunc")
    # A run with a backup to resume from (what the backup holds is checkpointing's to test).
    monkeypatch.setattr(checkpointing, "latest_backup", lambda backup_dir: object())
    with caplog.at_level("WARNING"):
        assert training.record_settings(str(folder), {"image_size": 16}, strategy) == []
    assert "settings.json" in caplog.text and "not valid JSON" in caplog.text


_HOLD_THE_FOLDER = """
import sys, time
from tpu_scale import training
with training.folder_lock(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_one_run_at_a_time_per_folder(tmp_path):
    import subprocess
    import sys

    folder = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_FOLDER, folder], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(training.FolderBusy) as raised:
            with training.folder_lock(folder):
                pass
        message = str(raised.value)
        assert f"pid {holder.pid} on " in message and "another --model_dir" in message
    finally:
        holder.kill()
        holder.wait()
    # A killed holder leaves its file, not its lock: the next run takes the folder.
    assert os.path.exists(os.path.join(folder, training.LOCK_FILE))
    with training.folder_lock(folder):
        pass


def test_pruning_removes_only_the_runs_own_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("epoch_998.weights.h5", "epoch_999.weights.h5", "epoch_1000.weights.h5",
                 "a_user_notes.txt", "epoch_best.weights.h5"):
        (folder / name).write_text("x")
    training._KeepNewest(str(folder), 2).on_epoch_end(999)
    assert sorted(os.listdir(folder)) == [
        "a_user_notes.txt", "epoch_1000.weights.h5", "epoch_999.weights.h5", "epoch_best.weights.h5"
    ]
