"""The own-images local writer: images/s of its decoding pipeline against the per-image path.

Claim measured: the local writer (`write_tfrecords` without Beam) reads and decodes the images in a
`tf.data` pipeline, outside Python's global lock, and only the header checks and the records are
left to Python. The baseline, measured in the same process and interleaved with it, is the same
conversion image after image: `convert_image` then `write_shard` per planned shard, the path a
Beam worker runs, in one Python thread (`per_image`) and in two, one a core, sharing the shards
(`per_image_2_threads`: the local writer before its pipeline). All write the same files, byte for
byte; that is checked every round.

The folders are real: datasets shipped in pip packages written as class folders of JPEG and PNG
files, with two broken files among them (`datasets.write_folder`): `mnist5k` (5,000 small
28x28 images: the per-image overhead) and `elpv` (2,624 solar-cell scans of 300x300: the
decoding), and `rotated_photos` (200 camera-style 400x600 JPEGs whose EXIF tag says they are
turned: each is decoded, turned and re-encoded by Pillow and TensorFlow in Python, the work the
pipeline leaves to Python). images/s counts the files taken up (the broken ones too) over the
wall time of the whole call (listing, conversion, publishing).

Usage:

    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/writer_local.py [--rounds 5] [--datasets ...]

Writes `benchmarks/results/writer_local.json`.
"""

import argparse
import concurrent.futures
import os
import shutil
import tempfile
import time

from common import folder_files, machine_info, save_result, spread, summarize  # noqa: E402

METHODS = ("pipeline", "per_image", "per_image_2_threads")


def _per_image(image_dir, output_dir, threads=1):
    """The conversion image after image, the shards shared by `threads` threads, with the writers'
    shared steps."""
    from tpu_scale.data import convert as writer
    from tpu_scale.data import output_dir as out

    plan = writer.plan_conversion(image_dir, None)
    staging = out.make_staging_dir(output_dir)

    def write(shard):
        return writer.write_shard(
            os.path.join(staging, shard.staging_name),
            (
                writer.convert_image(path, class_id, plan.class_names, plan.label_offset)
                for path, class_id in shard.images
            ),
            len(plan.class_names),
        )

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(write, plan.shards))
    writer.finish_conversion(plan, results, staging, output_dir, replace=False)


def _rotated_photos(folder, count=200):
    """`count` camera-style JPEGs (scikit-learn's two sample photos, 427x640, each in 10 crops)
    whose EXIF orientation says they are turned (6, 8, 3): the writer decodes, turns and
    re-encodes each."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    for i in range(count):
        photo = load_sample_image(("china.jpg", "flower.jpg")[i % 2])
        tags = Image.Exif()
        tags[0x0112] = (6, 8, 3)[i % 3]
        offset = 4 * (i // 2 % 10)
        image = Image.fromarray(photo[offset : offset + 400, offset : offset + 600])
        os.makedirs(os.path.join(folder, f"class_{i % 2}"), exist_ok=True)
        image.save(
            os.path.join(folder, f"class_{i % 2}", f"photo_{i:04d}.jpg"),
            "JPEG",
            quality=90,
            exif=tags.tobytes(),
        )
    return count


def measure(dataset, rounds, work):
    import datasets

    from tpu_scale.data import write_tfrecords

    folder = os.path.join(work, dataset)
    if dataset == "rotated_photos":
        num_images = _rotated_photos(folder)
    else:
        num_images = datasets.write_folder(dataset, folder, broken_files=True) + 2
    convert = {
        "pipeline": write_tfrecords,
        "per_image": _per_image,
        "per_image_2_threads": lambda folder, out: _per_image(folder, out, threads=2),
    }
    times = {name: [] for name in METHODS}
    identical, reference = True, None
    for round_ in range(rounds + 1):  # round 0 warms TensorFlow's ops and the file cache
        for name in METHODS if round_ % 2 else reversed(METHODS):
            out = os.path.join(work, f"out_{name}")
            start = time.perf_counter()
            convert[name](folder, out)
            seconds = time.perf_counter() - start
            files = folder_files(out)
            reference = reference or files
            identical &= files == reference
            shutil.rmtree(out)
            if round_:
                times[name].append(seconds)
                print(f"{dataset} {name}: {seconds:.2f} s", flush=True)
    rates = {name: [num_images / t for t in times[name]] for name in METHODS}
    return {
        "images": num_images,
        "identical_files": identical,
        "seconds": {name: summarize(times[name]) for name in METHODS},
        "images_per_s": {
            name: summarize(rates[name], rates["per_image"] if name != "per_image" else None)
            for name in METHODS
        },
        "speedup_per_round": {
            baseline: spread([p / b for p, b in zip(rates["pipeline"], rates[baseline])])
            for baseline in METHODS[1:]
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--datasets", nargs="+", default=["mnist5k", "elpv", "rotated_photos"])
    args = parser.parse_args()
    result = {"rounds": args.rounds, "datasets": {}, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="tpu_scale_bench_writer_local_") as work:
        for dataset in args.datasets:
            result["datasets"][dataset] = measure(dataset, args.rounds, work)
    save_result("writer_local", result)


if __name__ == "__main__":
    main()
