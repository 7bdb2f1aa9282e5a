"""Turns a folder of class sub-folders of images into TFRecord shards in the classic ImageNet
layout: the function `write_tfrecords` (`tpu_scale.data.write_tfrecords`) and its command line.

    python -m tpu_scale.data.convert --image_dir photos --output_dir records

`photos/<class name>/<image>` becomes `records/train-00000-of-00008` ... and
`records/validation-00000-of-00002` ...: a seeded split, stratified by class
(`--validation_fraction`, 10% by default, at least one image of every class of two or more; 0
for none, or `--validation_dir` for a folder that already holds the validation images). Each
record is one `tf.train.Example`: `image/encoded` (JPEG bytes), `image/class/label` (int64, the
class id + `label_offset`, so 1-based by default like the ImageNet files), `image/class/synset`
(the folder name), `image/filename`, `image/height`, `image/width`, `image/format`. A folder with
a single class is refused: a classifier needs two.

Beside the shards, `labels.json` (see `tpu_scale.data.schema`) records the class names, their ids,
the label offset and the counts per split; `ImageNetInput` reads it, so the reader's `label_offset`
and `num_classes` come from the writer. `labels.txt` lists the class names in id order, and
`skipped.json` every file left out, by reason (`{"skipped": {reason: [paths]}, "empty_classes":
[...]}`).

For folders too big for one machine (millions of images in a bucket), the same conversion runs as
an Apache Beam pipeline on any Beam runner (Dataflow, Flink, Spark; `pip install -e ".[beam]"`):

    python -m tpu_scale.data.convert --image_dir gs://bucket/photos \
        --output_dir gs://bucket/records \
        --beam_pipeline_options "runner=DataflowRunner,project=P,region=R,temp_location=gs://bucket/tmp"

The split, the label map and the shard plan are computed here from the file listing in either
case; only the per-image work (`convert_image`) and the shard writing move to the runner's
workers, so the same folder and seed give the same files, byte for byte
(`tpu_scale.data.beam_writer`). The two writers differ only in who does the per-image work and
writes the shard files; the rest is here, once:

  plan_conversion     the split, the label map and the shards, computed once from the listing
  convert_image       the per-image work: read, decode in full, turn upright, re-encode, record
  write_shard         one planned shard's records written in the plan's order, and its counts
  finish_conversion   the written shards named, `labels.json` and `skipped.json` written beside
                      them, the staging folder published; the `TFRecordSummary`

with the local writer (a `tf.data` pipeline decoding the images in parallel), the progress line
and the command line.

What is checked, so that training never meets a bad image:
  - Every image is decoded in full before it is stored. JPEGs are stored byte for byte; other
    formats (PNG, GIF, BMP, WebP) and CMYK JPEGs are re-encoded as RGB JPEGs, because the input
    pipeline's fused decode reads JPEG only. A JPEG whose EXIF orientation tag says it is rotated
    or mirrored (phone and camera photos) is turned upright and re-encoded, as a viewer shows it;
    the decoder alone ignores the tag. Undecodable or truncated files are skipped, counted and
    named in the summary.
  - Images in folders nested inside a class folder belong to that class (as Keras's
    `image_dataset_from_directory` reads them); hidden folders are not searched. Files of other
    types (`.txt`, `.tiff`, ...) are skipped, counted and named (`tpu_scale.data.image_folder`).
  - Class folders without images are skipped with a warning and get no id: the ids are those of the
    non-empty classes in sorted folder order, and the summary lists the skipped folders.
  - No single file stops the conversion or exhausts its memory. A file above the size cap
    (`--max_file_mib`, 64 by default) is skipped unread; an image above the pixel cap
    (`--max_pixels`, 89,478,485 by default, Pillow's own limit) is skipped by its header before
    any decoder (TensorFlow's or Pillow's) sees it, so a decompression bomb costs nothing; a pipe
    or device named `.jpg` is skipped; a link whose target is outside the folder is skipped unless
    `--follow_links`. A name that is not UTF-8, or holds a newline, is converted like any other,
    stored escaped (`names.stored`), and every log line and error shows names quoted and escaped,
    so that no name can forge a line. The large images are converted as many at once as a 2 GiB
    budget holds (at least one): with the default caps the conversion stays under about 3.5
    GiB plus 0.1 GiB per thread, whatever the files hold.
  - `--strict` turns every skipped file and empty class folder into an error naming them; the
    local writer stops at the first image it cannot store.
  - No shard is empty: a split with fewer images than shards gets fewer shards.

The output appears atomically: the shards and label map are written into a hidden folder next to
`output_dir` (`.<name>.incomplete-*`) and moved into place at the end, so an aborted conversion
leaves nothing that looks finished, and the next conversion to the same `output_dir` removes the
staging folders that killed writers left (naming them in its log). An `output_dir` that already
holds a conversion is refused unless `--overwrite` is given, which replaces it as a whole; a
non-empty folder holding anything else is always refused. (On object stores, which cannot rename
folders, the files are moved one by one and `labels.json` goes last: a folder without it is
unfinished.)
"""

import argparse
import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence

if __name__ == "__main__":
    # The command line, before TensorFlow loads: its C++ start-up lines, and the warning it logs
    # for each image that fails to decode, are noise here (the summary names every skipped file).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tpu_scale._files import is_local, remove_tree  # noqa: E402
