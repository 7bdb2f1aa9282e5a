"""Turns a folder of class sub-folders of images into TFRecord shards in the classic ImageNet layout.

    python -m tpu_scale.data.write_tfrecords --image_dir photos/train --output_dir records --num_shards 16

`photos/train/<class name>/<image>` becomes `records/train-00000-of-00016` ... with one `tf.train.Example`
per image: `image/encoded` (JPEG bytes), `image/class/label` (int64, `label_offset` + the class's index in
sorted folder order, so 1-based by default like the ImageNet files), `image/class/synset` (the folder name),
`image/filename`, `image/height`, `image/width`, `image/format`. `labels.txt` lists the class names in label
order. JPEGs are stored byte for byte; other formats (PNG, GIF, BMP, WebP) and CMYK JPEGs are re-encoded as
RGB JPEGs, because the input pipeline's fused decode reads JPEG only.
"""

import argparse
import concurrent.futures
import dataclasses
import os
import random
from typing import List, Optional

import tensorflow as tf

from tpu_scale.data.schema import make_example

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")
_REENCODE_QUALITY = 95


@dataclasses.dataclass
class TFRecordSummary:
    """What `write_tfrecords` wrote."""

    paths: List[str]
    num_examples: int
    class_names: List[str]
    num_reencoded: int


def as_rgb_jpeg(image_bytes, path=""):
    """Returns `(jpeg_bytes, height, width, reencoded)`: JPEG bytes the pipeline can decode.

    Args:
      image_bytes: the file's bytes (JPEG, PNG, GIF, BMP or WebP).
      path: the file's path, for error messages.

    Returns:
      The JPEG bytes (unchanged for grey or RGB JPEGs), the image height and width, and whether it was
      re-encoded.

    Raises:
      ValueError: if the bytes are not a decodable image.
    """
    try:
        if tf.io.is_jpeg(image_bytes):
            height, width, channels = tf.image.extract_jpeg_shape(image_bytes).numpy().tolist()
            if channels in (1, 3):
                return image_bytes, height, width, False
        image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    except tf.errors.InvalidArgumentError as error:
        raise ValueError(f"{path!r} is not a decodable image ({error.message.strip()}).") from None
    jpeg = tf.io.encode_jpeg(image, quality=_REENCODE_QUALITY).numpy()
    return jpeg, int(image.shape[0]), int(image.shape[1]), True


def _list_images(image_dir):
    if not tf.io.gfile.isdir(image_dir):
        raise ValueError(f"image_dir {image_dir!r} is not a directory.")
    class_names = sorted(
        name.rstrip("/")
        for name in tf.io.gfile.listdir(image_dir)
        if tf.io.gfile.isdir(os.path.join(image_dir, name))
    )
    if not class_names:
        raise ValueError(
            f"{image_dir!r} has no sub-folders: put each class's images in their own sub-folder "
            f"({image_dir}/<class name>/<image>.jpg)."
        )
    images = []
    for label_index, class_name in enumerate(class_names):
        class_dir = os.path.join(image_dir, class_name)
        for name in sorted(tf.io.gfile.listdir(class_dir)):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                images.append((os.path.join(class_dir, name), label_index, class_name))
    if not images:
        raise ValueError(
            f"No images ({', '.join(IMAGE_EXTENSIONS)}) in the class folders of {image_dir!r}."
        )
    return class_names, images


def _write_shard(path, images, label_offset):
    reencoded = 0
    with tf.io.TFRecordWriter(path) as writer:
        for image_path, label_index, class_name in images:
            with tf.io.gfile.GFile(image_path, "rb") as f:
                raw = f.read()
            jpeg, height, width, was_reencoded = as_rgb_jpeg(raw, image_path)
            reencoded += was_reencoded
            example = make_example(
                jpeg,
                label_index + label_offset,
                height=height,
                width=width,
                synset=class_name,
                filename=os.path.basename(image_path),
            )
            writer.write(example.SerializeToString())
    return reencoded


def write_tfrecords(
    image_dir: str,
    output_dir: str,
    num_shards: int = 16,
    *,
    prefix: str = "train",
    label_offset: int = 1,
    seed: int = 0,
    num_threads: Optional[int] = None,
) -> TFRecordSummary:
    """Writes the images of `image_dir/<class>/` as TFRecord shards in the classic ImageNet layout.

    The image order is shuffled (with `seed`) before sharding, so every shard mixes all classes.

    Args:
      image_dir: a folder with one sub-folder of images per class.
      output_dir: where the shards and `labels.txt` go (created if missing).
      num_shards: how many files; use at least as many as input pipelines (hosts) that will read them.
      prefix: shard file name prefix, e.g. `train` or `validation`.
      label_offset: the stored label of the first class (1 matches the classic ImageNet files and
        `ImageNetInput`'s default `label_offset=1`).
      seed: seed of the shuffle.
      num_threads: shards written at once (default: the CPU count).

    Returns:
      A `TFRecordSummary` with the shard paths, the example count, the class names and how many images
      were re-encoded.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}.")
    class_names, images = _list_images(image_dir)
    random.Random(seed).shuffle(images)
    tf.io.gfile.makedirs(output_dir)
    paths = [
        os.path.join(output_dir, f"{prefix}-{index:05d}-of-{num_shards:05d}") for index in range(num_shards)
    ]
    with concurrent.futures.ThreadPoolExecutor(num_threads or os.cpu_count()) as pool:
        reencoded = sum(
            pool.map(
                lambda index: _write_shard(paths[index], images[index::num_shards], label_offset),
                range(num_shards),
            )
        )
    with tf.io.gfile.GFile(os.path.join(output_dir, "labels.txt"), "w") as f:
        f.write("".join(name + "\n" for name in class_names))
    return TFRecordSummary(paths, len(images), class_names, reencoded)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image_dir", required=True, help="folder with one sub-folder of images per class")
    parser.add_argument("--output_dir", required=True, help="where to write the TFRecord shards")
    parser.add_argument("--num_shards", type=int, default=16)
    parser.add_argument("--prefix", default="train", help="shard name prefix (train, validation, ...)")
    parser.add_argument("--label_offset", type=int, default=1, help="stored label of the first class")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = write_tfrecords(
        args.image_dir,
        args.output_dir,
        args.num_shards,
        prefix=args.prefix,
        label_offset=args.label_offset,
        seed=args.seed,
    )
    print(
        f"Wrote {summary.num_examples} examples of {len(summary.class_names)} classes to "
        f"{len(summary.paths)} shards in {args.output_dir} ({summary.num_reencoded} re-encoded as JPEG)."
    )


if __name__ == "__main__":
    main()
