"""Time to accuracy from a folder of real images: the package's one command against the Keras
scripts a user would write by hand.

The paper's own measure, for a user's own images: wall seconds from launch until the validation
top-1 reaches a threshold, and the top-1 at the end. The clock starts when the folder of images is
all there is, for every contender.

Data (`benchmarks/datasets.py`, real images shipped inside pip and Debian packages, written as a folder of
class folders of PNG and JPEG files), the held-out sets none of the recipe's defaults were chosen
on: `mnist5k`, 5,000 handwritten digits at 28x28 (trained at 32 px), threshold 0.95; `elpv`, 2,624
solar-cell scans at 300x300 in four defect grades (at 64 px), threshold 0.7; `photodigits`, 5,000
colour MNIST-M-style digits on photo patches at 28x28 (at 32 px), threshold 0.8; `photodigits22k`,
22,500 more of them built from MNIST's training digits (at 32 px), threshold 0.9, also
at batch 512 (`--batch 512 --contenders package practised`); `clipart`, 3,037 drawings of the Open
Clip Art Library in eight categories at 64x64 (at 64 px), threshold 0.6; `fontletters`, the
letters A-J drawn in 250 typefaces, notMNIST-style, at 28x28 (at 32 px), threshold 0.8. The tuning
sets (`datasets.TUNING`) run here too, to compare rules before a held-out set is run: `icons`,
2,380 desktop icons in six classes at 64x64 (at 64 px), threshold 0.7, is the 64-pixel one.

Non-square folders (`datasets.NONSQUARE`, each image its own size and shape), to choose and check
how the package reads an image that is not square: `nsanimals` (tuning), 4,000 animal silhouettes
on 4:3 to 16:9 photo crops of either orientation (at 32 px), threshold 0.6; `nsphotodigits`
(held out), 5,000 MNIST digits so (at 32 px), threshold 0.8; `nsclipart` (held out), 681
drawings of seven Open Clip Art categories `clipart` does not use, in their own shapes (at 64 px,
40 epochs: 10 steps an epoch), threshold 0.4. `--aspect_ratio stretch|pad|crop` passes the package's example that flag (without
it, the package's own default reading); the runs and the dataset's entry record it, and the entry
is keyed by it too (`nsclipart@64 aspect_ratio=pad`), so each rule keeps its own runs.
`--augmentation auto|none|translate|shift|light|imagenet` passes the example its flag the same way
(recorded, and in the key: `nsanimals@64 aspect_ratio=stretch augmentation=shift`). The Keras
contenders read the folder as the practised script does whatever the flag:
`image_dataset_from_directory` resizes each whole image to the square, stretching it. The package's
folder also holds a cut-off JPEG and a text file named .jpg; the writer skips and names them. The
Keras contenders' folder has them removed (Keras's directory reader fails on them).

Contenders, each a fresh process started from here:

    package    the README's one command for a folder of images, with nothing else:
                   python examples/train_imagenet.py --image_dir IMAGES --image_size S
                       --epochs E --global_batch_size B --seed K --noprogress
               (the run converts the folder to records before it trains; that time counts).
    keras      plain Keras by hand, this script's own child (`--_keras --optimizer adam`): the
               folder read with `keras.utils.image_dataset_from_directory(validation_split=0.1,
               subset="both")`, the CIFAR-style ResNet a practised user writes for small images
               (`keras_resnet`: a 3x3 stem that keeps 32x32, stride 1 at 32 px, then 3 stages of
               one basic block, 16, 32, 64 wide, about 80K parameters, Keras
               `BatchNormalization`), `Adam()` with its defaults, `fit` on one device, no
               strategy, no augmentation.
    practised  the script a practised Keras user writes (`--optimizer practised`): the same
               folder, split, model and `fit`, with `AdamW(weight_decay=1e-4)` on one epoch of
               linear warmup to 3e-3 (at batch 64; times sqrt(batch / 64) at other batches) and
               cosine decay to 0 (`keras.optimizers.schedules.CosineDecay(0.0, ...,
               warmup_target=...)`).

Each contender's compute per image (`multiply_adds`: the multiply-adds of its convolutions and
dense layers for one image, counted from the built model's layer shapes) is reported with it: the
package's `small_resnet` has a stride-2 stem, max-pooled by 2 more from 64 px up, so a time ratio
says how much of it comes from a cheaper model.

All print one line per epoch ending in `val top-1 X` (the example does so already); each line is
stamped with its arrival time. Per run: the seconds and epoch at which the top-1 first reaches the
threshold (or not reached), the best and the final top-1. Runs alternate (the order rotates every
round), --repeats of each, seed K = the round; reported: median [min, max] of each, the ratio of
medians package / keras and package / practised (below 1: the package gets there sooner), the
same ratio within each round (median [min, max]) and the final top-1s.

Usage:
    nice -n 5 python benchmarks/time_to_accuracy.py                    # every dataset, 3 rounds
    nice -n 5 python benchmarks/time_to_accuracy.py --datasets mnist5k --seeds 0
    nice -n 5 python benchmarks/time_to_accuracy.py --datasets photodigits22k --batch 512 \
        --contenders package practised
    nice -n 5 python benchmarks/time_to_accuracy.py --datasets nsanimals --seeds 0 \
        --contenders package --aspect_ratio pad --out benchmarks/results/nonsquare_rules.json
    nice -n 5 python benchmarks/time_to_accuracy.py --datasets nsanimals --seeds 0 \
        --contenders package --aspect_ratio stretch --augmentation shift \
        --out benchmarks/results/nonsquare_augmentation.json

Adds its runs to `benchmarks/results/time_to_accuracy.json` (or --out): a run of the same
dataset, batch, contender and seed replaces the earlier one, so a matrix can be run in parts.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import datasets  # noqa: E402
from common import RESULTS, machine_info  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_imagenet.py")
JSON_PATH = os.path.join(RESULTS, "time_to_accuracy.json")
# Per dataset: image size, threshold, epochs, global batch.
SETTINGS = {
    "mnist5k": {"image_size": 32, "threshold": 0.95, "epochs": 15, "batch": 64},
    "elpv": {"image_size": 64, "threshold": 0.7, "epochs": 15, "batch": 64},
    "photodigits": {"image_size": 32, "threshold": 0.8, "epochs": 15, "batch": 64},
    # 20,250 training images: batch 512 is 1/40 of them, as 32,768 is of ImageNet's 1.28M.
    "photodigits22k": {"image_size": 32, "threshold": 0.9, "epochs": 15, "batch": 64},
    # Eight categories of drawings of every style: a hard set, so a lower threshold.
    "clipart": {"image_size": 64, "threshold": 0.6, "epochs": 15, "batch": 64},
    "fontletters": {"image_size": 32, "threshold": 0.8, "epochs": 15, "batch": 64},
    # The tuning sets (`datasets.TUNING`), to compare rules on before any held-out set is run.
    "digits": {"image_size": 32, "threshold": 0.9, "epochs": 15, "batch": 64},
    "animals": {"image_size": 28, "threshold": 0.9, "epochs": 15, "batch": 64},
    # 22,788 training images: the tuning sets' counterpart of photodigits22k, at batch 64 and 512.
    "photoletters": {"image_size": 32, "threshold": 0.8, "epochs": 15, "batch": 64},
    # The tuning sets' 64-pixel colour set.
    "icons": {"image_size": 64, "threshold": 0.7, "epochs": 15, "batch": 64},
    # The non-square sets (`datasets.NONSQUARE`): the tuning one, then the two held out.
    # Silhouettes a third of the image wide or less on busy photos: a hard set.
    "nsanimals": {"image_size": 32, "threshold": 0.6, "epochs": 15, "batch": 64},
    "nsphotodigits": {"image_size": 32, "threshold": 0.8, "epochs": 15, "batch": 64},
    # 681 drawings in 7 uneven classes, 68 validation images: a hard, small set, whose 10 steps
    # an epoch need more epochs (at 15 the practised script ends near the largest class's share).
    "nsclipart": {"image_size": 64, "threshold": 0.4, "epochs": 40, "batch": 64},
}
ASPECT_RATIOS = ("stretch", "pad", "crop")
AUGMENTATIONS = ("auto", "none", "translate", "shift", "light", "imagenet")
HELD_OUT = ("mnist5k", "elpv", "photodigits", "photodigits22k", "clipart", "fontletters")
TIMEOUT_S = 1800
# The practised script's AdamW: its peak rate after one epoch of warmup at PRACTISED_BATCH
# (scaled by the square root of the batch ratio at other batches, as Adam users scale it), and its
# weight decay.
PRACTISED_PEAK = 3e-3
PRACTISED_BATCH = 64
PRACTISED_WEIGHT_DECAY = 1e-4
# The Keras scripts' model keeps a 32x32 first stage, as CIFAR ResNets do at 32 pixels: its 3x3
# stem has stride image_size // KERAS_STAGE_SIZE (1 at 32 px, 2 at 64 px).
KERAS_STAGE_SIZE = 32
NAMES = ("package", "keras", "practised")
# Lower marks also reported, read off the same runs' epochs (a run stops at the threshold).
MARKS = (0.5, 0.7, 0.8, 0.9)

# The per-epoch line of both contenders, e.g. the example's absl line
# "I1201 12:00:00.0 123 train_imagenet.py:480] epoch 3/30: 190 images/s (23.8 per replica), loss
# 1.9, top-1 0.41, val top-1 0.5363".
EPOCH_LINE = re.compile(r"\bepoch (\d+)/(\d+):.*\bval top-1 (nan|[0-9]*\.?[0-9]+)")


def parse_epoch_line(line):
    """(epoch, epochs, validation top-1) of a per-epoch line, else None."""
    match = EPOCH_LINE.search(line)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), float(match.group(3))


def first_reaching(epochs, threshold):
    """The first of `epochs` (dicts with "val_top_1", in order) whose top-1 reaches `threshold`."""
    for record in epochs:
        if record["val_top_1"] >= threshold:  # False for NaN
            return record
    return None


def timed_run(command, threshold, timeout, env):
    """Runs `command` to its last epoch.

    Returns a dict: the epochs seen (top-1 and seconds since launch), the epoch and seconds that
    first reached `threshold` (None if none did), why the run ended, and the end of its output.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, so a kill takes its children too
    )
    timer = threading.Timer(timeout, lambda: _kill(proc))
    timer.start()
    epochs, tail, reached, total = [], [], None, None
    try:
        for line in proc.stdout:
            seconds = time.monotonic() - start
            tail = (tail + [line.rstrip()])[-30:]
            parsed = parse_epoch_line(line)
            if parsed is None:
                continue
            epoch, total, top_1 = parsed
            epochs.append({"epoch": epoch, "val_top_1": top_1, "seconds": round(seconds, 2)})
            print(
                f"    epoch {epoch}/{total}: val top-1 {top_1:.4f} at {seconds:.1f} s", flush=True
            )
            reached = reached or first_reaching(epochs[-1:], threshold)
            if epoch >= total:  # a process's teardown can take a minute
                break
    finally:
        timer.cancel()
        _kill(proc)
        proc.wait()
    if epochs and epochs[-1]["epoch"] >= total:
        ended = "last epoch"
    elif time.monotonic() - start >= timeout:
        ended = "timeout"
    else:
        ended = f"exited {proc.returncode}"
    return {
        "epochs": epochs,
        "reached_epoch": reached["epoch"] if reached else None,
        "seconds_to_threshold": reached["seconds"] if reached else None,
        "best_top_1": max((e["val_top_1"] for e in epochs), default=None),
        "final_top_1": epochs[-1]["val_top_1"] if epochs else None,
        "ended": ended,
        "output_tail": tail[-3:] if ended == "last epoch" else tail,
    }


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def prepare_folders(workdir, name):
    """The dataset as a folder of images (with two broken files) for the package, and a copy
    without them for Keras; returns both paths."""
    images, clean = os.path.join(workdir, "images"), os.path.join(workdir, "images_clean")
    datasets.write_folder(name, images, broken_files=True)
    shutil.copytree(images, clean)
    for folder, _, files in os.walk(clean):
        for broken in ("cut_off.jpg", "not_an_image.jpg"):
            if broken in files:
                os.remove(os.path.join(folder, broken))
    return images, clean