from tpu_scale.data.image_folder import (  # noqa: E402
    DEFAULT_MAX_FILE_BYTES,
    IMAGE_EXTENSIONS,
    TOO_LARGE,
    list_class_folders,
)
from tpu_scale.data.names import as_bytes, inline, shown, stored  # noqa: E402
from tpu_scale.data.output_dir import (  # noqa: E402
    SKIPPED_FILE,
    check_output_dir,
    make_staging_dir,
    publish,
    remove_stale_staging_dirs,
)
from tpu_scale.data.reencode import (  # noqa: E402
    CORRUPT_JPEG,
    DEFAULT_MAX_PIXELS,
    NOT_DECODED,
    TOO_MANY_PIXELS,
    UNDECODABLE,
    UNREADABLE,
    Decoded,
    Skip,
    checked_jpeg,
    decode_in_graph,
    header_size,
)
from tpu_scale.data.schema import (  # noqa: E402
    LABEL_MAP_FILE,
    is_square,
    make_example,
    write_label_map,
)
from tpu_scale.data.sources import graph_function  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_VALIDATION_FRACTION = 0.1
# About 110 MB of ImageNet-sized JPEGs per shard; at least `_MIN_SHARDS` files so that several hosts
# and the reader's parallel interleave have files to share.
EXAMPLES_PER_SHARD = 1024
_MIN_SHARDS = 8
_MAX_NAMES = 10

# Why a file was skipped (the keys of `TFRecordSummary.skipped`): `reencode.UNDECODABLE`,
# `CORRUPT_JPEG`, `UNREADABLE`, `TOO_MANY_PIXELS`, and those of the folders' listing
# (`image_folder`: unsupported type, hidden folder, above the size cap, link leaving the folder...).
# Those found as an image is converted, which `strict` turns into an error:
IMAGE_FAULTS = (UNDECODABLE, CORRUPT_JPEG, UNREADABLE, TOO_MANY_PIXELS, TOO_LARGE)


@dataclasses.dataclass
class TFRecordSummary:
    """What `write_tfrecords` wrote.

    Attributes:
      output_dir: the folder of the shards.
      class_names: the class names in id order (empty class folders excluded).
      label_offset: the stored label of class 0.
      split_paths: the shard paths of each split (`"train"`, `"validation"`).
      split_counts: the examples of each split.
      class_counts: the examples of each class (in id order), per split.
      num_reencoded: images stored re-encoded as JPEG (other formats, CMYK JPEGs, JPEGs turned
        upright by their EXIF orientation).
      skipped: the skipped files by reason (`UNSUPPORTED_TYPE`, `UNDECODABLE`, `CORRUPT_JPEG`, ...).
      empty_classes: class folders without images, skipped (they get no id).
      label_map_path: the `labels.json` written.
      skipped_report_path: the `skipped.json` written: every skipped file by reason, and the empty
        class folders.
      replaced_existing: whether an earlier conversion in `output_dir` was replaced
        (`overwrite=True`).
      num_non_square: images stored that are not square (`schema.is_square`): the recipe reads
        the share from the label map.
    """

    output_dir: str
    class_names: list[str]
    label_offset: int
    split_paths: dict[str, list[str]]
    split_counts: dict[str, int]
    class_counts: dict[str, list[int]]
    num_reencoded: int
    skipped: dict[str, list[str]]
    empty_classes: list[str]
    label_map_path: str
    skipped_report_path: str
    replaced_existing: bool = False
    num_non_square: int = 0

    @property
    def paths(self) -> list[str]:
        """All shard paths, split by split."""
        return [path for paths in self.split_paths.values() for path in paths]

    @property
    def num_examples(self) -> int:
        """The examples of all splits."""
        return sum(self.split_counts.values())

    @property
    def num_skipped(self) -> int:
        """The files skipped for any reason."""
        return sum(len(paths) for paths in self.skipped.values())

    def describe(self, max_names: int = _MAX_NAMES) -> str:
        """A readable report: counts per split, classes, skipped files by reason with their names.

        Args:
          max_names: file names listed per reason before "and N more".

        Returns:
          A multi-line string.
        """
        lines = [
            f"Wrote {self.num_examples} images of {len(self.class_names)} classes to "
            f"{inline(self.output_dir)}"
            + (" (replacing the earlier conversion)." if self.replaced_existing else ".")
        ]
        for split, count in self.split_counts.items():
            lines.append(f"  {split}: {count} images in {len(self.split_paths[split])} shards")
        last = len(self.class_names) - 1 + self.label_offset
        lines.append(
            f"  classes: {_names(self.class_names, max_names, quoted=False)}, ids 0-{len(self.class_names) - 1}, "
            f"stored as labels {self.label_offset}-{last} (label_offset={self.label_offset})"
        )
        lines.append(f"  label map: {inline(self.label_map_path)}")
        lines.append(f"  re-encoded as JPEG: {self.num_reencoded}")
        lines.append(f"  not square: {self.num_non_square}")
        if self.empty_classes:
            lines.append(
                f"Skipped {len(self.empty_classes)} class folder(s) without images (they get no "
                "id): "
                f"{_names(self.empty_classes, max_names, quoted=False)}"
            )
        if self.skipped:
            lines.append(f"Skipped {self.num_skipped} file(s):")
            for reason, paths in sorted(self.skipped.items()):
                lines.append(f"  {reason} ({len(paths)}): {_names(paths, max_names)}")
            lines.append(f"  all listed in {inline(self.skipped_report_path)}")
        return "\n".join(lines)


def _names(names, max_names=_MAX_NAMES, quoted=True):
    # Quoted and escaped: a name holding a newline must not start a line of its own in the log.
    # Class names are listed as stored (`names.stored`: printable already).
    names = list(names)
    listed = ", ".join((shown(name) if quoted else name) for name in names[:max_names])
    return listed + (f" and {len(names) - max_names} more" if len(names) > max_names else "")


def _validation_count(num_images, fraction):
    # Rounded per class; every class keeps at least one training image, and a class of two or more
    # images gives at least one to validation (10% of a small class would round to none, leaving
    # the class, or a whole small dataset, unevaluated).
    if num_images < 2 or fraction <= 0:
        return 0
    return min(num_images - 1, max(1, math.floor(num_images * fraction + 0.5)))


def _stratified_split(files_by_class, class_ids, fraction, seed):
    train, validation = [], []
    for class_name, paths in files_by_class.items():
        # A generator per class: adding or removing a class leaves the split of the others
        # unchanged.
        order = sorted(paths)
        random.Random(f"{seed}/{class_name}").shuffle(order)
        count = _validation_count(len(order), fraction)
        validation.extend((path, class_ids[class_name]) for path in order[:count])
        train.extend((path, class_ids[class_name]) for path in order[count:])
    return train, validation


