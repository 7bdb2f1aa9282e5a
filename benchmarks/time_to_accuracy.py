"""Time to accuracy on real images: the example against plain Keras, in wall seconds to a top-1.

The paper's own measure: how long from launch until the model reaches a validation top-1
threshold. Here on this machine, for a user's own folder of images, with the example
`examples/train_imagenet.py` as it comes against plain Keras on the same records, model and machine.

Data: scikit-learn's digits (1797 real 8x8 greyscale digits shipped in its wheel), written as a
folder of class folders of JPEGs and PNGs at --image_size pixels
(`tpu_scale.testing.digits.write_digits_folder`, with its three broken files) and converted by the
writer a user runs on their own images, `python -m tpu_scale.data.write_tfrecords --image_dir
DIR --output_dir RECORDS` (its stratified 10% validation split: 1618 train, 179 validation).

Contenders, each a fresh process started from here:

    example  python examples/train_imagenet.py --data_dir RECORDS --model small_resnet
                 --image_size S --epochs E --global_batch_size B --seed K --noprogress
             and nothing else: the recipe for batch B (momentum SGD below 512), grouped batch norm,
             the 2-D torus gradient sum on 8 virtual CPU replicas, the fused input pipeline.
    keras    plain Keras, this script's own child (`--_plain`): the same `small_resnet` with
             Keras's `BatchNormalization`, momentum SGD at 0.1 per 256 examples on the same warmup
             and decay, no label smoothing (the `keras` variant of `benchmarks/recipe.py`), under a
             plain `tf.distribute.MirroredStrategy` of 8 virtual CPUs (TensorFlow's gradient sum),
             fed by a plain `tf.data` reader of the same TFRecords with the standard ImageNet
             preprocessing (random Inception crop and flip for training, the central 224/256 of
             the image for validation, ImageNet mean and stddev): the same images the example
             sees.

Both train on the schedule of E epochs at batch B and print one line per epoch ending in
`val top-1 X`; the example does so already, and its output is read as it comes, each line stamped
with its arrival time. A run's figure is the wall time from its launch to the end of the first
epoch whose validation top-1 reaches --threshold (the run is then stopped), and that epoch; a run
that never reaches it counts as not reached. The runs alternate (the order flips every round),
--repeats of each, with seed K = the round; reported are the median [min, max] of each and the
ratio of medians example / keras (below 1: the example gets there sooner), and the same at the
lower marks 0.3, 0.4, 0.5, 0.7 and 0.8, read off the same runs.

Usage:
    nice -n 10 python benchmarks/time_to_accuracy.py            # 3 runs each, to top-1 0.9
    nice -n 10 python benchmarks/time_to_accuracy.py --quick    # 1 run each, to top-1 0.4

Writes `benchmarks/results/time_to_accuracy.json`.
"""

import argparse
import json
import os
import re
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

from common import RESULTS, machine_info  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_imagenet.py")
JSON_PATH = os.path.join(RESULTS, "time_to_accuracy.json")
REPLICAS = 8

