"""The training example end to end: a tiny run that an interrupted and resumed run matches, a
diverging run, and bad flags."""

import json
import os
import sys

import keras
import numpy as np
import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)

import train_imagenet  # noqa: E402


def tiny_config(**overrides):
    # Two replicas, not the default run's eight: tracing the step for each replica is most of a
    # tiny run's time (65 s a run on 8, 28 s on 2). The README test runs the defaults as written.
    settings = dict(
        num_cpu_replicas=2,
        mesh_shape="1x2",
        epochs=3,
        image_size=32,
        global_batch_size=64,
        synthetic_train_examples=512,
        synthetic_eval_examples=128,
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


def test_a_run_ends_where_an_interrupted_and_resumed_one_ends(tmp_path):
    reference = train_imagenet.train(tiny_config(model_dir=str(tmp_path / "straight")))
    line = train_imagenet.summary_line(reference)
    assert line.startswith("top-1 ") and "images/s" in line and "wall" in line
    # 10 learnable classes: three short epochs are already far above chance.
    assert reference["top_1"] > 0.3
    assert reference["images_per_second"] > 0
    straight = tmp_path / "straight"
    assert os.listdir(straight / "checkpoints") and os.listdir(straight / "logs")

    resumed_dir = str(tmp_path / "resumed")
    with pytest.raises(KeyboardInterrupt):
        train_imagenet.train(
            tiny_config(model_dir=resumed_dir), extra_callbacks=[Interrupt(after_epochs=2)]
        )
    resumed = train_imagenet.train(tiny_config(model_dir=resumed_dir))
    for a, b in zip(reference["model"].weights, resumed["model"].weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)
    assert resumed["top_1"] == pytest.approx(reference["top_1"], abs=1e-6)


def test_uint8_input_normalized_in_the_model_learns(tmp_path):
    summary = train_imagenet.train(tiny_config(model_dir=str(tmp_path), input_dtype="uint8"))
    assert summary["top_1"] > 0.3


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(global_batch_size=100),
            r"does not divide over 8 replicas; use a multiple of 8, e.g. 96",
        ),
        (dict(bn_group_size=3), r"group_size=3 does not divide the 8 replicas"),
        (dict(data_dir="/tmp", tfds_name="imagenet2012"), "not both"),
        (dict(model="vgg"), "choose resnet50 or small_resnet"),
        (dict(mesh_shape="2by4"), "ROWSxCOLS"),
        (dict(input_dtype="float16"), "choose uint8 or float"),
        (dict(num_cpu_replicas=0, mesh_shape=None), "num_cpu_replicas must be at least 1"),
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
    config = train_imagenet.TrainConfig(num_cpu_replicas=replicas, mesh_shape=flag)
    assert train_imagenet._mesh_shape(config) == shape


def test_evaluation_passes_see_every_example_once(strategy, tmp_path):
    from tpu_scale import data

    made = data.make_synthetic_imagenet(
        str(tmp_path), num_classes=10, train_examples=80, eval_examples=179, image_shape=(16, 16)
    )
    eval_input = data.ImageNetInput(
        made["validation"], is_training=False, global_batch_size=128, image_size=16
    )
    steps = train_imagenet.eval_steps(179, 128, 8, 1)
    assert steps == 2
    dataset = strategy.distribute_datasets_from_function(
        train_imagenet.eval_dataset_fn(eval_input, steps)
    )
    iterator = iter(dataset)
    expected = sorted(int(y) for _, y in eval_input.dataset().unbatch())
    for _ in range(3):  # three evaluations from one iterator, as Keras's fit runs them
        labels = []
        for _ in range(steps):
            _, y = next(iterator)
            labels.extend(int(v) for r in strategy.experimental_local_results(y) for v in r.numpy())
        assert sorted(labels) == expected and len(labels) == 179


