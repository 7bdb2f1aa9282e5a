"""Scaled JPEG decode: how often it applies, how close it stays, and what it saves.

`InputConfig(scaled_decode=True)` decodes a crop window at least r times the output size (r = 2,
4 or 8, in both dimensions) at libjpeg's DCT-domain ratio r before the resize. This script measures,
in one run:

  share   the fraction of training crops (the Inception random box) it applies to, for image sizes
          of ImageNet (about 500x375: assumed typical, not measured on ImageNet) up to a phone
          photograph (4032x3024), at output sizes 224, 128 and 64;
  psnr    on the two photographs scikit-learn ships (427x640), the PSNR of scaled decode + bilinear
          resize against full decode + antialiased resize, over random training crops where it
          applies (as a yardstick, also full decode + bilinear resize against the same reference);
  cpu     CPU milliseconds per image of the training decode (window, decode, resize, flip) with and
          without it, pinned to one core and one TensorFlow thread, on the photograph upscaled to
          2048x1365 (a camera-sized JPEG), in interleaved rounds; medians with min-max.

Usage:
    python benchmarks/scaled_decode.py [--quick]

Writes `benchmarks/results/scaled_decode.json`.
"""

import argparse
import os
import statistics
import time

from common import machine_info, save_result  # noqa: E402

SIZES = {
    "imagenet_like_500x375": (375, 500),
    "640x480": (480, 640),
    "1024x768": (768, 1024),
    "2048x1536": (1536, 2048),
    "phone_4032x3024": (3024, 4032),
}
OUTPUTS = (224, 128, 64)


def crop_share(tf, image_ops, samples):
    """The share of sampled Inception windows at ratio >= 2, and the ratios, per size and output."""

    @tf.function
    def ratios(height, width, output, seeds):
        def one(seed):
            window = image_ops.sample_crop_window(height, width, seed)
            return image_ops.scaled_decode_ratio(window[2], window[3], output)

        return tf.map_fn(one, seeds, fn_output_signature=tf.int32)

    seeds = tf.stack(
        [tf.range(samples, dtype=tf.int64), tf.fill([samples], tf.constant(11, tf.int64))], 1
    )
    share = {}
    for name, (h, w) in SIZES.items():
        for output in OUTPUTS:
            r = ratios(tf.constant(h), tf.constant(w), output, seeds).numpy()
            share[f"{name}@{output}"] = {
                "share": float((r >= 2).mean()),
                "ratio_counts": {str(k): int((r == k).sum()) for k in (1, 2, 4, 8)},
            }
    return share


def psnr_on_photos(tf, np, image_ops, crops):
    from sklearn.datasets import load_sample_image

    def psnr(a, b):
        mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
        return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))

    result = {}
    for name in ("china.jpg", "flower.jpg"):
        image = load_sample_image(name)
        jpeg = tf.io.encode_jpeg(image, quality=90)
        h, w = image.shape[:2]
        for output in (64, 128):
            scaled_vs, bilinear_vs = [], []
            for seed in range(crops):
                window = image_ops.sample_crop_window(
                    tf.constant(h), tf.constant(w), tf.constant([seed, 5])
                )
                if int(image_ops.scaled_decode_ratio(window[2], window[3], output)) < 2:
                    continue
                full = image_ops.decode_window(jpeg, window)
                reference = tf.image.resize(full, [output, output], antialias=True)
                scaled = tf.image.resize(
                    image_ops.decode_window(jpeg, window, output), [output, output]
                )
                scaled_vs.append(psnr(scaled, reference))
                bilinear_vs.append(psnr(tf.image.resize(full, [output, output]), reference))
            result[f"{name}@{output}"] = {
                "crops": len(scaled_vs),
                "scaled_psnr_db": {
                    "median": statistics.median(scaled_vs),
                    "min": min(scaled_vs),
                    "max": max(scaled_vs),
                }
                if scaled_vs
                else None,
                "full_bilinear_psnr_db": {
                    "median": statistics.median(bilinear_vs),
                    "min": min(bilinear_vs),
                }
                if bilinear_vs
                else None,
            }
    return result


def cpu_per_image(tf, image_ops, rounds, images_per_round):
    from sklearn.datasets import load_sample_image

    os.sched_setaffinity(0, {0})
    photo = tf.image.resize(load_sample_image("china.jpg"), [1365, 2048], antialias=True)
    jpeg = tf.io.encode_jpeg(tf.cast(tf.round(photo), tf.uint8), quality=90)
    jpegs = tf.stack([jpeg] * 8)

    def loop(output, scaled):
        @tf.function
        def run(step):
            seeds = tf.stack(
                [tf.range(images_per_round, dtype=tf.int64), tf.fill([images_per_round], step)], 1
            )
            return tf.map_fn(
                lambda s: image_ops.decode_and_random_crop(
                    jpegs[s[0] % 8], output, s, scaled_decode=scaled
                )[0, 0, 0],
                seeds,
                fn_output_signature=tf.float32,
                parallel_iterations=1,
            )

        return run

    runs = {
        f"{o}/{'scaled' if s else 'full'}": loop(o, s) for o in (224, 128) for s in (False, True)
    }
    for run in runs.values():
        run(tf.constant(0, tf.int64)).numpy()  # trace and warm up
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items():
            start = time.process_time()
            run(tf.constant(r + 1, tf.int64)).numpy()
            times[name].append(1000 * (time.process_time() - start) / images_per_round)
    summary = {
        name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
        for name, t in times.items()
    }
    for output in (224, 128):
        summary[f"{output}/speedup"] = (
            summary[f"{output}/full"]["median_ms"] / summary[f"{output}/scaled"]["median_ms"]
        )
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and rounds (~1 minute)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tpu_scale.data import image_ops

    started = time.time()
    result = {
        "command": "python benchmarks/scaled_decode.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(),
        "share": crop_share(tf, image_ops, 500 if args.quick else 2000),
        "psnr": psnr_on_photos(tf, np, image_ops, 12 if args.quick else 40),
        "cpu": cpu_per_image(tf, image_ops, 3 if args.quick else 7, 16 if args.quick else 32),
    }
    result["seconds"] = round(time.time() - started, 1)
    save_result("scaled_decode", result)


if __name__ == "__main__":
    main()