SETTINGS = {
    False: {"threshold": 0.9, "epochs": 30, "repeats": 3, "timeout_s": 1200},
    True: {"threshold": 0.4, "epochs": 30, "repeats": 1, "timeout_s": 900},
}
# Lower marks also reported, read off the same runs' epochs (a run stops at the threshold).
MARKS = (0.3, 0.4, 0.5, 0.7, 0.8)

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
    """Runs `command` until an epoch's validation top-1 reaches `threshold`, then kills it.

    Returns a dict: the epochs seen (top-1 and seconds since launch), the epoch and seconds that
    reached the threshold (None if none did), why the run ended, and the end of its output.
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
            reached = first_reaching(epochs[-1:], threshold)
            if reached is not None or epoch >= total:  # a process's teardown can take a minute
                break
    finally:
        timer.cancel()
        _kill(proc)
        proc.wait()
    if reached is not None:
        ended = "reached"
    elif epochs and epochs[-1]["epoch"] >= total:
        ended = "last epoch"
    elif time.monotonic() - start >= timeout:
        ended = "timeout"
    else:
        ended = f"exited {proc.returncode}"
    return {
        "epochs": epochs,
        "reached_epoch": reached["epoch"] if reached else None,
        "seconds_to_threshold": reached["seconds"] if reached else None,
        "ended": ended,
        "output_tail": tail if reached is None else tail[-3:],
    }


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def prepare_records(workdir, image_size):
    """The digits as a folder of images, then TFRecords through the package's writer; returns the
    records folder."""
    from tpu_scale.testing.digits import write_digits_folder

    images, records = os.path.join(workdir, "images"), os.path.join(workdir, "records")
    write_digits_folder(images, size=image_size)
    command = [sys.executable, "-m", "tpu_scale.data.write_tfrecords"]
    command += ["--image_dir", images, "--output_dir", records, "--seed", "0"]
    subprocess.run(command, check=True, capture_output=True, env=_env(workdir), timeout=600)
    return records


def _env(workdir):
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=workdir)  # leftovers of killed runs land here
    env.pop("TF_CONFIG", None)
    return env


def commands(records, cfg, seed):
    common = ["--image_size", str(cfg["image_size"]), "--epochs", str(cfg["epochs"])]
    common += ["--seed", str(seed)]
    example = [sys.executable, EXAMPLE, "--data_dir", records, "--model", "small_resnet"]
    example += common + ["--global_batch_size", str(cfg["batch"]), "--noprogress"]
    keras = [sys.executable, os.path.abspath(__file__), "--_plain", "--data_dir", records]
    keras += common + ["--batch", str(cfg["batch"])]
    return {"example": example, "keras": keras}


# --------------------------------------------------------------------------- the plain Keras child


def plain_dataset(pattern, image_size, label_offset, batch, training, seed):
    """A plain `tf.data` reader of the records: parse, decode, crop, flip, resize, normalize."""
    import tensorflow as tf

    mean = tf.constant([0.485 * 255, 0.456 * 255, 0.406 * 255])
    stddev = tf.constant([0.229 * 255, 0.224 * 255, 0.225 * 255])
    features = {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
    }

    def decode(record):
        example = tf.io.parse_single_example(record, features)
        image = tf.io.decode_jpeg(example["image/encoded"], channels=3)
        if training:
            begin, size, _ = tf.image.sample_distorted_bounding_box(
                tf.shape(image),
                tf.zeros([1, 0, 4]),
                area_range=(0.08, 1.0),
                aspect_ratio_range=(3 / 4, 4 / 3),
                max_attempts=10,
                use_image_if_no_bounding_boxes=True,
            )
            image = tf.image.random_flip_left_right(tf.slice(image, begin, size))
        else:
            image = tf.image.central_crop(image, 224 / 256)  # the standard fraction, at any size
        image = tf.image.resize(tf.cast(image, tf.float32), [image_size, image_size])
        label = tf.cast(example["image/class/label"], tf.int32) - label_offset
        return (image - mean) / stddev, label

    data = tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(pattern))).cache()
    if training:
        data = data.shuffle(10_000, seed=seed).repeat()
    data = data.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return data.batch(batch, drop_remainder=training).prefetch(tf.data.AUTOTUNE)


def plain_keras(args):
    """Trains plain Keras on the records, printing `epoch N/E: ..., val top-1 X` per epoch."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(REPLICAS)]
    )
    import keras
    from recipe import _keras_bn_model, plain_keras_recipe

    from tpu_scale import models

    with open(os.path.join(args.data_dir, "labels.json")) as f:
        label_map = json.load(f)
    steps_per_epoch = max(1, label_map["examples"]["train"] // args.batch)
    keras.utils.set_random_seed(args.seed)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    recipe = plain_keras_recipe(args.batch, args.epochs)
    with strategy.scope():
        model = models.small_resnet(label_map["num_classes"], image_size=args.image_size)
        model = _keras_bn_model(model)
        model.compile(
            optimizer=recipe.build_optimizer(steps_per_epoch, args.epochs),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="top_1")],
        )
    offset = label_map["label_offset"]
    train = plain_dataset(
        os.path.join(args.data_dir, "train-*"), args.image_size, offset, args.batch, True, args.seed
    )
    validation = plain_dataset(
        os.path.join(args.data_dir, "validation-*"), args.image_size, offset, args.batch, False, 0
    )

    def report(epoch, logs):
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {logs['loss']:.4f}, top-1 {logs['top_1']:.4f}, "
            f"val top-1 {logs['val_top_1']:.4f}",
            flush=True,
        )

    model.fit(
        train,
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        validation_data=validation,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=report)],
        verbose=0,
    )