def _env(workdir):
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=workdir)  # leftovers of killed runs land here
    env.pop("TF_CONFIG", None)
    return env


def commands(images, clean, cfg, seed):
    """Each contender's command. `cfg["aspect_ratio"]` and `cfg["augmentation"]`, when there, go to
    the package's example as `--aspect_ratio` and `--augmentation`; the Keras scripts read every
    image as Keras does by default (stretched), with no augmentation."""
    common = ["--image_size", str(cfg["image_size"]), "--epochs", str(cfg["epochs"])]
    common += ["--seed", str(seed)]
    package = [sys.executable, EXAMPLE, "--image_dir", images, "--noprogress"]
    package += common + ["--global_batch_size", str(cfg["batch"])]
    if cfg.get("aspect_ratio"):
        package += ["--aspect_ratio", cfg["aspect_ratio"]]
    if cfg.get("augmentation"):
        package += ["--augmentation", cfg["augmentation"]]
    keras = [sys.executable, os.path.abspath(__file__), "--_keras", "--image_dir", clean]
    keras += common + ["--batch", str(cfg["batch"])]
    return {
        "package": package,
        "keras": keras + ["--optimizer", "adam"],
        "practised": keras + ["--optimizer", "practised"],
    }


# --------------------------------------------------------------------------- Keras by hand


