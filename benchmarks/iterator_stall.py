"""Iterator deletion stalls: seconds to delete a distributed tf.data iterator on this host.

tf.data's autotuning thread (one per iterator, `Model::OptimizeLoop`) sleeps between
optimizations for a period that doubles up to 60 s. Deleting the iterator cancels it and wakes it,
but `CancellationManager` sets its "cancelled" flag only after the wake-up callbacks have run: a
thread that wakes first sees no cancellation and sleeps again for the rest of its period, and the
deletion waits for it. Keras deletes an iterator at every evaluation and at the end of `fit`; an
iterator that lived for T seconds can stall for about T.

Each mode runs in its own process (a scheduling policy is process-wide) on a `MirroredStrategy` of 8
virtual CPUs, as the example runs, and times --deletions deletions of an iterator over a small
parallel-map pipeline that was read for --lifetime seconds first:

    default           TensorFlow as it comes
    sched_batch       `tpu_scale._workarounds.batch_scheduling()` alone
    no_autotune       the dataset's `options.autotune.enabled = False` alone (the per-replica
                      iterators keep theirs)
    untuned_replicas  `tpu_scale._workarounds.replica_iterators_untuned()` alone
    create_strategy   the strategy from `tpu_scale.create_strategy(num_cpu_replicas=8)`, with
                      the workarounds it applies (both of the two above)

A deletion over 1 s counts as stalled. Usage:

    python benchmarks/iterator_stall.py            # 12 deletions per mode, 3 s lifetime
    python benchmarks/iterator_stall.py --quick    # 6 deletions per mode

Writes `benchmarks/results/iterator_stall.json`. The two workarounds can go once the `default` mode
shows no stalled deletion.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from common import RESULTS, machine_info, run_child, write_child_output  # noqa: E402

MODES = ("default", "sched_batch", "no_autotune", "untuned_replicas", "create_strategy")
STALLED_SECONDS = 1.0


def child(mode, deletions, lifetime):
    """Seconds each deletion took, in this process, under `mode`."""
    import tensorflow as tf

    import tpu_scale
    from tpu_scale import _workarounds

    if mode == "create_strategy":
        strategy = tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(8)]
        )
        if mode == "sched_batch":
            _workarounds.batch_scheduling()
        if mode == "untuned_replicas":
            _workarounds.replica_iterators_untuned()
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(8)])
    data = tf.data.Dataset.range(10**9)
    data = data.map(lambda i: tf.fill([32, 32, 3], tf.cast(i, tf.float32)), tf.data.AUTOTUNE)
    data = data.batch(64).prefetch(tf.data.AUTOTUNE)
    if mode == "no_autotune":
        options = tf.data.Options()
        options.autotune.enabled = False
        data = data.with_options(options)
    distributed = strategy.experimental_distribute_dataset(data)
    seconds = []
    for _ in range(deletions):
        iterator = iter(distributed)
        start = time.monotonic()
        while time.monotonic() - start < lifetime:
            next(iterator)
        start = time.monotonic()
        del iterator
        seconds.append(round(time.monotonic() - start, 3))
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--deletions", type=int)
    parser.add_argument("--lifetime", type=float, default=3.0)
    parser.add_argument("--out", default=os.path.join(RESULTS, "iterator_stall.json"))
    parser.add_argument("--_mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--_child_output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    deletions = args.deletions or (6 if args.quick else 12)
    if args._mode:
        write_child_output(args._child_output, child(args._mode, deletions, args.lifetime))
        return 0
    out = {"machine_at_start": machine_info(), "deletions": deletions, "lifetime": args.lifetime}
    out["modes"] = {}
    for mode in MODES:
        options = ["--_mode", mode, "--deletions", str(deletions), "--lifetime", str(args.lifetime)]
        seconds = run_child(os.path.abspath(__file__), options, timeout=3600)
        stalled = [s for s in seconds if s > STALLED_SECONDS]
        out["modes"][mode] = {
            "seconds": seconds,
            "stalled": len(stalled),
            "median": statistics.median(seconds),
            "max": max(seconds),
            "stalled_seconds": round(sum(stalled), 1),
        }
        print(
            f"{mode:16s} {len(stalled)}/{deletions} deletions stalled, "
            f"median {statistics.median(seconds):.3f} s, max {max(seconds):.1f} s",
            flush=True,
        )
    out["machine_at_end"] = machine_info()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
