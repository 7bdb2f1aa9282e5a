"""What skipping bad records costs `ImageNetInput`'s uint8 training path, in host CPU per image.

Claim: the training path with bad records skipped, named and counted (the default) costs at most
1.1x the host CPU per image of the same path before bad records were skipped (`--baseline_rev`,
whose pipeline failed at the first bad record: one assertion per 128 records, the decode fused with
the batching; its `input_pipeline`, `sources` and `image_ops` modules are loaded from git).

Both run at the same time, each pinned to its own core with one thread everywhere
(`input_workers.py`'s `ours_uint8_one_core` and `baseline_uint8_one_core`), cores and starting order
swapped every round, their timed windows started together: each pair of windows gives one CPU-time
ratio, and the ratios' median, min and max are the result. Data (`input_data.py`): generated
ImageNet-like JPEG TFRecords, or views of real photographs (`--images photos`); batch 64, 224x224.

With `--every_core`, each round also times the uint8 path on every core (images/s), the checked
pipeline and the baseline one after the other (`ours_uint8`, `baseline_uint8`): the throughput
ratio is that of the pooled windows' medians.

Usage (timing: hold the machine-wide lock; needs 2 cores and the git history):
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/input_pipeline_checks.py \
        [--quick] [--images photos] [--baseline_rev REV] [--every_core]

Writes `benchmarks/results/input_pipeline_checks.json` (`_photos` with photos, `_REV` with
`--baseline_rev REV`).
"""

import argparse
import os
import statistics
import time

import input_workers as workers
from common import RESULTS, machine_info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workers.add_flags(parser)
    parser.add_argument(
        "--baseline_rev",
        default=workers.BASELINE_REV,
        help="the commit whose pipeline the checked one is compared with (default: the last one "
        "that failed at the first bad record)",
    )
    parser.add_argument(
        "--every_core",
        action="store_true",
        help="also time both pipelines on every core, one after the other (images/s)",
    )
    args = parser.parse_args(argv)
    started = time.time()
    run = workers.setup(args, rounds=6, quick_rounds=4)
    run.baseline_rev = args.baseline_rev

    def pair(round_index):
        checked, baseline, ratios = workers.paired(
            run, "ours_uint8_one_core", "baseline_uint8_one_core", round_index
        )
        return dict(checked, baseline=baseline, ratios=ratios)

    jobs = {"checked_and_baseline": pair}
    if args.every_core:
        jobs["checked_every_core"] = lambda r: workers.spawn(run, "ours_uint8")
        jobs["baseline_every_core"] = lambda r: workers.spawn(run, "baseline_uint8")
    rounds = workers.interleave(run, jobs)
    pairs = rounds["checked_and_baseline"]
    checked = workers.pooled(pairs)
    baseline = workers.pooled([p["baseline"] for p in pairs])
    ratios = sum((p["ratios"] for p in pairs), [])
    median = statistics.median(ratios)

    result = {
        "command": "python benchmarks/input_pipeline_checks.py"
        + (" --quick" if args.quick else "")
        + (f" --images {args.images}" if args.images != "noise" else "")
        + (
            f" --baseline_rev {args.baseline_rev}"
            if args.baseline_rev != workers.BASELINE_REV
            else ""
        )
        + (" --every_core" if args.every_core else ""),
        "baseline_rev": args.baseline_rev,
        "machine": machine_info(),
        "data": run.data,
        "timing": {k: getattr(run, k) for k in ("batch_size", "rounds", "windows", "window")},
        "checked_cpu_ms_per_image": checked["cpu_ms_per_image"],
        "baseline_cpu_ms_per_image": baseline["cpu_ms_per_image"],
        "ratio": round(median, 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "window_ratios": [round(r, 3) for r in ratios],
        "targets_met": {"checked CPU per image <= 1.1x the baseline (median)": median <= 1.1},
        **(
            {
                "every_core": {
                    name: workers.pooled(rounds[f"{name}_every_core"])
                    for name in ("checked", "baseline")
                }
            }
            if args.every_core
            else {}
        ),
        "seconds": round(time.time() - started, 1),
    }
    rev = f"_{args.baseline_rev}" if args.baseline_rev != workers.BASELINE_REV else ""
    path = os.path.join(RESULTS, f"input_pipeline_checks{run.suffix()}{rev}.json")
    workers.write(result, path)
    print(
        f"checked {checked['cpu_ms_per_image']:.3f} CPU ms/image, {args.baseline_rev} "
        f"{baseline['cpu_ms_per_image']:.3f}: ratio {median:.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )
    for name, pooled in result.get("every_core", {}).items():
        print(
            f"{name} on every core: {pooled['median']} images/s ({pooled['min']}-{pooled['max']}), "
            f"{pooled['cpu_ms_per_image']} CPU ms/image"
        )
    print(f"targets: {result['targets_met']}\nwrote {path} in {result['seconds']} s")


if __name__ == "__main__":
    main()