def practised_peak(batch):
    """The practised script's peak rate at `batch`: 3e-3 at 64, scaled by the square root of the
    batch ratio."""
    return PRACTISED_PEAK * math.sqrt(batch / PRACTISED_BATCH)


def keras_resnet(image_size, num_classes):
    """The model a practised Keras user writes for small images: a CIFAR-style ResNet whose 3x3
    stem keeps a 32x32 first stage (stride 1 at 32 px), then three stages of one basic block (16,
    32, 64 wide; the later two halve the resolution with a projection shortcut), global average
    pooling and a dense layer; uint8-range pixels in."""
    import keras
    from keras import layers

    def block(x, width, stride):
        shortcut = x
        x = layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        if stride != 1 or shortcut.shape[-1] != width:
            shortcut = layers.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut)
            shortcut = layers.BatchNormalization()(shortcut)
        return layers.ReLU()(x + shortcut)

    inputs = keras.Input((image_size, image_size, 3))
    x = layers.Rescaling(1 / 255)(inputs)
    stem_stride = max(1, image_size // KERAS_STAGE_SIZE)
    x = layers.Conv2D(16, 3, strides=stem_stride, padding="same", use_bias=False)(x)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for width, stride in ((16, 1), (32, 2), (64, 2)):
        x = block(x, width, stride)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x))


