"""Input pipeline throughput: `ImageNetInput` against tf-models-official, a naive pipeline and the
decode limit.

Claim: the training path of `tpu_scale.data.ImageNetInput` gives at least 1.5x the images/s of
tf-models-official's ImageNet classification input with uint8 output (normalized on the device),
and 1.25x with float32, on the same files.

Data (`input_data.py`): generated ImageNet-like JPEG TFRecords (mostly 500x375, quality 90, about
100 KB, 16 shards with `labels.json`), or views of real photographs (`--images photos`). Batch 64,
224x224 output. Pipelines (`input_workers.py`), each in its own process (own thread pools, own peak
RSS), in interleaved rounds, each timing several windows after a warm-up:

  ours, ours_bfloat16, ours_uint8   the training path with float32, bfloat16, uint8 output
  ours_uint8_classic                uint8 on the same shards without `labels.json`, as the classic
                                    ImageNet conversion leaves them (the reader counts file bytes)
  tfm                               tf-models-official (needs its own environment: --tfm_python)
  naive                             sequential read, full decode, resize, flip, normalize, batch
  decode_limit                      cores x the one-core rate of decode-and-crop alone

Figures: medians over all windows with min-max; CPU milliseconds per image (which other users of
the machine do not change) next to images/s.

Usage (timing: hold the machine-wide lock; tf-models-official in a venv, see benchmarks/README.md):
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/input_pipeline.py \
        [--quick] [--images photos] [--tfm_python /tmp/tfm/bin/python]

Writes `benchmarks/results/input_pipeline.json` (`input_pipeline_photos.json` with photos).
"""

import argparse
import os
import statistics
import time

import input_workers as workers
from common import RESULTS, machine_info

# Bytes of one output image per dtype: what crosses from the host to the accelerator.
OUTPUT_BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1}
LABELS = {
    "ours": "ours, float32",
    "ours_bfloat16": "ours, bfloat16",
    "ours_uint8": "ours, uint8 (normalized on the device)",
    "ours_uint8_classic": "ours, uint8, classic files (no `labels.json`)",
    "tfm": "tf-models-official",
    "naive": "naive: sequential read, full decode, resize",
    "decode_limit": "decode limit: cores x one-core decode-and-crop",
}


def measure(run, tfm_python):
    """Every pipeline in interleaved rounds: {name: pooled windows}, with `decode_limit`."""
    classic = run.data["classic_pattern"]
    jobs = {
        "ours": lambda r: workers.spawn(run, "ours"),
        "ours_bfloat16": lambda r: workers.spawn(run, "ours_bfloat16"),
        "ours_uint8": lambda r: workers.spawn(run, "ours_uint8"),
        "ours_uint8_classic": lambda r: workers.spawn(run, "ours_uint8", pattern=classic),
        "naive": lambda r: workers.spawn(run, "naive"),
        "decode_one_core": lambda r: workers.spawn(run, "decode_one_core", core=r % run.cores),
    }
    if tfm_python:
        jobs["tfm"] = lambda r: workers.spawn(run, "tfm", python=tfm_python)
    results = workers.interleave(run, jobs)
    pipelines = {name: workers.pooled(rs) for name, rs in results.items()}
    one_core = pipelines.pop("decode_one_core")
    breakdowns = [r["cpu_ms_per_image_breakdown"] for r in results["decode_one_core"]]
    pipelines["decode_limit"] = {
        **{k: round(run.cores * one_core[k], 1) for k in ("median", "min", "max")},
        "cpu_ms_per_image": one_core["cpu_ms_per_image"],
        "peak_rss_mb": one_core["peak_rss_mb"],
        "one_core": one_core,
        "cores": run.cores,
        # Decode-and-crop alone, then with resize and flip, then normalization: one window each.
        "cpu_ms_per_image_breakdown": {
            key: round(statistics.median(b[key] for b in breakdowns), 3) for key in breakdowns[0]
        },
    }
    return pipelines


