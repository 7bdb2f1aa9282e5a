"""`data.records_inputs`: a folder of records -> the run's inputs and counts, or the fix."""

import os
import shutil

import pytest
import tensorflow as tf

from tpu_scale import data


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("synthetic"))
    made = data.make_synthetic_imagenet(
        folder, num_classes=10, train_examples=96, eval_examples=37, image_shape=(16, 16)
    )
    return folder, made


def test_a_label_map_gives_classes_counts_and_labels(synthetic):
    folder, made = synthetic
    inputs = data.records_inputs(folder, image_size=16, global_batch_size=32, deterministic=True)
    assert (inputs.num_classes, inputs.train_examples, inputs.validation_examples) == (10, 96, 37)
    assert inputs.steps_per_epoch() == 3 and inputs.steps_per_epoch(64) == 1
    assert inputs.train.is_training and not inputs.validation.is_training
    labels = [int(y) for _, y in inputs.validation.dataset().unbatch()]
    assert len(labels) == 37 and set(labels) <= set(range(10))
    images, _ = next(iter(inputs.train.dataset()))
    assert images.shape == (32, 16, 16, 3)


def test_input_arguments_reach_both_inputs(synthetic):
    folder, _ = synthetic
    augmentation = dict(crop_area_range=None, random_flip=False, center_crop_fraction=1.0)
    given = data.records_inputs(
        folder, image_size=16, global_batch_size=32, dtype="uint8", **augmentation
    )
    # Added once the counts are known (as a recipe's augmentation is): the same data, counts kept.
    plain = data.records_inputs(folder, image_size=16, global_batch_size=32, dtype="uint8")
    assert plain.train.config.random_flip
    added = plain.with_input_arguments(**augmentation)
    for inputs in (given, added):
        assert (inputs.train_examples, inputs.validation_examples) == (96, 37)
        for pipeline in (inputs.train, inputs.validation):
            assert pipeline.dtype == tf.uint8
            assert pipeline.config == data.InputConfig(**augmentation)


def test_shards_without_a_label_map_need_the_classes_and_are_counted(synthetic, tmp_path):
    folder, _ = synthetic
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(folder):
        if name.startswith(("train-", "validation-")):
            shutil.copy(os.path.join(folder, name), bare / name)
    with pytest.raises(ValueError, match="number of classes is unknown.*or pass num_classes"):
        data.records_inputs(str(bare), image_size=16, global_batch_size=32)
    inputs = data.records_inputs(
        str(bare), image_size=16, global_batch_size=32, num_classes=10, label_offset=0
    )
    assert (inputs.train_examples, inputs.validation_examples) == (96, 37)


def test_mistakes_name_the_fix(synthetic, tmp_path, monkeypatch):
    folder, _ = synthetic
    common = dict(image_size=16, global_batch_size=32)
    with pytest.raises(ValueError, match="exactly one"):
        data.records_inputs(folder, tfds_name="imagenet2012", **common)
    with pytest.raises(ValueError, match="the label map .* lists 10 classes"):
        data.records_inputs(folder, num_classes=5, **common)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=f"data_dir {tmp_path}/missing does not exist"):
        data.records_inputs("~/missing", **common)
    images = tmp_path / "photos"
    (images / "cat").mkdir(parents=True)
    (images / "cat" / "a.JPG").write_bytes(b"")
    with pytest.raises(ValueError, match="holds folders of images.*convert --image_dir"):
        data.records_inputs(str(images), **common)


def test_records_without_a_validation_split_name_the_command_that_makes_one(tmp_path):
    from tpu_scale.testing.digits import write_digits_folder

    write_digits_folder(str(tmp_path / "digits"))
    data.write_tfrecords(str(tmp_path / "digits"), str(tmp_path / "records"), validation_fraction=0)
    with pytest.raises(ValueError, match="hold no validation split.*convert --image_dir"):
        data.records_inputs(str(tmp_path / "records"), image_size=16, global_batch_size=32)