def multiply_adds(model):
    """Multiply-adds of one image through `model`'s convolutions and dense layers (batch norm,
    activations, pooling and additions, a few percent more, not counted): for a convolution,
    output pixels x kernel area x input channels / groups x filters; for a dense layer, inputs x
    units."""
    import keras

    total = 0
    for layer in _layers(model):
        if isinstance(layer, keras.layers.Conv2D):
            _, height, width, filters = layer.output.shape
            kernel = layer.kernel.shape  # (kh, kw, in / groups, filters)
            total += height * width * kernel[0] * kernel[1] * kernel[2] * filters
        elif isinstance(layer, keras.layers.Dense):
            total += layer.kernel.shape[0] * layer.kernel.shape[1]
    return int(total)


def _layers(model):
    for layer in model.layers:
        if hasattr(layer, "layers"):
            yield from _layers(layer)
        else:
            yield layer


def compute_per_image(image_size, num_classes):
    """Each contender's multiply-adds per training image at `image_size`: the package's
    `small_resnet` (the one command's default model) and the Keras scripts' `keras_resnet`."""
    from tpu_scale import models

    package = models.small_resnet(num_classes, input_shape=(image_size, image_size, 3))
    by_hand = multiply_adds(keras_resnet(image_size, num_classes))
    return {"package": multiply_adds(package), "keras": by_hand, "practised": by_hand}


def keras_by_hand(args):
    """The Keras script a user writes for a folder of images; prints `epoch N/E: ..., val top-1 X`
    per epoch. `args.optimizer`: `adam` (Keras's defaults) or `practised` (AdamW, one epoch of
    linear warmup to `practised_peak(batch)`, cosine decay to 0)."""
    import keras

    keras.utils.set_random_seed(args.seed)
    size = (args.image_size, args.image_size)
    train, validation = keras.utils.image_dataset_from_directory(
        args.image_dir,
        validation_split=0.1,
        subset="both",
        seed=args.seed,
        image_size=size,
        batch_size=args.batch,
    )

    model = keras_resnet(args.image_size, len(train.class_names))
    if args.optimizer == "practised":
        steps = int(train.cardinality())
        optimizer = keras.optimizers.AdamW(
            keras.optimizers.schedules.CosineDecay(
                0.0,
                decay_steps=steps * (args.epochs - 1),
                warmup_target=practised_peak(args.batch),
                warmup_steps=steps,
            ),
            weight_decay=PRACTISED_WEIGHT_DECAY,
        )
    else:
        optimizer = keras.optimizers.Adam()
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    def report(epoch, logs):
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {logs['loss']:.4f}, "
            f"top-1 {logs['accuracy']:.4f}, val top-1 {logs['val_accuracy']:.4f}",
            flush=True,
        )

    model.fit(
        train,
        validation_data=validation,
        epochs=args.epochs,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=report)],
        verbose=0,
    )


