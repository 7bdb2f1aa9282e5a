"""The record schema shared by the writer and the reader: feature keys, `make_example`, the label
map.

A record is one `tf.train.Example` in the classic ImageNet TFRecord layout: the JPEG bytes under
`IMAGE_KEY`, the integer class label under `LABEL_KEY`, and the class name, file name and image size
beside them.

The label map, `labels.json` next to the shards, says what the stored labels mean:

    {
      "format": "tpu_scale.label_map",
      "version": 1,
      "label_offset": 1,
      "num_classes": 3,
      "classes": [{"id": 0, "name": "cat", "stored_label": 1}, ...],
      "examples": {"train": 540, "validation": 60},
      "examples_per_class": {"train": [180, 180, 180], "validation": [20, 20, 20]},
      "records_per_file": {"train-00000-of-00004": 135, ...},
      "non_square_images": 12
    }

A class's id is its index in `classes` (the label a model sees, 0-based); the record stores `id +
label_offset`. `ImageNetInput` reads the map to learn `label_offset` and `num_classes`, so the
reader cannot be configured with an offset the writer did not use, and each file's record count, so
that a file that stops early is found at no cost per record. `labels.txt` (one class name a
line, in id order) is written beside it for tools that expect the classic file.
"""

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import tensorflow as tf

from tpu_scale import _files

IMAGE_KEY = "image/encoded"
LABEL_KEY = "image/class/label"

LABEL_MAP_FILE = "labels.json"
LABELS_TXT_FILE = "labels.txt"
_LABEL_MAP_FORMAT = "tpu_scale.label_map"
_LABEL_MAP_VERSION = 1


def _bytes_feature(value):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int64_feature(value):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def make_example(jpeg_bytes, label, *, height, width, synset="", filename=""):
    """One `tf.train.Example` in the classic ImageNet layout.

    Args:
      jpeg_bytes: the encoded JPEG.
      label: the integer class label, as stored (1-based in the classic files).
      height: image height in pixels.
      width: image width in pixels.
      synset: the class name (the ImageNet synset id, or a folder name).
      filename: the image's file name.

    Returns:
      A `tf.train.Example`.
    """
    feature = {
        IMAGE_KEY: _bytes_feature(jpeg_bytes),
        "image/format": _bytes_feature(b"JPEG"),
        LABEL_KEY: _int64_feature(int(label)),
        "image/class/synset": _bytes_feature(synset.encode()),
        "image/filename": _bytes_feature(filename.encode()),
        "image/height": _int64_feature(int(height)),
        "image/width": _int64_feature(int(width)),
        "image/colorspace": _bytes_feature(b"RGB"),
        "image/channels": _int64_feature(3),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature))


def is_serialized_example(serialized):
    """Cheap structural check that a record is a serialized `tf.train.Example` (it never raises).

    A serialized Example is empty, or one length-delimited field 1 (`features`): the byte `0x0A`,
    the length as a varint, then exactly that many bytes. This catches the common bad records (other
    file formats, text, truncated records) before the parser sees them, so the pipeline can name the
    record or skip it; the parser can still fail on a record whose nested features are corrupt.

    Args:
      serialized: string tensor of records, any shape (one record, or a batch of them).

    Returns:
      A bool tensor of `serialized`'s shape.
    """
    length = tf.cast(tf.strings.length(serialized), tf.int64)
    # Lengths below 2**35 take at most 5 varint bytes; `fixed_length` pads short records with zeros.
    zeros = tf.zeros_like(length, tf.int32)
    head = tf.cast(
        tf.io.decode_raw(tf.strings.substr(serialized, zeros, zeros + 6), tf.uint8, fixed_length=6),
        tf.int64,
    )
    varint = head[..., 1:]
    continues = varint >= 128
    varint_bytes = tf.argmin(tf.cast(continues, tf.int32), axis=-1, output_type=tf.int64) + 1
    shifts = tf.constant([0, 7, 14, 21, 28], tf.int64)
    in_varint = tf.range(5, dtype=tf.int64) < varint_bytes[..., None]
    payload = tf.reduce_sum(
        tf.where(in_varint, tf.bitwise.left_shift(varint % 128, shifts), 0), axis=-1
    )
    well_formed = (
        tf.equal(head[..., 0], 0x0A)
        & tf.logical_not(tf.reduce_all(continues, axis=-1))
        & tf.equal(length, 1 + varint_bytes + payload)
    )
    return tf.equal(length, 0) | well_formed


# An image counts as square when its long side is at most this much longer than its short side
# (a 256x240 scan is square; a 4:3 photo is not).
SQUARE_TOLERANCE = 1.1


def is_square(height: int, width: int) -> bool:
    """Whether an image of `height` x `width` pixels is square, within `SQUARE_TOLERANCE`."""
    return max(height, width) <= SQUARE_TOLERANCE * min(height, width)


