"""The training example end to end: a tiny run, interrupted and resumed; a diverging run; bad flags.

The library it is built on has its own tests (test_records.py, test_evaluation.py,
test_training.py); these check what the script adds: its flags, its messages and its report.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import train_imagenet  # noqa: E402

from tpu_scale import training  # noqa: E402
from tpu_scale.distribute.mesh import parse_mesh_shape  # noqa: E402


def tiny_config(**overrides):
    # Two replicas, not the default run's eight: tracing the step for each replica is most of a
    # tiny run's time.
    settings = dict(
        num_cpu_replicas=2,
        mesh_shape="1x2",
        epochs=3,
        image_size=32,
        global_batch_size=64,
        synthetic_train_examples=512,
        synthetic_validation_examples=128,
        deterministic=True,
        seed=3,
    )
    settings.update(overrides)
    return train_imagenet.TrainConfig(**settings)


class Interrupt(keras.callbacks.Callback):
    """Stops the run after `epoch` epochs, as a preempted job would."""

    def __init__(self, after_epochs):
        super().__init__()
        self.after_epochs = after_epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.after_epochs:
            raise KeyboardInterrupt("preempted")


def test_a_run_resumes_names_what_changed_and_reports(tmp_path, caplog):
    model_dir = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        train_imagenet.train(
            tiny_config(epochs=2, model_dir=model_dir), extra_callbacks=[Interrupt(after_epochs=1)]
        )
    with open(os.path.join(model_dir, "settings.json")) as f:
        assert json.load(f)["image_size"] == 32
    with caplog.at_level("INFO"):
        summary = train_imagenet.train(tiny_config(epochs=2, image_size=24, model_dir=model_dir))
    assert "Resuming from the backup after epoch 1 of 2" in caplog.text
    assert "started with other settings: --image_size 32 -> 24." in caplog.text
    assert "--global_batch_size" not in caplog.text  # only what changed
    line = training.summary_line(summary)
    assert line.startswith("top-1 ") and "images/s" in line and "wall" in line
    assert summary["top_1"] > 0.2  # 10 learnable classes, chance 0.1
    assert f"final model: {model_dir}/final.keras" in training.outputs_lines(summary["outputs"])
    again = train_imagenet.train(tiny_config(epochs=2, model_dir=model_dir))
    assert again["finished_before"] and again["top_1"] == summary["top_1"]


def test_accumulating_gradients_resumes_after_a_kill_and_counts_updates(tmp_path, caplog):
    model_dir = str(tmp_path / "run")
    config = tiny_config(epochs=2, model_dir=model_dir, gradient_accumulation_steps=2)
    with pytest.raises(KeyboardInterrupt):
        train_imagenet.train(config, extra_callbacks=[Interrupt(after_epochs=1)])
    with caplog.at_level("INFO"):
        summary = train_imagenet.train(config)
    assert "Resuming from the backup after epoch 1 of 2" in caplog.text
    assert "8 steps of 64 images (effective batch 128)" in caplog.text
    # 512 examples at 64 a step: 8 fit steps an epoch, 4 updates; 2 epochs are 8 updates.
    assert int(summary["model"].optimizer.iterations.numpy()) == 8
    assert summary["top_1"] > 0.2  # 10 learnable classes, chance 0.1


def test_uint8_input_and_one_step_epochs_learn_and_report_a_rate(tmp_path):
    # A training set smaller than the global batch: one step per epoch.
    summary = train_imagenet.train(
        tiny_config(
            model_dir=str(tmp_path / "run"), input_dtype="uint8", synthetic_train_examples=48
        )
    )
    assert summary["images_per_second"] > 0
    assert "nan" not in training.summary_line(summary)
    with open(tmp_path / "run" / "run.json") as f:
        record = json.loads(f.read(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert record["images_per_second"] > 0 and record["wall_seconds"] > 0
    # The input pipeline's settings, the recipe's augmentation among them, read back.
    from tpu_scale import data

    input_config = data.InputConfig.from_dict(record["input_config"])
    assert input_config.seed == record["config"]["seed"] and input_config.random_flip is False
    # 5 validation images, a global batch of 64 on 2 replicas: one replica's batch holds them,
    # both are filled with zero-weight examples; the evaluation counts the 5.
    small = train_imagenet.train(tiny_config(epochs=1, synthetic_validation_examples=5))
    assert small["validation_examples"] == 5
    assert round(small["top_1"] * 5, 6) == round(small["top_1"] * 5)


def test_virtual_batches_are_asked_for_by_name(caplog):
    # One replica holding 256 examples, its batch norm over each run of 64 (ghost batch norm).
    config = tiny_config(
        num_cpu_replicas=1,
        mesh_shape=None,
        epochs=1,
        global_batch_size=256,
        deterministic=False,
        bn_virtual_batch_size=64,
    )
    with caplog.at_level("INFO"):
        summary = train_imagenet.train(config)
    assert "batch norm over 64 examples" in caplog.text
    norms = [
        layer
        for layer in summary["model"].layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    assert norms and all(layer.virtual_batch_size == 64 for layer in norms)
    assert np.isfinite(summary["top_1"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(global_batch_size=100),
            r"does not divide over 8 replicas; use a multiple of 8, e.g. 96",
        ),
        (dict(bn_group_size=3), r"group_size=3 does not divide the 8 replicas"),
        (dict(data_dir="/tmp", tfds_name="imagenet2012"), "one of --image_dir, --data_dir"),
        (dict(image_dir="/tmp", data_dir="/tmp"), "one of --image_dir, --data_dir"),
        (dict(image_dir="/tmp", tpu="my-tpu"), "convert them once.*--data_dir"),
        (dict(optimizer="adam"), "choose lars or sgd"),
        (dict(model="vgg"), "choose resnet50 or small_resnet"),
        (dict(mesh_shape="2by4"), "ROWSxCOLS"),
        (dict(input_dtype="float16"), "choose uint8 or float"),
        (dict(cache_validation="maybe"), "choose auto or yes or no"),
        (dict(num_cpu_replicas=0, mesh_shape=None), "--num_cpu_replicas=0: it must be at least 1"),
        (dict(gradient_accumulation_steps=0), "--gradient_accumulation_steps=0: it must be at"),
        (dict(ema_momentum=1.0), "--ema_momentum=1.0: give 0 .* below 1"),
        (dict(bn_virtual_batch_size=-1), "--bn_virtual_batch_size=-1: give 0 .* e.g. 64"),
        (
            dict(ema_momentum=0.9, gradient_accumulation_steps=2),
            "moving average .* with gradient_accumulation_steps",  # the recipe's own check
        ),
    ],
)
def test_bad_flags_fail_at_start(overrides, message):
    default_run = {"num_cpu_replicas": 8, "mesh_shape": "2x4"}
    with pytest.raises(ValueError, match=message):
        train_imagenet.train(tiny_config(**{**default_run, **overrides}))


@pytest.mark.parametrize(
    "replicas,flag,shape",
    [
        (8, None, (2, 4)),
        (2, None, (1, 2)),
        (12, None, (3, 4)),
        (7, None, (1, 7)),
        (8, "4x2", (4, 2)),
    ],
)
def test_the_mesh_is_the_flag_or_the_squarest(replicas, flag, shape):
    assert parse_mesh_shape(flag, replicas) == shape


def test_a_diverging_run_stops_and_names_the_flag(tmp_path):
    # The guard backs off 3 times within epoch 2 (4 steps), then stops at epoch 3's first step.
    with pytest.raises(train_imagenet.TrainingDiverged, match="--peak_learning_rate"):
        train_imagenet.train(
            tiny_config(
                model_dir=str(tmp_path),
                optimizer="sgd",
                peak_learning_rate=1e4,
                epochs=3,
                image_size=16,
                synthetic_train_examples=256,
            )
        )
    # Nothing it kept holds the blown-up weights.
    from tpu_scale import checkpointing

    backup = checkpointing.latest_backup(str(tmp_path / "backup"))
    if backup is not None:
        import h5py

        with h5py.File(os.path.join(backup.path, checkpointing.WEIGHTS_FILE)) as f:
            values = []
            f.visititems(lambda _, v: values.append(np.asarray(v)) if hasattr(v, "shape") else None)
        assert all(np.isfinite(v).all() for v in values if v.dtype.kind == "f")


def test_data_dir_mistakes_name_the_fix(tmp_path):
    images = tmp_path / "photos"
    (images / "cat").mkdir(parents=True)
    (images / "cat" / "a.JPG").write_bytes(b"")
    # A folder of images given as --data_dir is converted as --image_dir's is (data.inputs), and
    # the conversion says what is wrong with it.
    with pytest.raises(ValueError, match="one class folder only.*at least two classes"):
        train_imagenet.train(tiny_config(data_dir=str(images)))


@pytest.mark.parametrize(
    "old, new",
    [
        ("--eval_examples=5", "--validation_examples"),
        ("--cache_evaluation", "--cache_validation"),
        ("--synthetic_eval_examples=32", "--synthetic_validation_examples"),
    ],
)
def test_a_renamed_flag_names_its_new_spelling(old, new):
    with pytest.raises(SystemExit, match=f"is now {new}"):
        train_imagenet.check_renamed_flags(["train_imagenet.py", "--epochs=1", old])
    train_imagenet.check_renamed_flags(["train_imagenet.py", f"{new}=5"])
