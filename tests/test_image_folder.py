"""The writer's listing of a folder of class folders: nested folders searched, hidden ones not."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tpu_scale.data import image_folder, read_label_map, write_tfrecords


def _touch(root, *parts):
    path = os.path.join(root, *parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"")
    return path


def test_images_in_nested_folders_belong_to_their_class(tmp_path):
    root = str(tmp_path)
    expected = [
        _touch(root, "cat", "2019", "a.jpg"),
        _touch(root, "cat", "2019", "march", "b.PNG"),
        _touch(root, "cat", "c.jpeg"),
    ]
    dog = _touch(root, "dog", "d.webp")
    notes = _touch(root, "cat", "2019", "notes.txt")
    checkpoints = os.path.join(root, "cat", ".ipynb_checkpoints")
    _touch(checkpoints, "e.jpg")
    hidden_class = os.path.join(root, ".thumbnails")
    _touch(hidden_class, "f.jpg")
    beside = _touch(root, "README.md")
    os.makedirs(os.path.join(root, "empty"))

    found = image_folder.list_class_folders(root)
    assert found.files_by_class == {"cat": expected, "dog": [dog]}
    assert found.empty_classes == ["empty"]
    assert found.skipped == {
        image_folder.HIDDEN_FOLDER: [hidden_class, checkpoints],
        image_folder.NOT_IN_CLASS_FOLDER: [beside],
        image_folder.UNSUPPORTED_TYPE: [notes],
    }


def test_a_link_back_to_a_searched_folder_is_not_followed(tmp_path):
    root = str(tmp_path)
    image = _touch(root, "cat", "inner", "a.jpg")
    _touch(root, "dog", "b.jpg")
    loop = os.path.join(root, "cat", "inner", "up")
    os.symlink(os.path.join(root, "cat"), loop)
    found = image_folder.list_class_folders(root)
    assert found.files_by_class["cat"] == [image]
    assert found.skipped == {image_folder.SEARCHED_FOLDER: [loop]}


def test_not_a_folder_or_no_class_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="image_dir .* is not a directory"):
        image_folder.list_class_folders(str(tmp_path / "missing"))
    _touch(str(tmp_path), "loose.jpg")
    with pytest.raises(ValueError, match="has no sub-folders"):
        image_folder.list_class_folders(str(tmp_path))


def test_the_writer_labels_nested_images_by_their_class_folder(tmp_path):
    # Real images: scikit-learn's digits, the 0s and 1s kept in folders by year under their class.
    datasets = pytest.importorskip("sklearn.datasets")
    from PIL import Image

    digits = datasets.load_digits()
    root = tmp_path / "images"
    stored = {}
    for index in np.flatnonzero(digits.target < 2)[:40]:
        digit = int(digits.target[index])
        folder = root / f"digit_{digit}" / f"{2020 + index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.kron(digits.images[index] * 255 / 16, np.ones((4, 4))).astype(np.uint8)
        Image.fromarray(pixels).convert("RGB").save(folder / f"{index}.png")
        stored[f"{index}.png"] = digit
    summary = write_tfrecords(str(root), str(tmp_path / "records"), validation_fraction=0)
    assert summary.skipped == {}
    label_map = read_label_map(str(tmp_path / "records"))
    spec = {
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "image/filename": tf.io.FixedLenFeature([], tf.string),
    }
    files = tf.io.gfile.glob(str(tmp_path / "records" / "train-*"))
    labels = {}
    for record in tf.data.TFRecordDataset(files):
        features = tf.io.parse_single_example(record, spec)
        name = os.path.basename(features["image/filename"].numpy().decode())
        labels[name] = int(features["image/class/label"]) - label_map.label_offset
    assert label_map.class_names == ("digit_0", "digit_1")
    assert labels == stored