# --------------------------------------------------------------------------- the parent


def summarize(runs, names):
    """Per contender: median, min and max seconds and epochs to the threshold over the runs that
    reached it, how many did; the ratio of medians of the first name to each other name
    (`ratios`), and to the second (`ratio`); and the ratio within each round (`round_ratios`:
    median, min and max over the seeds both reached it in)."""
    summary = {}
    for name in names:
        done = [r for r in runs if r["contender"] == name and r["seconds_to_threshold"] is not None]
        entry = {"runs": sum(r["contender"] == name for r in runs), "reached": len(done)}
        for key in ("seconds_to_threshold", "reached_epoch"):
            values = [r[key] for r in done]
            if values:
                entry[key] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
        summary[name] = entry
    first = summary[names[0]].get("seconds_to_threshold")
    summary["ratios"] = {}
    for name in names[1:]:
        other = summary[name].get("seconds_to_threshold")
        summary["ratios"][name] = first["median"] / other["median"] if first and other else None
    summary["ratio"] = summary["ratios"][names[1]] if len(names) > 1 else None
    # A round's runs follow each other within minutes: its ratio leaves out the host's slower
    # and faster spells, which move every contender of a round alike.
    mine = {r["seed"]: r["seconds_to_threshold"] for r in runs if r["contender"] == names[0]}
    summary["round_ratios"] = {}
    for name in names[1:]:
        ratios = [
            mine[r["seed"]] / r["seconds_to_threshold"]
            for r in runs
            if r["contender"] == name and r["seconds_to_threshold"] and mine.get(r["seed"])
        ]
        summary["round_ratios"][name] = (
            {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "rounds": len(ratios),
            }
            if ratios
            else None
        )
    return summary


def summarize_marks(runs, names, marks):
    """`summarize` at each of `marks`, read off every run's epochs: {mark: summary}."""
    out = {}
    for mark in marks:
        marked = []
        for run in runs:
            reached = first_reaching(run["epochs"], mark)
            marked.append(
                {
                    "contender": run["contender"],
                    "seed": run["seed"],
                    "seconds_to_threshold": reached["seconds"] if reached else None,
                    "reached_epoch": reached["epoch"] if reached else None,
                }
            )
        out[str(mark)] = summarize(marked, names)
    return out


def run_dataset(name, cfg, seeds, names, out):
    """The contenders on one dataset, interleaved, seed by seed; each run is added to `out["runs"]`
    (replacing one of the same contender and seed) and `save()` is called after it."""
    with tempfile.TemporaryDirectory(prefix="tpu_scale_tta_") as workdir:
        images, clean = prepare_folders(workdir, name)
        shown = commands("IMAGES", "IMAGES_CLEAN", cfg, "K")
        out["commands"] = {
            n: " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in c[1:])
            for n, c in shown.items()
        }
        for seed in seeds:
            order = names[seed % len(names) :] + names[: seed % len(names)]
            for contender in order if seed % 2 == 0 else order[::-1]:
                print(f"  {name} @ {cfg['batch']}, {contender}, seed {seed}:", flush=True)
                command = commands(images, clean, cfg, seed)[contender]
                run = timed_run(command, cfg["threshold"], TIMEOUT_S, _env(workdir))
                if contender == "package":  # the rule it read non-square images by (None: its own)
                    run["aspect_ratio"] = cfg.get("aspect_ratio")
                    if cfg.get("augmentation"):  # the level it augmented at (absent: its own)
                        run["augmentation"] = cfg["augmentation"]
                out["runs"] = [
                    r for r in out["runs"] if (r["contender"], r["seed"]) != (contender, seed)
                ] + [{"contender": contender, "seed": seed, **run}]
                if run["ended"] != "last epoch":
                    print(f"    ended: {run['ended']}:", *run["output_tail"][-8:], sep="\n")
                summarize_dataset(out)
                yield