def test_a_diverging_run_stops_and_names_the_flag(tmp_path):
    with pytest.raises(train_imagenet.TrainingDiverged, match="--peak_learning_rate"):
        train_imagenet.train(
            tiny_config(
                model_dir=str(tmp_path),
                optimizer="sgd",
                peak_learning_rate=1e4,
                epochs=2,
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


def test_the_recipe_decides_the_optimizer_unless_a_flag_does():
    small = train_imagenet._recipe(tiny_config(global_batch_size=64))
    large = train_imagenet._recipe(tiny_config(global_batch_size=1024))
    assert (small.optimizer, large.optimizer) == ("sgd", "lars")
    forced = train_imagenet._recipe(tiny_config(global_batch_size=1024, optimizer="sgd"))
    assert forced.optimizer == "sgd" and forced.peak_learning_rate == pytest.approx(0.8)
    given = train_imagenet._recipe(tiny_config(global_batch_size=64, peak_learning_rate=0.05))
    assert given.peak_learning_rate == 0.05 and given.optimizer == "sgd"


def test_data_dir_mistakes_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=f"--data_dir {tmp_path}/missing does not exist"):
        train_imagenet.train(tiny_config(data_dir="~/missing"))  # `--data_dir=~/x` is not expanded
    images = tmp_path / "photos"
    (images / "cat").mkdir(parents=True)
    (images / "cat" / "a.JPG").write_bytes(b"")
    with pytest.raises(ValueError, match="holds folders of images.*write_tfrecords --image_dir"):
        train_imagenet.train(tiny_config(data_dir=str(images)))


def test_one_step_epochs_report_a_rate_and_a_valid_run_record(tmp_path):
    # A training set smaller than the global batch: one step per epoch.
    summary = train_imagenet.train(
        tiny_config(synthetic_train_examples=48, epochs=3, model_dir=str(tmp_path / "run"))
    )
    assert summary["images_per_second"] > 0
    assert "nan" not in train_imagenet.summary_line(summary)
    with open(tmp_path / "run" / train_imagenet.RUN_FILE) as f:
        record = json.loads(f.read(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert record["images_per_second"] > 0 and record["wall_seconds"] > 0


def test_resuming_with_other_settings_names_them(tmp_path, caplog):
    model_dir = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        train_imagenet.train(
            tiny_config(epochs=2, model_dir=model_dir), extra_callbacks=[Interrupt(after_epochs=1)]
        )
    with open(os.path.join(model_dir, train_imagenet.SETTINGS_FILE)) as f:
        assert json.load(f)["image_size"] == 32
    with caplog.at_level("WARNING"):
        train_imagenet.train(tiny_config(epochs=2, image_size=24, model_dir=model_dir))
    assert "started with other settings: --image_size 32 -> 24." in caplog.text
    assert "--global_batch_size" not in caplog.text  # only what changed


def test_a_validation_set_smaller_than_the_batch_is_evaluated_example_by_example():
    # 5 validation images, a global batch of 64 on 2 replicas: one replica gets them all, the other
    # an empty batch (a newcomer's small folder crashed here: keras-team/keras#19246 and oneDNN's
    # empty-batch convolutions, see tpu_scale/_workarounds.py).
    summary = train_imagenet.train(tiny_config(epochs=1, synthetic_eval_examples=5))
    assert summary["eval_examples"] == 5
    assert round(summary["top_1"] * 5, 6) == round(summary["top_1"] * 5)  # a count of 5 examples


def test_records_without_a_validation_split_name_the_command_that_makes_one(tmp_path):
    from tpu_scale.data import write_tfrecords
    from tpu_scale.testing.digits import write_digits_folder

    write_digits_folder(str(tmp_path / "digits"))
    write_tfrecords(str(tmp_path / "digits"), str(tmp_path / "records"), validation_fraction=0)
    with pytest.raises(ValueError, match="hold no validation split.*write_tfrecords --image_dir"):
        train_imagenet.train(tiny_config(data_dir=str(tmp_path / "records")))
