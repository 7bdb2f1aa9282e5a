"""The records the input-pipeline benchmarks read: ImageNet-like JPEGs in TFRecord shards.

    from input_data import generate_records
    info = generate_records("/tmp/records", num_images=1024, num_shards=16)

Generated once per folder and reused (a `DONE` file holds their description). The images are
mostly 500x375 landscape (some portrait and other aspect ratios), JPEG quality 90, either
multi-scale noise that compresses like a photograph (about 100 KB each) or views of real photographs
(`images="photos"`: scikit-learn's two sample photos cut into ImageNet-sized windows). Beside the
shards: the `labels.json` that `tpu_scale.data.write_tfrecords` writes (each file's record count
among its contents), and a `classic/` folder linking the same shards without it, as the classic
ImageNet conversion leaves them.
"""

import json
import os


def _natural_image(rng, height, width):
    """Smooth structure at several scales plus fine texture: compresses like a photograph."""
    import numpy as np
    import tensorflow as tf

    image = np.zeros((height, width, 3), np.float32)
    for cells, amplitude in ((4, 60.0), (16, 35.0), (64, 20.0), (160, 12.0)):
        coarse = rng.normal(size=(max(2, height * cells // 375), max(2, width * cells // 500), 3))
        image += (
            amplitude
            * tf.image.resize(coarse[None].astype(np.float32), (height, width), "bicubic")[0]
        )
    image += rng.normal(size=(height, width, 3)).astype(np.float32) * 16.0
    image += rng.uniform(60, 190, size=3).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _photo_crops(rng, shapes):
    """Real photographs (scikit-learn's two sample photos, 427x640) cut into ImageNet-sized views:
    a random window of each shape, resized by up to 20% either way and maybe mirrored, so that no
    two images are alike. Yields uint8 arrays."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    while True:
        photo = photos[rng.integers(len(photos))]
        height, width = shapes[rng.integers(len(shapes))]
        scale = rng.uniform(0.8, 1.2)
        # A window of the photo that, resized by `scale`, gives (height, width) (capped to fit).
        window_h = min(photo.shape[0], round(height / scale))
        window_w = min(photo.shape[1], round(width / scale))
        top = rng.integers(photo.shape[0] - window_h + 1)
        left = rng.integers(photo.shape[1] - window_w + 1)
        view = photo[top : top + window_h, left : left + window_w]
        view = tf.image.resize(view, (height, width), antialias=True).numpy()
        if rng.integers(2):
            view = view[:, ::-1]
        yield np.clip(np.round(view), 0, 255).astype(np.uint8)


def generate_records(directory, num_images, num_shards, seed=0, images="noise"):
    """Writes `num_images` ImageNet-like JPEGs into `num_shards` TFRecord files (once; reused).

    Args:
      directory: the folder of the shards; a folder already holding them is reused.
      num_images: JPEGs to write; example i goes to shard i % num_shards.
      num_shards: TFRecord files.
      seed: the images' random generator.
      images: "noise" (generated multi-scale noise that compresses like a photograph) or "photos"
        (views of real photographs, `_photo_crops`).

    Returns:
      A dict: `pattern` and `classic_pattern` (the same shards without `labels.json`), the
      number of images and shards, the mean JPEG size, the quality and the kind of images.
    """
    import numpy as np
    import tensorflow as tf

    from tpu_scale.data.schema import make_example

    done = os.path.join(directory, "DONE")
    if os.path.exists(done):
        with open(done) as f:
            info = json.load(f)
        return _with_label_map(directory, info)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    # Mostly landscape 500x375, as in ImageNet; some portrait and other aspect ratios.
    shapes = [(375, 500)] * 6 + [(500, 375), (333, 500), (400, 500), (375, 450)]
    photos = _photo_crops(rng, shapes) if images == "photos" else None
    sizes = []
    writers = [
        tf.io.TFRecordWriter(os.path.join(directory, f"train-{i:05d}-of-{num_shards:05d}"))
        for i in range(num_shards)
    ]
    for index in range(num_images):
        if photos is None:
            height, width = shapes[rng.integers(len(shapes))]
            pixels = _natural_image(rng, height, width)
        else:
            pixels = next(photos)
            height, width = pixels.shape[:2]
        jpeg = tf.io.encode_jpeg(pixels, quality=90).numpy()
        sizes.append(len(jpeg))
        example = make_example(jpeg, 1 + index % 1000, height=height, width=width)
        writers[index % num_shards].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    info = {
        "pattern": os.path.join(directory, "train-*"),
        "num_images": num_images,
        "num_shards": num_shards,
        "mean_jpeg_kb": round(sum(sizes) / len(sizes) / 1000, 1),
        "quality": 90,
        "images": images,
    }
    with open(done, "w") as f:
        json.dump(info, f)
    return _with_label_map(directory, info)


def _with_label_map(directory, info):
    """Adds what `write_tfrecords` writes beside its shards (`labels.json`, with each file's record
    count) and a `classic/` folder that links the same shards without it, as the classic ImageNet
    conversion leaves them (the reader then counts each file's bytes). Returns `info` with the
    pattern of the classic files."""
    from tpu_scale.data.schema import LABEL_MAP_FILE, write_label_map

    num_images, num_shards = info["num_images"], info["num_shards"]
    names = [f"train-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
    if not os.path.exists(os.path.join(directory, LABEL_MAP_FILE)):
        # Example i went to shard i % num_shards.
        counts = {name: len(range(i, num_images, num_shards)) for i, name in enumerate(names)}
        write_label_map(
            directory, [f"class_{i}" for i in range(1000)], 1, {"train": num_images}, None, counts
        )
    classic = os.path.join(directory, "classic")
    os.makedirs(classic, exist_ok=True)
    for name in names:
        if not os.path.lexists(os.path.join(classic, name)):
            os.symlink(os.path.join(directory, name), os.path.join(classic, name))
    return dict(info, classic_pattern=os.path.join(classic, "train-*"))