def summarize_dataset(out):
    """Puts the summaries of `out["runs"]` into `out`: time to the threshold and at the lower
    marks, the ratios, and the final top-1s (median, min, max)."""
    cfg = out["settings"]
    # Every contender with runs, also those of earlier calls (--contenders runs some of them).
    present = [n for n in NAMES if any(r["contender"] == n for r in out["runs"])]
    if not present:
        return
    out["summary"] = summarize(out["runs"], present)
    out["summary_at_marks"] = summarize_marks(
        out["runs"], present, [m for m in MARKS if m < cfg["threshold"]]
    )
    for contender in present:
        finals = [r["final_top_1"] for r in out["runs"] if r["contender"] == contender]
        finals = [f for f in finals if f is not None]
        if finals:
            out["summary"][contender]["final_top_1"] = {
                "median": statistics.median(finals),
                "min": min(finals),
                "max": max(finals),
            }
        out["summary"][contender]["multiply_adds_per_image"] = out["multiply_adds_per_image"][
            contender
        ]


def report(key, out):
    cfg, summary = out["settings"], out.get("summary")
    if not summary:
        return
    names = [n for n in NAMES if n in summary]
    print(f"{key} (threshold {cfg['threshold']}, {cfg['epochs']} epochs):")
    for contender in names:
        s = summary[contender]
        final = s.get("final_top_1")
        final_text = (
            f"final top-1 {final['median']:.4f} [{final['min']:.4f}, {final['max']:.4f}]"
            if final
            else "no final top-1"
        )
        flops = f"{s['multiply_adds_per_image'] / 1e6:.1f}M multiply-adds an image"
        if "seconds_to_threshold" in s:
            t, e = s["seconds_to_threshold"], s["reached_epoch"]
            print(
                f"  {contender} ({flops}): {t['median']:.1f} s [{t['min']:.1f}, {t['max']:.1f}], "
                f"epoch {e['median']} ({s['reached']}/{s['runs']} runs reached it); {final_text}"
            )
        else:
            print(f"  {contender} ({flops}): never reached it ({s['runs']} runs); {final_text}")
    for other, ratio in summary["ratios"].items():
        rounds = summary["round_ratios"][other]
        print(
            f"  ratio {names[0]} / {other}: {ratio:.2f} (per round {rounds['median']:.2f} "
            f"[{rounds['min']:.2f}, {rounds['max']:.2f}], {rounds['rounds']} rounds)"
            if ratio and rounds
            else f"  ratio / {other}: n/a"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(HELD_OUT), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--contenders", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--epochs", type=int, help="instead of each dataset's")
    parser.add_argument("--batch", type=int, help="global batch, instead of each dataset's")
    parser.add_argument("--out", default=JSON_PATH)
    parser.add_argument(
        "--aspect_ratio",
        choices=ASPECT_RATIOS,
        help="passed to the package's example as --aspect_ratio (how it reads a non-square image); "
        "not passed when not given, so the example's own default holds",
    )
    parser.add_argument(
        "--augmentation",
        choices=AUGMENTATIONS,
        help="passed to the package's example as --augmentation; not passed when not given, so "
        "the example's own choice (auto) holds",
    )
    parser.add_argument("--_keras", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--image_dir", help=argparse.SUPPRESS)
    parser.add_argument("--image_size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adam", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._keras:
        return keras_by_hand(args)

    names = tuple(n for n in NAMES if n in args.contenders)
    out = {"datasets": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out["machine_at_start"] = machine_info()
    for name in args.datasets:
        cfg = dict(SETTINGS[name])
        cfg["epochs"] = args.epochs or cfg["epochs"]
        cfg["batch"] = args.batch or cfg["batch"]
        key = f"{name}@{cfg['batch']}"
        if args.aspect_ratio:  # only then, so the entries of runs without it keep their key
            cfg["aspect_ratio"] = args.aspect_ratio
            key += f" aspect_ratio={args.aspect_ratio}"
        if args.augmentation:  # likewise
            cfg["augmentation"] = args.augmentation
            key += f" augmentation={args.augmentation}"
        entry = out["datasets"].setdefault(key, {"runs": []})
        if entry.get("settings", cfg) != cfg:
            entry["runs"] = []  # runs of other settings are not comparable
        entry["settings"] = cfg
        classes = len(set(datasets.load(name)[1].tolist()))
        entry["multiply_adds_per_image"] = compute_per_image(cfg["image_size"], classes)
        for _ in run_dataset(name, cfg, args.seeds, names, entry):
            out["machine_at_end"] = machine_info()
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    for key, result in out["datasets"].items():
        report(key, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