def default_num_shards(num_images: int) -> int:
    """The shard count used when none is given: about `EXAMPLES_PER_SHARD` images a shard, at least
    8 shards, and never more shards than images."""
    return max(1, min(num_images, max(_MIN_SHARDS, math.ceil(num_images / EXAMPLES_PER_SHARD))))


@dataclasses.dataclass(frozen=True)
class ConvertedImage:
    """What `convert_image` made of one file.

    Attributes:
      path: the image file.
      class_id: its class id (0-based).
      record: the serialized `tf.train.Example`, or None for a file that is skipped.
      reencoded: whether the stored JPEG is a re-encoding (other formats, CMYK, EXIF-rotated).
      skip_reason: why the file is skipped (one of `IMAGE_FAULTS`), or None.
      square: whether the stored image is square, within `schema.SQUARE_TOLERANCE`.
    """

    path: str
    class_id: int
    record: bytes | None
    reencoded: bool = False
    skip_reason: str | None = None
    square: bool = True


def convert_image(
    image_path: str,
    class_id: int,
    class_names: Sequence[str],
    label_offset: int,
    *,
    read: tuple[bytes, Decoded | None] | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> ConvertedImage:
    """The per-image work, the same for the local writer and the Beam pipeline's workers.

    Reads the file (through `tf.io.gfile`, so `gs://` paths work; no more than `max_file_bytes`
    of it), decodes it in full, turns it upright, re-encodes it as JPEG when the pipeline could not
    decode it as it is, and makes its record (`schema.make_example`; the file name stored escaped,
    `names.stored`). A file that is not a usable image is not an error: the result says why it is
    skipped.

    Args:
      image_path: the image file.
      class_id: its class id (0-based).
      class_names: the class names in id order (the record stores the name).
      label_offset: the stored label of class 0.
      read: the file's bytes and their `Decoded`, when a `tf.data` pipeline has read and decoded
        the file already (`reencode.decode_in_graph`; a None `Decoded`: read, not decoded); None
        to read and decode it here.
      max_pixels: images with more pixels are skipped (`TOO_MANY_PIXELS`) before any decoder
        sees them.
      max_file_bytes: a file larger than this is skipped (`TOO_LARGE`) with no more than that
        read (the listing skips local ones unread; this bounds a remote file, or one that grew).

    Returns:
      A `ConvertedImage`.
    """
    try:
        if read is None:
            raw, decoded = read_capped(image_path, max_file_bytes), None
        else:
            raw, decoded = read
        jpeg, height, width, was_reencoded = checked_jpeg(raw, decoded, max_pixels=max_pixels)
    except Skip as skip:
        return ConvertedImage(image_path, class_id, None, skip_reason=skip.reason)
    example = make_example(
        jpeg,
        class_id + label_offset,
        height=height,
        width=width,
        synset=class_names[class_id],
        filename=stored(os.path.basename(image_path)),
    )
    # Deterministic: map fields in key order, so every process writes the same bytes.
    record = example.SerializeToString(deterministic=True)
    return ConvertedImage(image_path, class_id, record, was_reencoded, square=is_square(height, width))


def open_image_file(path):
    """A binary file object of `path`: a local one by the bytes the system knows it by (its name
    need not be UTF-8), a remote one (`gs://...`) through `tf.io.gfile`."""
    if is_local(path):
        return open(path, "rb")
    return tf.io.gfile.GFile(path, "rb")


def read_capped(path, max_file_bytes):
    """The bytes of the file `path`, no more than `max_file_bytes + 1` of them ever read.

    Raises:
      Skip: `TOO_LARGE` for a larger file, `UNREADABLE` for a file that cannot be read.
    """
    try:
        with open_image_file(path) as f:
            raw = f.read(max_file_bytes + 1)
    except (OSError, tf.errors.OpError):
        raise Skip(UNREADABLE) from None
    if len(raw) > max_file_bytes:
        raise Skip(TOO_LARGE)
    return raw


@dataclasses.dataclass
class ShardResult:
    """What was written to one planned shard.

    Attributes:
      written: the records written.
      reencoded: of those, the re-encoded images.
      class_counts: the records of each class, in id order.
      skipped: the files left out, by reason, in the shard's order.
      non_square: of the records written, the images that are not square (`schema.is_square`).
    """

    written: int
    reencoded: int
    class_counts: list[int]
    skipped: dict[str, list[str]]
    non_square: int = 0


def write_shard(path: str, images: Iterable[ConvertedImage], num_classes: int) -> ShardResult:
    """Writes the records of `images`, in their order, to the TFRecord file `path`.

    Args:
      path: the file to write (local or `gs://...`).
      images: `convert_image` results; those without a record are counted as skipped.
      num_classes: the number of classes (the length of `class_counts`).

    Returns:
      A `ShardResult`.
    """
    result = ShardResult(0, 0, [0] * num_classes, {})
    with tf.io.TFRecordWriter(path) as writer:
        for image in images:
            if image.record is None:
                result.skipped.setdefault(image.skip_reason, []).append(image.path)
                continue
            writer.write(image.record)
            result.written += 1
            result.reencoded += image.reencoded
            result.class_counts[image.class_id] += 1
            result.non_square += not image.square
    return result


@dataclasses.dataclass(frozen=True)
class PlannedShard:
    """One shard of the plan: its split, its place among the split's shards, its images.

    Attributes:
      split: `"train"` or `"validation"`.
      index: the shard's place in its split (before empty shards are dropped).
      images: `(path, class id)` of its images, in the order they are stored.
    """

    split: str
    index: int
    images: list[tuple[str, int]]

    @property
    def staging_name(self) -> str:
        """The shard's file name while it is written (it is renamed `<split>-NNNNN-of-NNNNN`)."""
        return f"{self.split}-{self.index:05d}.incomplete"


@dataclasses.dataclass
class ConversionPlan:
    """What a conversion writes, computed once from the file listing by `plan_conversion`: the
    writer that runs it (the local writer or a Beam pipeline) only converts and stores.

    Attributes:
      image_dir: the folder of class folders.
      class_names: the class names in id order (empty class folders excluded).
      label_offset: the stored label of class 0.
      shards: the shards of every split, train first.
      skipped: the files the listing left out, by reason.
      empty_classes: class folders without images.
      strict: whether a skipped image is an error.
      max_pixels: the pixel cap of every image (`convert_image`).
      max_file_bytes: the size cap of every file (`convert_image`).
    """

    image_dir: str
    class_names: list[str]
    label_offset: int
    shards: list[PlannedShard]
    skipped: dict[str, list[str]]
    empty_classes: list[str]
    strict: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES

    @property
    def num_images(self) -> int:
        """The images of all shards."""
        return sum(len(shard.images) for shard in self.shards)


def _error_listing(what, by_reason):
    parts = [
        f"{reason} ({len(paths)}): {_names(paths)}" for reason, paths in sorted(by_reason.items())
    ]
    return f"{what}: " + "; ".join(parts)


def plan_conversion(
    image_dir: str,
    num_shards: int | None = None,
    *,
    validation_fraction: float | None = None,
    validation_dir: str | None = None,
    num_validation_shards: int | None = None,
    label_offset: int = 1,
    seed: int = 0,
    strict: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    follow_links: bool = False,
) -> ConversionPlan:
    """The split, the label map and the shards of a conversion, from the folders' listing.

    Arguments as `write_tfrecords`'s. Only the listing is read: no image is opened.

    Returns:
      A `ConversionPlan`.

    Raises:
      ValueError: as `write_tfrecords` does, for everything found before an image is decoded.
    """
    if validation_dir is not None and validation_fraction:
        raise ValueError("Pass either validation_fraction (split image_dir) or validation_dir (validation images already in their own folder), not both.")
    if validation_fraction is None:
        validation_fraction = 0.0 if validation_dir is not None else DEFAULT_VALIDATION_FRACTION
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}.")
    for flag, value in (
        ("num_shards", num_shards),
        ("num_validation_shards", num_validation_shards),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}.")
    for flag, value, unit in (
        ("max_pixels", max_pixels, "pixels of the largest image decoded"),
        ("max_file_bytes", max_file_bytes, "bytes of the largest file read"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer ({unit}), got {value!r}.")
    limits = dict(max_file_bytes=max_file_bytes, follow_links=follow_links)
    listing = list_class_folders(image_dir, "image_dir", **limits)
    class_names = list(listing.files_by_class)
    class_ids = {name: index for index, name in enumerate(class_names)}
    skipped = {reason: list(paths) for reason, paths in listing.skipped.items()}
    empty_classes = list(listing.empty_classes)
    if not class_names:
        raise ValueError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) in the class folders of {shown(image_dir)}" + (f"; {_error_listing('skipped', skipped)}" if skipped else "."))
    if len(class_names) < 2:
        raise ValueError(f"{shown(image_dir)} has images in one class folder only ({shown(class_names[0])}): a classifier needs at least two classes, one sub-folder of images each (image_dir/<class>/<image>)." + (f" Skipped: {_names(empty_classes)} (no images)." if empty_classes else ""))
    train, validation = _stratified_split(
        listing.files_by_class, class_ids, validation_fraction, seed
    )
    if validation_dir is not None:
        val_listing = list_class_folders(validation_dir, "validation_dir", **limits)
        unknown = sorted(set(val_listing.files_by_class) - set(class_ids))
        if unknown:
            raise ValueError(f"validation_dir {shown(validation_dir)} has classes with no training images in {shown(image_dir)}: {_names(unknown)}. Give each validation class its training images.")
        for class_name, paths in val_listing.files_by_class.items():
            validation.extend((path, class_ids[class_name]) for path in paths)
        for reason, paths in val_listing.skipped.items():
            skipped.setdefault(reason, []).extend(paths)
        empty_classes.extend(
            os.path.join(validation_dir, name) for name in val_listing.empty_classes
        )
    if strict and (skipped or empty_classes):
        problems = dict(skipped)
        if empty_classes:
            problems["class folder without images"] = empty_classes
        raise ValueError(_error_listing("strict: files and folders that would be skipped", problems) + ". Remove or fix them, or run without strict to skip them.")
    shards = []
    requested = {"train": num_shards, "validation": num_validation_shards}
    for split, items in (("train", train), ("validation", validation)):
        if not items:
            continue
        random.Random(f"{seed}/{split}").shuffle(items)
        count = min(requested[split] or default_num_shards(len(items)), len(items))
        shards.extend(PlannedShard(split, index, items[index::count]) for index in range(count))
    return ConversionPlan(
        image_dir,
        class_names,
        label_offset,
        shards,
        skipped,
        empty_classes,
        strict,
        max_pixels=max_pixels,
        max_file_bytes=max_file_bytes,
    )


def finish_conversion(
    plan: ConversionPlan,
    results: Sequence[ShardResult],
    staging_dir: str,
    output_dir: str,
    replace: bool,
) -> TFRecordSummary:
    """Names the written shards, writes the label map and the skipped-files report beside them,
    and publishes `staging_dir` as `output_dir`: the same last steps after either writer.

    Args:
      plan: the conversion's plan (`plan_conversion`).
      results: the `ShardResult` of each planned shard, in the plan's order.
      staging_dir: the folder the shards were written into (`output_dir.make_staging_dir`).
      output_dir: the folder to publish it as.
      replace: whether `output_dir` holds an earlier conversion to replace
        (`output_dir.check_output_dir`).

    Returns:
      A `TFRecordSummary`.

    Raises:
      ValueError: no image was usable, or (with `plan.strict`) an image cannot be stored.
    """
    class_names = plan.class_names
    skipped = {reason: list(paths) for reason, paths in plan.skipped.items()}
    split_counts = {shard.split: 0 for shard in plan.shards}
    class_counts = {split: [0] * len(class_names) for split in split_counts}
    written_shards = {split: [] for split in split_counts}
    num_reencoded = non_square = 0
    for shard, result in zip(plan.shards, results):
        path = os.path.join(staging_dir, shard.staging_name)
        num_reencoded += result.reencoded
        non_square += result.non_square
        split_counts[shard.split] += result.written
        class_counts[shard.split] = [
            a + b for a, b in zip(class_counts[shard.split], result.class_counts)
        ]
        for reason, paths in result.skipped.items():
            skipped.setdefault(reason, []).extend(sorted(paths))
        if result.written:
            written_shards[shard.split].append((path, result.written))
        else:
            tf.io.gfile.remove(path)  # every image of the shard was skipped
    failed = {r: p for r, p in skipped.items() if r in IMAGE_FAULTS}
    if plan.strict and failed:
        raise ValueError(_error_listing("strict: images that cannot be stored", failed) + ". Remove or fix them, or run without strict to skip them.")
    if not sum(split_counts.values()):
        raise ValueError(f"No usable image in {shown(plan.image_dir)}; {_error_listing('skipped', skipped)}.")
    split_paths, record_counts = {}, {}
    for split, shards in written_shards.items():
        split_paths[split] = []
        for index, (path, written) in enumerate(shards):
            final = f"{split}-{index:05d}-of-{len(shards):05d}"
            tf.io.gfile.rename(path, os.path.join(staging_dir, final))
            split_paths[split].append(os.path.join(output_dir, final))
            record_counts[final] = written
    split_counts = {split: n for split, n in split_counts.items() if n}
    class_counts = {split: class_counts[split] for split in split_counts}
    skipped = {reason: sorted(paths) for reason, paths in skipped.items()}
    with tf.io.gfile.GFile(os.path.join(staging_dir, SKIPPED_FILE), "w") as f:
        report = {"skipped": skipped, "empty_classes": plan.empty_classes}
        f.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
    write_label_map(
        staging_dir,
        class_names,
        plan.label_offset,
        split_counts,
        class_counts,
        record_counts,
        non_square=non_square,
    )
    publish(staging_dir, output_dir, replace)
    return TFRecordSummary(
        output_dir=output_dir,
        class_names=class_names,
        label_offset=plan.label_offset,
        split_paths={split: split_paths[split] for split in split_counts},
        split_counts=split_counts,
        class_counts=class_counts,
        num_reencoded=num_reencoded,
        skipped=skipped,
        empty_classes=plan.empty_classes,
        label_map_path=os.path.join(output_dir, LABEL_MAP_FILE),
        skipped_report_path=os.path.join(output_dir, SKIPPED_FILE),
        replaced_existing=replace,
        num_non_square=non_square,
    )




# Images handed from the decoding pipeline to Python at a time: enough to spread the hand-over's
# cost, few enough that a batch of them stays small.
_DECODED_BATCH = 16

# What the decoding pipeline takes: files up to 2 MiB (an ImageNet JPEG is about 110 KB) of up to
# 4 megapixels (12 MB as RGB). The pipeline holds up to 2 batches and a decode per thread, so these
# bound its memory: about (num_threads + 48) x 14 MB at worst. Larger files and images go to the
# memory budget below.
_PIPELINE_FILE_BYTES = 2 * 2**20
_PIPELINE_PIXELS = 4 * 2**20

# The memory that the images converted at once outside the pipeline may take (their files, their
# pixels and the copies the decode, the EXIF turn and the re-encoding make): images wait for
# their share, in the plan's order. One image is always let through, however large (it is bounded
# by max_file_bytes and max_pixels).
MEMORY_BUDGET_BYTES = 2 * 2**30
# Bytes per pixel at the peak of an image's conversion (RGB pixels, 3 bytes each: Pillow's decode,
# its turned copy, the array and the tensor handed to the encoder, and the allocator's slack): a
# rotated 88-megapixel photo peaked at 1.7 GB above the process's start.
_BYTES_PER_PIXEL = 20


class _MemoryBudget:
    """Bytes granted to images in the order of their tickets (the plan's order), so that the
    oldest image, the one the shard writer waits for, is never kept waiting by a later one."""

    def __init__(self, limit):
        self.limit, self.used = limit, 0
        self._tickets = itertools.count()
        self._serving = 0
        self._open = False
        self._changed = threading.Condition()

    def ticket(self):
        return next(self._tickets)

    def acquire(self, ticket, size):
        with self._changed:
            self._changed.wait_for(
                lambda: self._open
                or (
                    self._serving == ticket
                    and (self.used == 0 or self.used + size <= self.limit)
                )
            )
            self.used += size
            self._serving += 1
            self._changed.notify_all()

    def release(self, size):
        with self._changed:
            self.used -= size
            self._changed.notify_all()

    def open(self):
        """Lets every waiter through: the conversion stops, and the images in flight must end."""
        with self._changed:
            self._open = True
            self._changed.notify_all()


def _file_size(path):
    """A local file's size, or None (a remote file, or one that cannot be stat'ed)."""
    if not is_local(path):
        return None
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _read_and_decode(index, path, max_pixels):
    raw = tf.io.read_file(path)
    return (index, raw, *decode_in_graph(raw, max_pixels))


def _memory_needed(path, size, pixels, plan):
    """The bytes an image's conversion may take at its peak, for the memory budget.

    `size` and `pixels` are those known already (None: not known). A local image's pixels are read
    from its header by Pillow (header only); when they cannot be, the caps are assumed.
    """
    size = plan.max_file_bytes if size is None else min(size, plan.max_file_bytes)
    if pixels is None:
        try:
            with open_image_file(path) as f:
                height, width, frames = header_size(f)
            pixels = height * width * frames
        except (Skip, OSError, tf.errors.OpError):
            pixels = plan.max_pixels
    # An image above the cap is skipped before it is decoded.
    decoded = pixels if pixels <= plan.max_pixels else 0
    return 2 * size + _BYTES_PER_PIXEL * decoded


def _converted_images(plan, num_threads, budget_bytes=MEMORY_BUDGET_BYTES):
    """`convert_image` of every image of `plan`, shard after shard, in the plan's order.

    The reading and decoding of small images (most of a dataset's), most of the per-image work,
    run in a `tf.data` pipeline of `num_threads` parallel calls (default: the CPU count), outside
    Python's global lock. What is left, the header checks and the records, and for a photo its EXIF
    turn (Pillow's decode and a re-encode, which release the lock too), runs on as many threads,
    in order. A file the pipeline could not read or decode is left out of it (`ignore_errors`) and
    goes through `convert_image`'s own reading, which says why it is skipped. Larger files and
    images (`_PIPELINE_FILE_BYTES`, `_PIPELINE_PIXELS`) are read and decoded on those threads too,
    as many at once as `budget_bytes` holds, so that memory stays bounded whatever the files hold.
    """
    images = [image for shard in plan.shards for image in shard.images]
    sizes = [_file_size(path) for path, _ in images]
    # The pipeline reads a file whole: only local files whose size was seen to be small go there.
    small = [i for i, size in enumerate(sizes) if size is not None and size <= _PIPELINE_FILE_BYTES]
    # By the bytes the system knows them by: a name need not be UTF-8.
    paths = tf.constant([as_bytes(images[i][0]) for i in small], dtype=tf.string)
    threads = num_threads or os.cpu_count() or 1
    # Fixed parallelism, autotuning off: with it on, the iterator's end (or its destruction, when
    # left early) sometimes waits idle on the autotuner (`_workarounds.batch_scheduling`'s stall).
    options = tf.data.Options()
    options.autotune.enabled = False
    pipeline_pixels = min(plan.max_pixels, _PIPELINE_PIXELS)
    decoded = (
        tf.data.Dataset.from_tensor_slices((tf.constant(small, dtype=tf.int64), paths))
        # In order (whatever the pipeline's options say): a missing index is a dropped file.
        .map(
            graph_function(lambda index, path: _read_and_decode(index, path, pipeline_pixels)),
            num_parallel_calls=threads,
            deterministic=True,
        )
        .ignore_errors()
        .batch(_DECODED_BATCH)
        .prefetch(1)
        .with_options(options)
    )
    budget = _MemoryBudget(budget_bytes)
    limits = dict(max_pixels=plan.max_pixels, max_file_bytes=plan.max_file_bytes)

    def convert(ticket, index, read, pixels):
        path, class_id = images[index]
        size = len(read[0]) if read is not None else sizes[index]
        # Every ticket is served, whatever happens, or the images after it would wait forever.
        needed = 2 * plan.max_file_bytes + _BYTES_PER_PIXEL * plan.max_pixels
        try:
            needed = _memory_needed(path, size, pixels, plan)
        finally:
            budget.acquire(ticket, needed)
        try:
            converted = convert_image(
                path, class_id, plan.class_names, plan.label_offset, read=read, **limits
            )
        except BaseException:
            budget.release(needed)
            raise
        return converted, needed

    def items():
        """`(index, read, pixels)` of every image in order: read and decoded by the pipeline, read
        but left undecoded, or left to `convert_image` (None, None)."""
        position = 0
        for indices, raws, heights, widths, jpegs, channels in decoded.as_numpy_iterator():
            for index, raw, height, width, jpeg, channel_count in zip(
                indices, raws, heights, widths, jpegs, channels
            ):
                yield from ((i, None, None) for i in range(position, index))  # dropped, or large
                decoded_image = Decoded(int(height), int(width), jpeg, int(channel_count))
                if decoded_image.channels == NOT_DECODED:
                    yield index, (raw, None), decoded_image.height * decoded_image.width
                else:
                    yield index, (raw, decoded_image), decoded_image.height * decoded_image.width
                position = index + 1
        yield from ((i, None, None) for i in range(position, len(images)))

    # Submitted in order, a few ahead of the writer; each image's memory is given back once the
    # writer has taken its record (when this generator is resumed).
    pending = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        try:
            for index, read, pixels in items():
                pending.append(pool.submit(convert, budget.ticket(), index, read, pixels))
                while len(pending) > 2 * threads:
                    converted, needed = pending.popleft().result()
                    try:
                        yield converted
                    finally:
                        budget.release(needed)
            while pending:
                converted, needed = pending.popleft().result()
                try:
                    yield converted
                finally:
                    budget.release(needed)
        finally:
            # Left early (strict, or an error): the queued images are not converted; those running
            # finish, and the budget's waiters are let through to end.
            for future in pending:
                future.cancel()
            budget.open()


def _write_shard(path, converted, num_classes, progress):
    """The local writer's shard: `write_shard` of its converted images, counted as taken up."""

    def counted():
        for image in converted:
            if progress is not None:
                progress(1)
            yield image

    return write_shard(path, counted(), num_classes)


def _counter(progress, total):
    """`add(n)`, which hands the running count of images taken up to `progress`."""
    if progress is None:
        return None
    done = 0

    def add(n):
        nonlocal done
        done += n
        progress(done, total)

    return add


class _ProgressLine:
    """The command line's progress: images taken up, rate and time left, on one line rewritten in
    place on a terminal, or a line every `interval` seconds in a log."""

    def __init__(self, stream=sys.stderr, interval=None):
        self.stream, self.terminal = stream, stream.isatty()
        self.interval = interval if interval is not None else (0.5 if self.terminal else 30.0)
        self.started = self.shown = time.monotonic()

    def __call__(self, done, total):
        now = time.monotonic()
        if now - self.shown < self.interval and done < total:
            return
        self.shown, rate = now, done / max(now - self.started, 1e-9)
        left = (total - done) / rate
        line = f"images: {done:,}/{total:,} ({done / total:.0%}), {rate:,.0f}/s, {left:,.0f} s left"
        end = "\n" if done == total or not self.terminal else ""
        if self.terminal:
            line = "\r" + line.ljust(72)  # over the longer line it replaces
        print(line, end=end, file=self.stream, flush=True)


def _stop_at_first_fault(converted):
    """`converted`, ending with an error naming the first image that cannot be stored (strict)."""
    for image in converted:
        if image.record is None and image.skip_reason in IMAGE_FAULTS:
            raise ValueError(f"strict: {shown(image.path)} cannot be stored: {image.skip_reason}. Remove or fix it, or run without strict to skip it.")
        yield image


def _write_shards_locally(plan, staging_dir, num_threads, progress):
    """The local writer: the shards of `plan` written into `staging_dir`, one after another, from
    one decoding pipeline over all their images."""
    taken = _counter(progress, plan.num_images)
    converted = _converted_images(plan, num_threads)
    if plan.strict:
        converted = _stop_at_first_fault(converted)
    return [
        _write_shard(
            os.path.join(staging_dir, shard.staging_name),
            itertools.islice(converted, len(shard.images)),
            len(plan.class_names),
            taken,
        )
        for shard in plan.shards
    ]


def write_tfrecords(
    image_dir: str,
    output_dir: str,
    num_shards: int | None = None,
    *,
    validation_fraction: float | None = None,
    validation_dir: str | None = None,
    num_validation_shards: int | None = None,
    label_offset: int = 1,
    seed: int = 0,
    strict: bool = False,
    overwrite: bool = False,
    num_threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    beam_options=None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    follow_links: bool = False,
) -> TFRecordSummary:
    """Writes the images of `image_dir/<class>/` as `train-*` and `validation-*` TFRecord shards.

    The validation images are drawn per class (stratified) with `seed`; within each split the image
    order is shuffled before sharding, so every shard mixes all classes. See the module docstring
    for what is checked and how the output appears atomically. The same folder, seed and shard
    counts give the same files, whether the local writer or a Beam pipeline writes them.

    Args:
      image_dir: a folder with one sub-folder of images per class.
      output_dir: the folder to create with the shards, `labels.json`, `labels.txt` and
        `skipped.json`.
      num_shards: training shards (default: `default_num_shards` of the image count). Use at least
        as many as input pipelines (hosts) that will read them. Capped at the image count.
      validation_fraction: the share of each class's images that goes to `validation-*` (default
        0.1; 0 writes no validation split). Not with `validation_dir`.
      validation_dir: a folder of class sub-folders holding the validation images; every one of its
        classes must be a (non-empty) class of `image_dir`.
      num_validation_shards: validation shards (default: `default_num_shards` of their count).
      label_offset: the stored label of class 0 (1 matches the classic ImageNet files). The reader
        learns it from `labels.json`.
      seed: seed of the split and the shuffles.
      strict: fail, naming the files, instead of skipping files that are not images, undecodable
        images and empty class folders.
      overwrite: replace a conversion already in `output_dir`.
      num_threads: images read and decoded at once (default: the CPU count). Not with
        `beam_options`.
      progress: called as `progress(images_done, images_total)` as each image is taken up (from
        the local writer); the command line shows it as a progress line.
        Not with `beam_options` (the runner shows its own progress).
      beam_options: run the per-image work and the shard writing as an Apache Beam pipeline
        (`tpu_scale.data.beam_writer`) with these pipeline options: a
        `apache_beam.options.pipeline_options.PipelineOptions`, or a string of comma-separated
        `key=value` options ("runner=DirectRunner,direct_num_workers=2"). None: the local writer.
      max_pixels: images with more pixels (by their header, read before any decoder sees them)
        are skipped as decompression bombs. Default: 89,478,485, Pillow's own limit (0.25 GiB as
        RGB, about 9500 x 9500).
      max_file_bytes: files larger than this are skipped without being read whole. Default 64 MiB.
      follow_links: take links whose target is outside `image_dir` (or `validation_dir`); by
        default they are skipped and named.

    The local writer's memory stays bounded whatever the files hold: about 3.5 GiB plus 0.1 GiB
    per thread at most with the default caps (`MEMORY_BUDGET_BYTES` for the large images, at least one
    at a time, and the decoding pipeline's small ones); a Beam worker holds one image of at most
    `max_file_bytes` and `max_pixels` per conversion it runs at once.

    Returns:
      A `TFRecordSummary`; `summary.describe()` is the report `main` prints.

    Raises:
      ValueError: if the folders are not class folders, no image is usable, `output_dir` holds
        something that must not be replaced, (with `strict=True`) any file or class folder was
        skipped (the local writer stops at the first image that cannot be stored, naming it), or
        `beam_options` are not valid Beam pipeline options.
      ImportError: `beam_options` is given and Apache Beam is not installed.
    """
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be an integer >= 1 (images decoded at once), or None for the CPU count; received {num_threads!r}.")
    if beam_options is not None:
        if num_threads is not None or progress is not None:
            raise ValueError("num_threads and progress are the local writer's, not with beam_options: set the runner's workers in its options (direct_num_workers=2 for the DirectRunner).")
        from tpu_scale.data import beam_writer

        beam_options = beam_writer.pipeline_options(beam_options)
    output_dir = os.fspath(output_dir).rstrip("/") or "/"
    plan = plan_conversion(
        image_dir,
        num_shards,
        validation_fraction=validation_fraction,
        validation_dir=validation_dir,
        num_validation_shards=num_validation_shards,
        label_offset=label_offset,
        seed=seed,
        strict=strict,
        max_pixels=max_pixels,
        max_file_bytes=max_file_bytes,
        follow_links=follow_links,
    )
    replace = check_output_dir(output_dir, overwrite)
    remove_stale_staging_dirs(output_dir)
    staging_dir = make_staging_dir(output_dir)
    try:
        if beam_options is None:
            results = _write_shards_locally(plan, staging_dir, num_threads, progress)
        else:
            written = beam_writer.write_shards(
                plan, staging_dir, beam_options, convert_image=convert_image, write_shard=write_shard
            )
            results = [ShardResult(**fields) for fields in written]
        return finish_conversion(plan, results, staging_dir, output_dir, replace)
    except BaseException:
        remove_tree(staging_dir)
        raise


def image_folder_records(
    image_dir: str, records_dir: str, *, seed: int = 0, strict: bool = False
) -> str:
    """The records of a folder of class folders of images, converted on first use.

    `data.inputs`' path from a folder of images: `write_tfrecords` with its defaults
    (a stratified 10% validation split) into `records_dir`, its report logged (every skipped file
    named); a `records_dir` that already holds a finished conversion (its `labels.json` written) is
    used as it is, so a resumed run reads the records its first start wrote. Delete `records_dir`
    to convert the folder again.

    Args:
      image_dir: a folder with one sub-folder of images per class.
      records_dir: the folder of the records (created).
      seed: seed of the validation split and the shuffles.
      strict: fail, naming them, instead of skipping files that are not usable images.

    Returns:
      `records_dir`.

    Raises:
      ValueError: as `write_tfrecords` does (no class folders, no usable image, ...).
    """

    if tf.io.gfile.exists(os.path.join(records_dir, LABEL_MAP_FILE)):
        logger.info(
            f"Reading the records of {inline(image_dir)} written earlier to {inline(records_dir)} "
            "(delete that folder to convert the images again)."
        )
        return records_dir
    start = time.monotonic()
    summary = write_tfrecords(image_dir, records_dir, seed=seed, strict=strict)
    logger.info(f"{summary.describe()}\n  in {time.monotonic() - start:.1f} s")
    return records_dir


def _mib_to_bytes(mib):
    if not mib > 0:
        raise ValueError(f"--max_file_mib must be a positive number of MiB (the largest image file read), got {mib}.")
    return max(1, int(mib * 2**20))


def main(argv: Sequence[str] | None = None) -> TFRecordSummary:
    """The command line: converts, prints the summary; errors exit with status 1 and one message."""
    parser = argparse.ArgumentParser(
        prog="python -m tpu_scale.data.convert",
        description="Turns a folder of class sub-folders of images (IMAGE_DIR/<class>/<image>) "
        "into TFRecord shards in the classic ImageNet layout (train-*, validation-*), with "
        "labels.json, labels.txt and skipped.json beside them.",
        epilog="Memory: no file above --max_file_mib is read whole and no image above "
        "--max_pixels is decoded; the large images wait for a 2 GiB budget, so with the default "
        "caps the conversion stays under about 3.5 GiB plus 0.1 GiB per thread (--num_threads), "
        "whatever the files hold. Files skipped (bombs, files above the cap, links out of the "
        "folder, pipes, broken images) are named and counted in the summary and skipped.json.",
    )
    parser.add_argument(
        "--image_dir", required=True, help="folder with one sub-folder of images per class"
    )
    parser.add_argument("--output_dir", required=True, help="folder to create with the shards")
    parser.add_argument(
        "--validation_fraction",
        type=float,
        default=None,
        help=f"share of each class held out as validation-* (default "
        f"{DEFAULT_VALIDATION_FRACTION}; 0: none)",
    )
    parser.add_argument(
        "--validation_dir", help="folder of class sub-folders with the validation images"
    )
    parser.add_argument(
        "--num_shards", type=int, help="training shards (default: from the image count)"
    )
    parser.add_argument(
        "--num_validation_shards", type=int, help="validation shards (default: from the count)"
    )
    parser.add_argument(
        "--label_offset", type=int, default=1, help="stored label of class 0 (default 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the shuffles")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail on any file or class folder skipped, naming it (the local writer stops at the "
        "first image it cannot store)",
    )
    parser.add_argument(
        "--max_pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="skip images with more pixels than this, by their header, before any decoder sees "
        f"them (decompression bombs; default {DEFAULT_MAX_PIXELS:,}, Pillow's own limit)",
    )
    parser.add_argument(
        "--max_file_mib",
        type=float,
        default=DEFAULT_MAX_FILE_BYTES / 2**20,
        help="skip files larger than this many MiB without reading them whole (default "
        f"{DEFAULT_MAX_FILE_BYTES // 2**20})",
    )
    parser.add_argument(
        "--follow_links",
        action="store_true",
        help="take links whose target is outside the image folder (skipped and named by default)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a conversion in output_dir"
    )
    parser.add_argument(
        "--num_threads", type=int, help="images decoded at once (default: the CPU count)"
    )
    parser.add_argument(
        "--beam_pipeline_options",
        help="run as an Apache Beam pipeline with these pipeline options, key=value pairs "
        'separated by commas, e.g. "runner=DirectRunner,direct_num_workers=2" (needs '
        'pip install -e ".[beam]")',
    )
    args = parser.parse_args(argv)
    tf.config.list_physical_devices()  # TensorFlow's start-up lines, before any image's
    try:
        summary = write_tfrecords(
            args.image_dir,
            args.output_dir,
            args.num_shards,
            validation_fraction=args.validation_fraction,
            validation_dir=args.validation_dir,
            num_validation_shards=args.num_validation_shards,
            label_offset=args.label_offset,
            seed=args.seed,
            strict=args.strict,
            overwrite=args.overwrite,
            num_threads=args.num_threads,
            progress=None if args.beam_pipeline_options is not None else _ProgressLine(),
            beam_options=args.beam_pipeline_options,
            max_pixels=args.max_pixels,
            max_file_bytes=_mib_to_bytes(args.max_file_mib),
            follow_links=args.follow_links,
        )
    except (ValueError, ImportError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(summary.describe())
    return summary


if __name__ == "__main__":
    main()