# --------------------------------------------------------------------------- the parent


def summarize(runs, names):
    """Per contender: median, min and max seconds and epochs to the threshold over the runs that
    reached it, how many did; the ratio of medians of the first name to the second."""
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
    first, second = (summary[n].get("seconds_to_threshold") for n in names)
    summary["ratio"] = first["median"] / second["median"] if first and second else None
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
                    "seconds_to_threshold": reached["seconds"] if reached else None,
                    "reached_epoch": reached["epoch"] if reached else None,
                }
            )
        out[str(mark)] = summarize(marked, names)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--out", default=JSON_PATH)
    parser.add_argument("--_plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data_dir", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._plain:
        return plain_keras(args)

    cfg = dict(SETTINGS[args.quick], image_size=args.image_size, batch=args.batch)
    for key in ("threshold", "epochs", "repeats"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    out = {"settings": cfg, "machine_at_start": machine_info(), "runs": []}
    names = ("example", "keras")
    with tempfile.TemporaryDirectory(prefix="tpu_scale_tta_") as workdir:
        records = prepare_records(workdir, cfg["image_size"])
        with open(os.path.join(records, "labels.json")) as f:
            out["examples"] = json.load(f)["examples"]
        shown = commands("RECORDS", cfg, "K")
        out["commands"] = {
            n: " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in command[1:])
            for n, command in shown.items()
        }
        for seed in range(cfg["repeats"]):
            order = names if seed % 2 == 0 else names[::-1]
            for name in order:
                print(f"  {name}, seed {seed}:", flush=True)
                run = timed_run(
                    commands(records, cfg, seed)[name],
                    cfg["threshold"],
                    cfg["timeout_s"],
                    _env(workdir),
                )
                out["runs"].append({"contender": name, "seed": seed, **run})
                if run["ended"] != "reached":
                    print(f"    not reached ({run['ended']}):", *run["output_tail"][-8:], sep="\n")
                out["summary"] = summarize(out["runs"], names)
                marks = [m for m in MARKS if m < cfg["threshold"]]
                out["summary_at_marks"] = summarize_marks(out["runs"], names, marks)
                out["machine_at_end"] = machine_info()
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    for name in names:
        s = out["summary"][name]
        if "seconds_to_threshold" in s:
            t, e = s["seconds_to_threshold"], s["reached_epoch"]
            print(
                f"{name}: {t['median']:.1f} s [{t['min']:.1f}, {t['max']:.1f}] to top-1 "
                f"{cfg['threshold']}, epoch {e['median']} [{e['min']}, {e['max']}] "
                f"({s['reached']}/{s['runs']} runs reached it)"
            )
        else:
            print(f"{name}: never reached top-1 {cfg['threshold']} ({s['runs']} runs)")
    ratio = out["summary"]["ratio"]
    print(f"ratio example / keras: {ratio:.2f}" if ratio else "ratio: n/a")
    for mark, summary in out["summary_at_marks"].items():
        seconds = [summary[n].get("seconds_to_threshold", {}).get("median") for n in names]
        shown = ", ".join(f"{n} {s:.1f} s" if s else f"{n} n/a" for n, s in zip(names, seconds))
        ratio = summary["ratio"]
        print(f"  at top-1 {mark}: {shown}, ratio " + (f"{ratio:.2f}" if ratio else "n/a"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
