"""What the two writers of a folder of class folders share: the conversion itself.

`write_tfrecords` (a local `tf.data` decoding pipeline) and `beam_writer` (an Apache Beam
pipeline) differ only in who does the per-image work and writes the shard files. Everything else
is here, so that the same folder and seed give the same files, byte for byte, whichever writer
ran:

  plan_conversion     the split, the label map and the shards, computed once from the listing
  convert_image       the per-image work: read, decode in full, turn upright, re-encode, record
  write_shard         one planned shard's records written in the plan's order, and its counts
  finish_conversion   the written shards named, `labels.json` and `skipped.json` written beside
                      them, the staging folder published; the `TFRecordSummary`
"""

import dataclasses
import json
import math
import os
import random
from collections.abc import Iterable, Sequence

import tensorflow as tf

from tpu_scale._files import is_local
from tpu_scale.data.image_folder import (
    DEFAULT_MAX_FILE_BYTES,
    IMAGE_EXTENSIONS,
    TOO_LARGE,
    list_class_folders,
)
from tpu_scale.data.names import inline, shown, stored
from tpu_scale.data.output_dir import SKIPPED_FILE, publish
from tpu_scale.data.reencode import (
    CORRUPT_JPEG,
    DEFAULT_MAX_PIXELS,
    TOO_MANY_PIXELS,
    UNDECODABLE,
    UNREADABLE,
    Decoded,
    Skip,
    checked_jpeg,
)
from tpu_scale.data.schema import LABEL_MAP_FILE, make_example, write_label_map

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
    """

    path: str
    class_id: int
    record: bytes | None
    reencoded: bool = False
    skip_reason: str | None = None


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
    return ConvertedImage(image_path, class_id, record, was_reencoded)


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
    """

    written: int
    reencoded: int
    class_counts: list[int]
    skipped: dict[str, list[str]]


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
    num_reencoded = 0
    for shard, result in zip(plan.shards, results):
        path = os.path.join(staging_dir, shard.staging_name)
        num_reencoded += result.reencoded
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
        staging_dir, class_names, plan.label_offset, split_counts, class_counts, record_counts
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
    )
