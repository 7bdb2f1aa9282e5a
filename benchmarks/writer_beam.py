"""The own-images writer on Apache Beam against the local writer: images/s on the same folder.

Claim measured: what `--beam_pipeline_options` costs or gains on one machine, where the local
writer is the baseline. The folder is real: a dataset shipped in a pip package written
as class folders of JPEG and PNG files with two broken files among them (`datasets.write_folder`;
elpv by default: 2,624 solar-cell scans of 300x300). In one process (TensorFlow loaded once), in
interleaved rounds, each round converts the folder with:

  local       `write_tfrecords(...)`: the local writer (a `tf.data` pipeline decoding in parallel);
  beam_2proc  `beam_options="runner=DirectRunner,direct_num_workers=2,direct_running_mode=
              multi_processing"`: Beam's DirectRunner with 2 worker processes (each loads
              TensorFlow and the package when the pipeline starts, as a cluster's workers do);
  beam_1proc  `beam_options="runner=DirectRunner"` (in memory, in this process): Beam's own
              cost without worker processes.

images/s counts the image files taken up (the broken ones too) over the wall time of the whole
call (listing, conversion, publishing). The fixed start-up cost of a pipeline is measured apart on
a folder of 20 images (`*_small`), so that the rate at scale can be told from it:
`steady = (N - 20) / (t_N - t_20)`. Every Beam output is checked to be the local writer's files,
byte for byte.

Needs Apache Beam (`pip install -e ".[beam]"`, see the README for its environment). Usage:

    flock /tmp/tpu_scale_timing.lock python benchmarks/writer_beam.py [--rounds 3] [--dataset elpv]

Writes `benchmarks/results/writer_beam.json`.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

from common import folder_files, machine_info, save_result, spread, summarize  # noqa: E402

METHODS = {
    "local": None,
    "beam_2proc": "runner=DirectRunner,direct_num_workers=2,direct_running_mode=multi_processing"
    ",default_sdk_harness_log_level=WARNING",
    "beam_1proc": "runner=DirectRunner,direct_running_mode=in_memory",
}
SMALL = 20


def _small_folder(folder, small):
    """The first `SMALL` images of `folder`, two classes, as a folder of its own."""
    taken = 0
    for class_name in sorted(os.listdir(folder))[:2]:
        os.makedirs(os.path.join(small, class_name))
        for name in sorted(os.listdir(os.path.join(folder, class_name)))[: SMALL // 2]:
            shutil.copy(os.path.join(folder, class_name, name), os.path.join(small, class_name))
            taken += 1
    return taken


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dataset", default="elpv")
    args = parser.parse_args()

    import apache_beam  # noqa: F401  (fails here, before the folder is written, without Beam)
    import datasets

    from tpu_scale.data import write_tfrecords

    with tempfile.TemporaryDirectory(prefix="tpu_scale_bench_writer_") as work:
        folder, small = os.path.join(work, "images"), os.path.join(work, "small")
        num_images = datasets.write_folder(args.dataset, folder, broken_files=True) + 2
        num_small = _small_folder(folder, small)
        counter = [0]

        def convert(image_dir, options):
            counter[0] += 1
            out = os.path.join(work, f"out{counter[0]}")
            start = time.perf_counter()
            write_tfrecords(image_dir, out, beam_options=options)
            seconds = time.perf_counter() - start
            return seconds, out

        reference = {}
        times = {f"{name}{size}": [] for name in METHODS for size in ("", "_small")}
        identical = True
        convert(small, METHODS["local"])  # warm-up: TensorFlow's first ops
        for _ in range(args.rounds):
            for name, options in METHODS.items():
                for size, image_dir in (("", folder), ("_small", small)):
                    seconds, out = convert(image_dir, options)
                    times[name + size].append(seconds)
                    files = folder_files(out)
                    identical &= reference.setdefault(size, files) == files
                    shutil.rmtree(out)
                    print(f"{name}{size}: {seconds:.1f} s", flush=True)

    rates = {name: [num_images / t for t in times[name]] for name in METHODS}
    steady = {
        name: [
            (num_images - num_small) / (big - little)
            for big, little in zip(times[name], times[name + "_small"])
        ]
        for name in METHODS
    }
    result = {
        "dataset": args.dataset,
        "images": num_images,
        "small_images": num_small,
        "rounds": args.rounds,
        "identical_files": identical,
        "seconds": {name: summarize(t) for name, t in times.items()},
        "images_per_s": {
            name: summarize(rates[name], rates["local"] if name != "local" else None)
            for name in METHODS
        },
        "ratio_per_round": {
            name: spread([r / base for r, base in zip(rates[name], rates["local"])])
            for name in METHODS
            if name != "local"
        },
        "steady_images_per_s": {
            name: summarize(steady[name], steady["local"] if name != "local" else None)
            for name in METHODS
        },
        "start_up_seconds": {name: statistics.median(times[name + "_small"]) for name in METHODS},
        "machine": machine_info(),
    }
    save_result("writer_beam", result)


if __name__ == "__main__":
    main()
