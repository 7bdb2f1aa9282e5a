"""The own-images local writer: images/s of its decoding pipeline against the per-image path.

Claim measured: the local writer (`write_tfrecords` without Beam) reads and decodes the images in a
`tf.data` pipeline, outside Python's global lock, and only the header checks and the records are
left to Python. The baseline, measured in the same process and interleaved with it, is the same
conversion image after image in one Python thread: `convert_image` then `write_shard` per planned
shard, the path a Beam worker runs (and what each of the local writer's threads ran before). Both
write the same files, byte for byte; that is checked every round.

The folders are real: datasets shipped in pip packages written as class folders of JPEG and PNG
files, with two broken files among them (`datasets.write_folder`): `mnist5k` (5,000 small
28x28 images: the per-image overhead) and `elpv` (2,624 solar-cell scans of 300x300: the
decoding). images/s counts the files taken up (the broken ones too) over the wall time of the
whole call (listing, conversion, publishing).

Usage:

    flock /tmp/timing.lock python benchmarks/writer_local.py [--rounds 5] [--datasets mnist5k elpv]

Writes `benchmarks/results/writer_local.json`.
"""

import argparse
import os
import shutil
import tempfile
import time

from common import machine_info, save_result, spread, summarize  # noqa: E402

METHODS = ("pipeline", "per_image")


def _files(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def _per_image(image_dir, output_dir):
    """The conversion image after image in this thread, with the writers' shared steps."""
    from tpu_scale.data import conversion
    from tpu_scale.data import output_dir as out

    plan = conversion.plan_conversion(image_dir, None)
    staging = out.make_staging_dir(output_dir)
    results = [
        conversion.write_shard(
            os.path.join(staging, shard.staging_name),
            (
                conversion.convert_image(path, class_id, plan.class_names, plan.label_offset)
                for path, class_id in shard.images
            ),
            len(plan.class_names),
        )
        for shard in plan.shards
    ]
    conversion.finish_conversion(plan, results, staging, output_dir, replace=False)


def measure(dataset, rounds, work):
    import datasets

    from tpu_scale.data import write_tfrecords

    folder = os.path.join(work, dataset)
    num_images = datasets.write_folder(dataset, folder, broken_files=True) + 2
    convert = {"pipeline": write_tfrecords, "per_image": _per_image}
    times = {name: [] for name in METHODS}
    identical, reference = True, None
    for round_ in range(rounds + 1):  # round 0 warms TensorFlow's ops and the file cache
        for name in METHODS if round_ % 2 else reversed(METHODS):
            out = os.path.join(work, f"out_{name}")
            start = time.perf_counter()
            convert[name](folder, out)
            seconds = time.perf_counter() - start
            files = _files(out)
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
        "speedup_per_round": spread(
            [p / b for p, b in zip(rates["pipeline"], rates["per_image"])]
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--datasets", nargs="+", default=["mnist5k", "elpv"])
    args = parser.parse_args()
    result = {"rounds": args.rounds, "datasets": {}, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="tpu_scale_bench_writer_local_") as work:
        for dataset in args.datasets:
            result["datasets"][dataset] = measure(dataset, args.rounds, work)
    save_result("writer_local", result)


if __name__ == "__main__":
    main()
