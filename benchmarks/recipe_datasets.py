"""The recipe's defaults against a sweep and against plain Keras, on real datasets it was tuned on
and on datasets it never saw.

Claim: at global batches 64, 256, 512 and 1024, `tpu_scale.recipe.recipe_for_batch` with what
the run knows (batch, epochs, steps per epoch, training examples) ends within 2 points of the best
setting swept around it, on every dataset, and no run diverges.

Data (`benchmarks/datasets.py`: real images shipped inside pip packages, written as a folder of
PNG and JPEG files and converted by the package's writer, its stratified 10% validation split):
the tuning sets `digits` (8x8, trained at 32 px) and `animals` (28x28, at 28 px), on which the
defaults were chosen, and the held-out sets `mnist5k` (28x28, at 32 px) and `elpv` (300x300, at
64 px), looked at only to check them.

Variants, each a fresh model trained with `model.fit` on this host's fastest layout (one replica,
`tpu_scale.create_strategy(num_cpu_replicas=1)`), the package's input pipeline with the recipe's
augmentation, `tpu_scale.models.small_resnet`, for 15 epochs (batches up to 256) or 30 (512 on):

    default    `recipe_for_batch(batch, epochs, train_examples=...)`, as it comes.
    lr*F       the default with its peak learning rate times F (the sweep: F in --lr_factors).
    adam       what a user writes by hand: the same small ResNet (on one device its batch norm is
               plain batch norm), `keras.optimizers.Adam()` with its defaults, no augmentation, no
               label smoothing, no strategy.

Per (dataset, batch): the final validation top-1 of each variant, the best of them, and the
default's distance to it. "Diverged" is a run whose final training loss is not finite or whose
top-1 ends at chance. With --trained_weights_too, a variant whose weights are evaluated as their
moving average (`Recipe.ema_momentum`) also records, every epoch of the same run, the top-1 of the
weights as trained (`trained_top_1_by_epoch`): the average against the weights it averages, on
one trajectory, free of run-to-run noise.

Usage:
    nice -n 5 python benchmarks/recipe_datasets.py                           # everything
    nice -n 5 python benchmarks/recipe_datasets.py --datasets mnist5k --batches 64 512

Adds its runs to `benchmarks/results/recipe_datasets.json` (a run of the same dataset, batch,
variant and seed replaces the earlier one).
"""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import datasets  # noqa: E402
from common import RESULTS, load_runs, record_run  # noqa: E402
from time_to_accuracy import PRACTISED_PEAK, PRACTISED_WEIGHT_DECAY  # noqa: E402

JSON_PATH = os.path.join(RESULTS, "recipe_datasets.json")
IMAGE_SIZES = {
    "digits": 32, "animals": 28, "animals10k": 28, "mnist5k": 32, "elpv": 64, "photodigits": 32, "photodigits22k": 32,
    "clipart": 64, "fontletters": 32, "photoletters": 32, "icons": 64,
}
BATCHES = (64, 256, 512, 1024)
LR_FACTORS = (0.5, 2.0, 4.0)


def epochs_for(batch):
    return 15 if batch <= 256 else 30


def records_of(name, workdir):
    """The dataset as records written by the package's writer (made once per work folder)."""
    records = os.path.join(workdir, f"records_{name}")
    if not os.path.exists(os.path.join(records, "labels.json")):
        images = os.path.join(workdir, f"images_{name}")
        datasets.write_folder(name, images)
        subprocess.run(
            [sys.executable, "-m", "tpu_scale.data.convert", "--image_dir", images]
            + ["--output_dir", records, "--overwrite"],
            check=True,
            capture_output=True,
        )
    return records


def variant_recipe(recipe, variant):
    """The recipe of a variant: `default`, `lr*F` (the peak rate times F) or
    `with:name=value,...` (those settings of the recipe changed, e.g.
    `with:augmentation=light,weight_decay=5e-4`); the recipe itself for `adam` and `practised`."""
    if variant.startswith("lr*"):
        return dataclasses.replace(
            recipe, peak_learning_rate=recipe.peak_learning_rate * float(variant[3:])
        )
    if variant.startswith("with:"):
        types = {f.name: f.type for f in dataclasses.fields(recipe)}
        settings = {}
        for item in variant[5:].split(","):
            name, value = item.split("=")
            kind = types[name]
            if kind in (bool, "bool"):
                settings[name] = value.lower() in ("1", "true", "yes")
            elif kind in (float, "float"):
                settings[name] = float(value)
            else:
                settings[name] = value
        return dataclasses.replace(recipe, **settings)
    return recipe