@dataclasses.dataclass(frozen=True)
class LabelMap:
    """What the stored labels of a folder of shards mean (read from its `labels.json`).

    Attributes:
      class_names: the class names, in id order (id = position).
      label_offset: the stored label of class 0 (records store `id + label_offset`).
      counts: examples per split, e.g. `{"train": 1617, "validation": 180}`.
      class_counts: examples per class, per split.
      path: the `labels.json` file read (empty for a map not read from a file).
      record_counts: records per file, by file name (in the folder of `labels.json`).
      non_square: the stored images that are not square (`is_square`), over all splits; None
        where the writer did not count them.
    """

    class_names: tuple[str, ...]
    label_offset: int
    counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    class_counts: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    path: str = ""
    record_counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    non_square: int | None = None

    @property
    def non_square_fraction(self) -> float | None:
        """The share of the stored images that are not square, or None if not counted."""
        total = sum(self.counts.values())
        return None if self.non_square is None or not total else self.non_square / total

    def record_counts_by_path(self) -> dict[str, int]:
        """`record_counts` keyed by each file's path (as a glob in that folder names it)."""
        directory = os.path.dirname(self.path)
        return {os.path.join(directory, name): n for name, n in self.record_counts.items()}

    @property
    def num_classes(self) -> int:
        """How many classes (ids are `0 .. num_classes - 1`)."""
        return len(self.class_names)


def write_label_map(
    output_dir: str,
    class_names: Sequence[str],
    label_offset: int,
    counts: Mapping[str, int] | None = None,
    class_counts: Mapping[str, Sequence[int]] | None = None,
    record_counts: Mapping[str, int] | None = None,
    non_square: int | None = None,
) -> str:
    """Writes `labels.json` (and the classic `labels.txt`) into `output_dir`.

    Args:
      output_dir: the folder of the shards.
      class_names: the class names in id order.
      label_offset: the stored label of class 0.
      counts: examples per split (`{"train": n, "validation": m}`).
      class_counts: examples per class per split, each a list in id order.
      record_counts: records per file, by file name.
      non_square: the images that are not square (`is_square`), over all splits.

    Returns:
      The path of `labels.json`.
    """
    class_names = [str(name) for name in class_names]
    content = {
        "format": _LABEL_MAP_FORMAT,
        "version": _LABEL_MAP_VERSION,
        "label_offset": int(label_offset),
        "num_classes": len(class_names),
        "classes": [
            {"id": index, "name": name, "stored_label": index + int(label_offset)}
            for index, name in enumerate(class_names)
        ],
        "examples": {split: int(n) for split, n in (counts or {}).items()},
        "examples_per_class": {
            split: [int(n) for n in per_class] for split, per_class in (class_counts or {}).items()
        },
        "records_per_file": {str(name): int(n) for name, n in (record_counts or {}).items()},
    }
    if non_square is not None:
        content["non_square_images"] = int(non_square)
    path = os.path.join(output_dir, LABEL_MAP_FILE)
    with tf.io.gfile.GFile(os.path.join(output_dir, LABELS_TXT_FILE), "w") as f:
        f.write("".join(name + "\n" for name in class_names))
    _files.write_json(path, content)  # whole or not at all: readers trust what they find
    return path


def _label_map_dir(data_dir_or_pattern):
    location = os.fspath(data_dir_or_pattern)
    if isinstance(location, bytes):
        location = location.decode()
    if location.startswith("tfds:"):
        return None
    if tf.io.gfile.isdir(location):
        return location
    return os.path.dirname(location) or "."


def _parse_label_map(path, text):
    try:
        content = json.loads(text)
        classes = sorted(content["classes"], key=lambda entry: entry["id"])
        ids = [entry["id"] for entry in classes]
        if ids != list(range(len(ids))):
            raise ValueError(f"class ids {ids} are not 0, 1, 2, ...")
        label_offset = int(content["label_offset"])
        class_names = tuple(str(entry["name"]) for entry in classes)
        counts = {str(k): int(v) for k, v in content.get("examples", {}).items()}
        class_counts = {
            str(k): tuple(int(n) for n in v)
            for k, v in content.get("examples_per_class", {}).items()
        }
        record_counts = {str(k): int(v) for k, v in content.get("records_per_file", {}).items()}
        non_square = content.get("non_square_images")
        non_square = None if non_square is None else int(non_square)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"The label map {path!r} is not a valid {LABEL_MAP_FILE} ({error}). Rewrite it with python -m tpu_scale.data.convert, or delete it and pass label_offset= and num_classes=.") from None
    return LabelMap(class_names, label_offset, counts, class_counts, path, record_counts, non_square)


def read_label_map(
    data_dir_or_pattern: str | os.PathLike | Sequence[str],
) -> LabelMap | None:
    """Reads the `labels.json` next to a folder of shards, if there is one.

    Args:
      data_dir_or_pattern: the folder of the shards, a file in it, a glob such as
        `/data/flowers/train-*`, or a list of those.

    Returns:
      The `LabelMap`, or None when no `labels.json` is there.

    Raises:
      ValueError: if a `labels.json` is not a valid label map, or the globs of a list lie in folders
        with different label maps.
    """
    if isinstance(data_dir_or_pattern, (str, bytes, os.PathLike)):
        locations = [data_dir_or_pattern]
    else:
        locations = list(data_dir_or_pattern)
    found = {}
    for location in locations:
        directory = _label_map_dir(location)
        if directory is None:
            continue
        path = os.path.join(directory, LABEL_MAP_FILE)
        if path in found or not tf.io.gfile.exists(path):
            continue
        with tf.io.gfile.GFile(path) as f:
            found[path] = _parse_label_map(path, f.read())
    maps = list(found.values())
    for other in maps[1:]:
        if (other.class_names, other.label_offset) != (maps[0].class_names, maps[0].label_offset):
            raise ValueError(f"The label maps {maps[0].path!r} and {other.path!r} disagree (classes or label offset): read files written by one conversion together, or pass each set of files to its own ImageNetInput.")
    return maps[0] if maps else None
