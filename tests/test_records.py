"""`data.inputs`: a folder of records, of images or a TFDS name -> the run's inputs, counts and
exact evaluation, or the fix."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import tpu_scale.distribute.strategy
from tpu_scale import data


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("synthetic"))
    made = data.make_synthetic_imagenet(
        folder, num_classes=10, train_examples=96, validation_examples=37, image_shape=(16, 16)
    )
    return folder, made


def test_a_label_map_gives_classes_counts_and_labels(synthetic):
    folder, made = synthetic
    config = data.InputConfig(deterministic=True)
    inputs = data.inputs(folder, image_size=16, global_batch_size=32, config=config)
    assert (inputs.num_classes, inputs.train_examples, inputs.validation_examples) == (10, 96, 37)
    assert inputs.label_map.counts == {"train": 96, "validation": 37}
    assert inputs.steps_per_epoch() == 3 and inputs.steps_per_epoch(64) == 1
    assert inputs.train.is_training and not inputs.validation.is_training
    assert inputs.train.config == inputs.validation.config == config.replace(seed=0)
    labels = [int(y) for _, y in inputs.validation.dataset().unbatch()]
    assert len(labels) == 37 and set(labels) <= set(range(10))
    images, _ = next(iter(inputs.train.dataset()))
    assert images.shape == (32, 16, 16, 3)


def test_the_evaluation_counts_every_validation_example_once(synthetic, cpu_devices):
    folder, _ = synthetic
    strategy = tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices[:2])
    inputs = data.inputs(folder, image_size=16, global_batch_size=8, strategy=strategy)
    evaluation = inputs.exact_evaluation
    assert evaluation is inputs.exact_evaluation  # built once
    # 37 examples in per-replica batches of 4: 10 batches over 2 replicas, 5 steps.
    assert evaluation.steps == 5 and evaluation.cached  # a small set is kept in memory
    weights = []
    iterator = iter(evaluation.dataset)
    for _ in range(evaluation.steps):
        batch = next(iterator)
        weights += [w.numpy() for w in strategy.experimental_local_results(batch[2])]
    assert np.concatenate(weights).sum() == 37
    uncached = inputs.with_config(data.InputConfig(cache_validation=False))
    assert not uncached.exact_evaluation.cached and uncached.train_examples == 96


def test_a_configuration_reaches_both_inputs_without_reading_again(synthetic, monkeypatch):
    folder, _ = synthetic
    plain = data.inputs(folder, image_size=16, global_batch_size=32, dtype="uint8")
    assert plain.train.config.random_flip
    # Added once the counts are known (as a recipe's augmentation is): the same data, not read
    # again, counts kept.
    monkeypatch.setattr(data.records, "read_label_map", None)
    augmentation = dict(crop_area_range=None, random_flip=False, center_crop_fraction=1.0)
    added = plain.with_config(plain.config.replace(**augmentation))
    assert (added.train_examples, added.validation_examples) == (96, 37)
    for pipeline in (added.train, added.validation):
        assert pipeline.dtype == tf.uint8
        assert pipeline.config == data.InputConfig(**augmentation)
    assert plain.train.config.random_flip  # the first is unchanged


def test_shards_without_a_label_map_need_the_classes_and_are_counted(synthetic, tmp_path):
    folder, _ = synthetic
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(folder):
        if name.startswith(("train-", "validation-")):
            shutil.copy(os.path.join(folder, name), bare / name)
    with pytest.raises(ValueError, match="number of classes is unknown.*or pass num_classes"):
        data.inputs(str(bare), image_size=16, global_batch_size=32)
    inputs = data.inputs(
        str(bare), image_size=16, global_batch_size=32, num_classes=10, label_offset=0
    )
    assert (inputs.train_examples, inputs.validation_examples) == (96, 37)
    assert inputs.label_map is None and inputs.train.label_offset == 0


def test_a_tfds_name_gives_its_splits_and_classes():
    tfds = pytest.importorskip("tensorflow_datasets")
    # Mocked data have no split sizes: the counts are given.
    counts = dict(train_examples=6, validation_examples=6)
    with tfds.testing.mock_data(num_examples=6):
        inputs = data.inputs("tfds:imagenet2012", image_size=16, global_batch_size=4, **counts)
        assert inputs.num_classes == 1000 and inputs.train.label_offset == 0
        assert inputs.train.source.description == "tfds:imagenet2012/train"
        images, labels = next(iter(inputs.validation.dataset()))
    assert images.shape == (4, 16, 16, 3) and labels.dtype == tf.int32


def test_mistakes_name_the_fix(synthetic, tmp_path, monkeypatch):
    folder, _ = synthetic
    common = dict(image_size=16, global_batch_size=32)
    with pytest.raises(ValueError, match="the label map .* lists 10 classes"):
        data.inputs(folder, num_classes=5, **common)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=f"data folder {tmp_path}/missing does not exist"):
        data.inputs("~/missing", **common)
    images = tmp_path / "photos"
    (images / "cat").mkdir(parents=True)
    (images / "cat" / "a.JPG").write_bytes(b"")
    # A folder of images is converted, and the conversion says what is wrong with it.
    with pytest.raises(ValueError, match="classifier needs two|no usable image|one class"):
        data.inputs(str(images), records_dir=str(tmp_path / "records"), **common)


def test_records_without_a_validation_split_name_the_command_that_makes_one(tmp_path):
    from tpu_scale.testing.digits import write_digits_folder

    write_digits_folder(str(tmp_path / "digits"))
    data.write_tfrecords(str(tmp_path / "digits"), str(tmp_path / "records"), validation_fraction=0)
    with pytest.raises(ValueError, match="hold no validation split.*convert --image_dir"):
        data.inputs(str(tmp_path / "records"), image_size=16, global_batch_size=32)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("", "Expecting value"),
        ('{"label_offset": 0, "classes": [{"id": 0, "name": "a"}], "examples": {"train": "lots"}}',
         "invalid literal for int()"),
        ('{"label_offset": 0, "classes": [{"id": 0, "name": "a"}], "examples": [3]}', "items"),
        ('{"label_offset": 0, "classes": [{"id": 1, "name": "a"}]}', "class ids [1]"),
    ],
)
def test_a_damaged_label_map_is_named_with_the_fix(tmp_path, content, problem):
    from tpu_scale.data.schema import LABEL_MAP_FILE, read_label_map

    (tmp_path / LABEL_MAP_FILE).write_text(content)
    with pytest.raises(ValueError) as raised:
        read_label_map(str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path / LABEL_MAP_FILE) in message and problem in message
    assert "python -m tpu_scale.data.convert" in message


def test_the_label_map_is_written_whole(tmp_path, monkeypatch):
    import os

    from tpu_scale.data.schema import read_label_map, write_label_map

    write_label_map(str(tmp_path), ["a", "b"], 0, {"train": 2})

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_label_map(str(tmp_path), ["a", "b", "c"], 0, {"train": 3})
    assert read_label_map(str(tmp_path)).class_names == ("a", "b")  # the old map, whole


def test_the_old_words_for_validation_name_the_new_ones(synthetic, tmp_path):
    folder, _ = synthetic
    inputs = data.inputs(folder, image_size=16, global_batch_size=8)
    with pytest.raises(AttributeError, match=r"Inputs\.exact_evaluation"):
        inputs.evaluation
    with pytest.raises(TypeError, match="eval_examples is now validation_examples"):
        data.inputs(folder, image_size=16, global_batch_size=8, eval_examples=5)
    with pytest.raises(TypeError, match=r"InputConfig\(cache_validation=\.\.\.\)"):
        data.inputs(folder, image_size=16, global_batch_size=8, cache_evaluation=False)
    with pytest.raises(TypeError, match="cache_evaluation is now cache_validation"):
        data.InputConfig(cache_evaluation=False)
    with pytest.raises(TypeError, match="eval_examples is now validation_examples"):
        data.make_synthetic_imagenet(str(tmp_path), eval_examples=5)