def practised_optimizer(steps_per_epoch, epochs):
    """The optimizer a practised Keras user writes: AdamW (weight decay 1e-4), one epoch of linear
    warmup to 3e-3, then cosine decay to 0 (`CosineDecay(warmup_target=...)`)."""
    import keras

    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=steps_per_epoch * (epochs - 1),
        warmup_target=PRACTISED_PEAK,
        warmup_steps=steps_per_epoch,
    )
    return keras.optimizers.AdamW(schedule, weight_decay=PRACTISED_WEIGHT_DECAY)


def train_variants(
    name,
    records,
    batch,
    variants,
    seeds,
    lr_factors,
    trained_weights_too=False,
    epochs=None,
    replicas=1,
    bn_virtual_batch_size=None,
):
    """Trains every variant of one dataset and batch in this process; yields one run each."""
    import keras

    class EvaluateTrainedWeights(keras.callbacks.Callback):
        """The validation top-1 of the weights as trained, at every epoch's end (after
        `SwapEMAWeights` has put them back)."""

        def __init__(self, dataset):
            super().__init__()
            self.dataset, self.top_1 = dataset, []

        def on_epoch_end(self, epoch, logs=None):
            result = self.model.evaluate(self.dataset, verbose=0, return_dict=True)
            self.top_1.append(round(float(result["accuracy"]), 4))

    import tpu_scale
    from tpu_scale import data, losses, models
    from tpu_scale import recipe as recipe_lib
    from tpu_scale.callbacks import AverageMovingStatistics

    strategy = tpu_scale.create_strategy(num_cpu_replicas=replicas)
    label_map = data.read_label_map(records)
    train_examples = label_map.counts["train"]
    size, epochs = IMAGE_SIZES[name], epochs or epochs_for(batch)
    steps = max(1, train_examples // batch)
    recipe = recipe_lib.recipe_for_batch(
        batch, epochs, train_examples=train_examples, num_classes=label_map.num_classes
    )
    for seed in seeds:
        for variant in variants:
            keras.utils.set_random_seed(seed)
            start = time.perf_counter()
            by_hand = variant in ("adam", "practised")
            swept = variant_recipe(recipe, variant)
            trained = None  # the weights as trained, evaluated every epoch (--trained_weights_too)
            if by_hand:
                config = data.InputConfig(**recipe_lib.AUGMENTATIONS["none"])
            else:
                config = swept.input_config()
            inputs = dict(global_batch_size=batch, image_size=size)
            pattern = os.path.join(records, "{}-*")
            train = data.ImageNetInput(
                pattern.format("train"),
                is_training=True,
                config=config.replace(seed=seed),
                **inputs,
            )
            validation = data.ImageNetInput(
                pattern.format("validation"), is_training=False, config=config, **inputs
            )
            if by_hand:
                model = models.small_resnet(label_map.num_classes, input_shape=(size, size, 3))
                model.compile(
                    practised_optimizer(steps, epochs)
                    if variant == "practised"
                    else keras.optimizers.Adam(),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                )
                history = model.fit(
                    train.dataset(),
                    steps_per_epoch=steps,
                    epochs=epochs,
                    validation_data=validation.dataset(),
                    verbose=0,
                )
                peak = None
            else:
                peak = swept.peak_learning_rate
                with strategy.scope():
                    model = models.small_resnet(
                        label_map.num_classes,
                        input_shape=(size, size, 3),
                        bn_virtual_batch_size=bn_virtual_batch_size,
                    )
                    model.compile(
                        swept.build_optimizer(steps, epochs),
                        losses.SmoothedSparseCategoricalCrossentropy(
                            swept.label_smoothing, from_logits=True
                        ),
                        metrics=["accuracy"],
                    )
                distribute = strategy.distribute_datasets_from_function
                evaluated = distribute(validation.dataset)
                if trained_weights_too and swept.ema_momentum:
                    trained = EvaluateTrainedWeights(evaluated)
                history = model.fit(
                    distribute(train.dataset),
                    steps_per_epoch=steps,
                    epochs=epochs,
                    validation_data=evaluated,
                    callbacks=[AverageMovingStatistics(), *swept.callbacks()] + [trained] * bool(trained),
                    verbose=0,
                )
            top_1 = [round(float(v), 4) for v in history.history["val_accuracy"]]
            loss = float(history.history["loss"][-1])
            yield {
                "dataset": name,
                "held_out": name in datasets.HELD_OUT,
                "image_size": size,
                "batch": batch,
                "replicas": replicas,
                "bn_virtual_batch_size": bn_virtual_batch_size,
                "epochs": epochs,
                "steps_per_epoch": steps,
                "variant": variant,
                "seed": seed,
                "optimizer": variant if by_hand else swept.optimizer,
                "peak_learning_rate": peak,
                "warmup_epochs": None if by_hand else swept.warmup_epochs,
                "augmentation": "none" if by_hand else swept.augmentation,
                "weight_decay": None if by_hand else swept.weight_decay,
                "decay_power": None if by_hand else swept.decay_power,
                "ema_momentum": None if by_hand else swept.ema_momentum,
                "final_top_1": top_1[-1],
                "top_1_by_epoch": top_1,
                "trained_top_1_by_epoch": trained and trained.top_1,
                "final_loss": loss,
                "diverged": not math.isfinite(loss) or top_1[-1] <= 1.5 / label_map.num_classes,
                "seconds": round(time.perf_counter() - start, 1),
            }


def summarize(runs):
    """Per dataset and batch: the default's and the best variant's mean top-1 over seeds and the
    gap."""
    table = {}
    for run in runs:
        cell = table.setdefault(f"{run['dataset']}@{run['batch']}", {})
        cell.setdefault(run["variant"], []).append(run["final_top_1"])
    summary = {}
    for key, cell in sorted(table.items()):
        means = {variant: sum(v) / len(v) for variant, v in cell.items()}
        best = max(means, key=means.get)
        default = means.get("default")
        summary[key] = {
            "default": default,
            "best_variant": best,
            "best": means[best],
            "gap_points": None if default is None else round(100 * (means[best] - default), 2),
            "adam": means.get("adam"),
            "variants": means,
        }
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(datasets.NAMES))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--lr_factors", type=float, nargs="+", default=list(LR_FACTORS))
    parser.add_argument("--variants", nargs="+", help="default: default, lr*F for each F, adam")
    parser.add_argument("--epochs", type=int, help="instead of 15 up to batch 256, 30 from 512")
    parser.add_argument(
        "--replicas", type=int, default=1, help="virtual CPU replicas (batch norm over each's part)"
    )
    parser.add_argument(
        "--bn_virtual_batch_size", type=int, help="batch norm over runs of this many examples"
    )
    parser.add_argument("--workdir", help="keep the records here between runs")
    parser.add_argument("--out", default=JSON_PATH)
    parser.add_argument(
        "--trained_weights_too", action="store_true", help="also evaluate the unaveraged weights"
    )
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)  # dataset, batch
    args = parser.parse_args()
    variants = args.variants or (["default"] + [f"lr*{f:g}" for f in args.lr_factors] + ["adam"])
    if args._child:
        name, batch = args._child[0], int(args._child[1])
        records = records_of(name, args.workdir)
        runs = train_variants(
            name,
            records,
            batch,
            variants,
            args.seeds,
            args.lr_factors,
            args.trained_weights_too,
            args.epochs,
            args.replicas,
            args.bn_virtual_batch_size,
        )
        for run in runs:
            print("RUN " + json.dumps(run), flush=True)
        return 0

    out = load_runs(args.out)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tpu_scale_recipe_")
    for name in args.datasets:
        records_of(name, workdir)  # before any child, so children never write the same folder
        for batch in args.batches:
            # One process per dataset and batch: each holds its own strategy.
            command = [sys.executable, os.path.abspath(__file__), "--_child", name, str(batch)]
            command += ["--workdir", workdir, "--seeds", *map(str, args.seeds)]
            command += ["--epochs", str(args.epochs)] * bool(args.epochs)
            command += ["--replicas", str(args.replicas)]
            if args.bn_virtual_batch_size:
                command += ["--bn_virtual_batch_size", str(args.bn_virtual_batch_size)]
            command += ["--variants", *variants] + ["--trained_weights_too"] * args.trained_weights_too
            child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            for line in child.stdout:
                if not line.startswith("RUN "):
                    continue
                run = json.loads(line[4:])
                print(
                    f"{name}@{batch} {run['variant']:>8} seed {run['seed']}: top-1 "
                    f"{run['final_top_1']:.4f} ({run['seconds']:.0f} s)",
                    flush=True,
                )
                same = ("dataset", "batch", "variant", "seed")
                record_run(out, run, same, summarize, args.out)
            if child.wait():
                print(f"{name}@{batch}: the child failed (exit {child.returncode})", flush=True)
    for key, row in out.get("summary", {}).items():
        adam = "n/a" if row["adam"] is None else f"{row['adam']:.4f}"
        default = "n/a" if row["default"] is None else f"{row['default']:.4f}"
        print(
            f"{key:>16}: default {default}, best {row['best']:.4f} ({row['best_variant']}), "
            f"gap {row['gap_points']} points, adam {adam}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