def compare(pipelines):
    """Ours (float32 and uint8) over every other pipeline, by images/s and by CPU time per image;
    the targets."""
    ratios, by_cpu = {}, {}
    for ours in ("ours", "ours_uint8"):
        for other in ("tfm", "naive", "decode_limit"):
            if other in pipelines:
                mine, theirs = pipelines[ours], pipelines[other]
                ratios[f"{ours}/{other}"] = round(mine["median"] / theirs["median"], 3)
                by_cpu[f"{ours}/{other}"] = round(
                    theirs["cpu_ms_per_image"] / mine["cpu_ms_per_image"], 3
                )
    targets = {"ours/decode_limit >= 0.9": ratios["ours/decode_limit"] >= 0.9}
    if "tfm" in pipelines:
        targets["ours_uint8/tfm >= 1.5"] = ratios["ours_uint8/tfm"] >= 1.5
        targets["ours/tfm >= 1.25"] = ratios["ours/tfm"] >= 1.25
    return ratios, by_cpu, targets


def markdown_table(pipelines, ratios):
    """The table of `benchmarks/README.md`."""
    lines = [
        "| pipeline | images/s, median (min-max) | CPU ms / image | peak RSS MB | "
        "ours (uint8) / this |",
        "|---|---|---|---|---|",
    ]
    for name, label in LABELS.items():
        if name in pipelines:
            p = pipelines[name]
            ratio = ratios.get(f"ours_uint8/{name}")
            lines.append(
                f"| {label} | {p['median']:.0f} ({p['min']:.0f}-{p['max']:.0f}) | "
                f"{p['cpu_ms_per_image']:.2f} | {p['peak_rss_mb']} | "
                f"{'' if ratio is None else f'{ratio:.2f}'} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workers.add_flags(parser)
    parser.add_argument(
        "--tfm_python",
        default=os.environ.get("TFM_PYTHON"),
        help="python of an environment with tf-models-official (default: $TFM_PYTHON); "
        "without it, tf-models-official is skipped",
    )
    args = parser.parse_args(argv)
    started = time.time()
    run = workers.setup(args)

    pipelines = measure(run, args.tfm_python)
    ratios, by_cpu, targets = compare(pipelines)
    output_modes = {
        dtype: {
            "images_per_second": pipelines[name]["median"],
            "cpu_ms_per_image": pipelines[name]["cpu_ms_per_image"],
            "bytes_per_image": workers.IMAGE_SIZE**2 * 3 * OUTPUT_BYTES[dtype],
            "peak_rss_mb": pipelines[name]["peak_rss_mb"],
        }
        for dtype, name in (
            ("float32", "ours"),
            ("bfloat16", "ours_bfloat16"),
            ("uint8", "ours_uint8"),
        )
    }

    result = {
        "command": "python benchmarks/input_pipeline.py"
        + (" --quick" if args.quick else "")
        + (f" --images {args.images}" if args.images != "noise" else "")
        + (f" --tfm_python {args.tfm_python}" if args.tfm_python else ""),
        "machine": machine_info(),
        "data": run.data,
        "timing": {k: getattr(run, k) for k in ("batch_size", "rounds", "windows", "window")},
        "pipelines": pipelines,
        "ratios": ratios,
        "ratios_by_cpu_time": by_cpu,
        "output_modes": output_modes,
        "targets_met": targets,
        "seconds": round(time.time() - started, 1),
    }
    if not args.tfm_python:
        result["tfm_skipped"] = "no --tfm_python (tf-models-official needs its own environment)"
    path = os.path.join(RESULTS, f"input_pipeline{run.suffix()}.json")
    workers.write(result, path)
    print(markdown_table(pipelines, ratios))
    print(f"targets: {targets}\nwrote {path} in {result['seconds']} s")


if __name__ == "__main__":
    main()
