"""Host CPU per image of `ImageNetInput`'s uint8 training path against the floor.

Claim: the uint8 path costs at most 1.1x the host CPU per image of the work it cannot avoid, the
floor: decode-and-crop, resize and flip as a graph loop of TensorFlow's own kernels over in-memory
JPEGs (no tf.data), pinned to one core (`input_workers.py`'s `floor`).

Measured like for like, three ways, in interleaved rounds:

  one core     the uint8 path pinned to one core, one tf.data thread and one thread in each of
               TensorFlow's op pools, against the floor on one core, run one after the other.
  every core   the uint8 path on every core against the floor run on every core at once (one
               process per core): what the same kernels cost when the cores share caches and memory.
  paired       the pinned uint8 path and the floor at the same time, each on its own core (cores
               and starting order swapped every round), their windows started together: a load from
               other users of the machine lifts both alike, so each pair of windows gives one
               ratio, and the ratios' median and spread answer "within 1.1x" where runs minutes
               apart are too noisy to.

Data (`input_data.py`): generated ImageNet-like JPEG TFRecords, or views of real photographs
(`--images photos`). Batch 64, 224x224 output.

Usage (timing: hold the machine-wide lock):
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/input_pipeline_floor.py \
        [--quick] [--images photos]

Writes `benchmarks/results/input_pipeline_floor.json` (`_photos` with photos).
"""

import argparse
import os
import time

import input_workers as workers
from common import RESULTS, machine_info


def measure(run):
    """The uint8 path and the floor on one core, on every core and paired: {name: pooled
    windows}, and the paired rounds' window ratios."""

    def paired(round_index):
        uint8, floor, ratios = workers.paired(run, "ours_uint8_one_core", "floor", round_index)
        return dict(uint8, floor=floor, ratios=ratios)

    jobs = {
        "uint8_one_core": lambda r: workers.spawn(run, "ours_uint8_one_core", core=r % run.cores),
        "floor_one_core": lambda r: workers.spawn(run, "floor", core=r % run.cores),
        "uint8_every_core": lambda r: workers.spawn(run, "ours_uint8"),
        "floor_every_core": lambda r: workers.on_every_core(run, "floor"),
    }
    if run.cores >= 2:
        jobs["uint8_paired"] = paired
    results = workers.interleave(run, jobs)
    pairs = results.get("uint8_paired", [])
    if pairs:
        results["floor_paired"] = [r["floor"] for r in pairs]
    pipelines = {name: workers.pooled(rs) for name, rs in results.items()}
    return pipelines, sum((r["ratios"] for r in pairs), [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workers.add_flags(parser)
    args = parser.parse_args(argv)
    started = time.time()
    run = workers.setup(args)

    pipelines, window_ratios = measure(run)
    table = {}
    for way in ("one_core", "every_core", "paired"):
        if f"uint8_{way}" in pipelines:
            uint8 = pipelines[f"uint8_{way}"]["cpu_ms_per_image"]
            floor = pipelines[f"floor_{way}"]["cpu_ms_per_image"]
            table[way] = {
                "uint8_cpu_ms_per_image": uint8,
                "floor_cpu_ms_per_image": floor,
                "ratio": round(uint8 / floor, 3),
            }
    if window_ratios:
        # Paired: the median of the windows' own ratios, not the ratio of the medians.
        table["paired"].update(workers.spread(window_ratios, digits=3))
        table["paired"]["ratio"] = table["paired"].pop("median")
    targets = {f"uint8 <= 1.1x the floor, {way}": t["ratio"] <= 1.1 for way, t in table.items()}

    result = {
        "command": "python benchmarks/input_pipeline_floor.py"
        + (" --quick" if args.quick else "")
        + (f" --images {args.images}" if args.images != "noise" else ""),
        "machine": machine_info(),
        "data": run.data,
        "timing": {k: getattr(run, k) for k in ("batch_size", "rounds", "windows", "window")},
        "pipelines": pipelines,
        "uint8_against_floor": table,
        "paired_window_ratios": [round(r, 3) for r in window_ratios],
        "targets_met": targets,
        "seconds": round(time.time() - started, 1),
    }
    path = os.path.join(RESULTS, f"input_pipeline_floor{run.suffix()}.json")
    workers.write(result, path)
    print("| uint8 path against the floor | uint8, CPU ms / image | floor | ratio |")
    print("|---|---|---|---|")
    for way, t in table.items():
        spread = f" ({t['min']:.3f}-{t['max']:.3f})" if "min" in t else ""
        print(
            f"| {way.replace('_', ' ')} | {t['uint8_cpu_ms_per_image']:.2f} | "
            f"{t['floor_cpu_ms_per_image']:.2f} | {t['ratio']:.3f}{spread} |"
        )
    print(f"targets: {targets}\nwrote {path} in {result['seconds']} s")


if __name__ == "__main__":
    main()
