"""Weight-update sharding: the update's own time per replica, sharded against replicated.

Claim: with 8 CPU replicas and a ResNet-50-sized gradient (the model of `weight_update.py`, 26.1 M
parameters, LARS), a replica spends at least 4x less time in the optimizer update under
`DistributedOptimizer(..., weight_update_sharding=True)` than when every replica updates
every weight.

A replica's update is what runs under its `update_<i>` name scope: Keras's replicated update
(`MirroredStrategy`'s `extended.update` names each replica's share so) and the sharded update (which
uses the same names) alike. It covers the update rule, LARS's norms and trust ratios, the weight
decay and the writes of the optimizer state, and, replicated, of the weights; it leaves out the
gradient sum (sharded: the reduce-scatter) and the writes of every replica's copy of the weights
(sharded: the all-gather), which the step time in `weight_update.py` counts. Each variant trains
`STEPS` steps under TensorFlow's profiler per round, in interleaved rounds; per round, a replica's
update time is the summed duration of its ops' events per step.

Usage (timing: hold the machine-wide lock):
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/weight_update_time.py [--rounds N]

Writes `benchmarks/results/weight_update_time.json`.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import machine_info, save_result, spread, summarize  # noqa: E402
from weight_update import build_model, dataset  # noqa: E402

STEPS = 3
# An op of replica i's update: ".../update_<i>/..." or, for its k-th variable, "update_<i>_<k>".
_UPDATE_OP = re.compile(r"(?:^|/)update_(\d+)(?:_\d+)?/")


def update_seconds_per_replica(xplane_path, steps):
    """Replica id -> seconds per step of the op events under its `update_<i>` name scope."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with open(xplane_path, "rb") as f:
        space = xplane_pb2.XSpace.FromString(f.read())
    picoseconds = collections.Counter()
    for plane in space.planes:
        replica_of = {}
        for key, metadata in plane.event_metadata.items():
            match = _UPDATE_OP.search(metadata.name.split(":")[0])
            if match:
                replica_of[key] = int(match.group(1))
        for line in plane.lines:
            for event in line.events:
                if event.metadata_id in replica_of:
                    picoseconds[replica_of[event.metadata_id]] += event.duration_ps
    return {replica: ps * 1e-12 / steps for replica, ps in sorted(picoseconds.items())}


def _profiled(model, iterator, logdir):
    import tensorflow as tf

    shutil.rmtree(logdir, ignore_errors=True)
    tf.profiler.experimental.start(logdir)
    for _ in range(STEPS):
        logs = model.train_function(iterator)
    float(logs["loss"])
    tf.profiler.experimental.stop()
    (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    return update_seconds_per_replica(path, STEPS)


def measure(rounds):
    import tpu_scale

    strategies = {  # before any TensorFlow op: the 8 CPU devices exist from the start
        name: tpu_scale.create_strategy(num_cpu_replicas=8)
        for name in ("replicated", "sharded")
    }
    data = dataset()
    variants = {}
    for name, strategy in strategies.items():
        model = build_model(strategy, sharded=name == "sharded")
        model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
        variants[name] = model, iter(strategy.experimental_distribute_dataset(data))
    folder = tempfile.mkdtemp(prefix="tpu_scale_profile_")
    per_round = {name: [] for name in variants}  # per round: the replicas' median seconds
    replicas_seen = {}
    for r in range(rounds):
        for name, (model, iterator) in variants.items():
            seconds = _profiled(model, iterator, os.path.join(folder, name))
            if sorted(seconds) != list(range(8)):
                raise RuntimeError(f"{name}: update ops found for replicas {sorted(seconds)}.")
            replicas_seen[name] = seconds
            per_round[name].append(statistics.median(seconds.values()))
            print(f"  round {r + 1} {name}: {per_round[name][-1] * 1e3:.1f} ms", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    base, sharded = per_round["replicated"], per_round["sharded"]
    ratios = [b / s for b, s in zip(base, sharded)]
    return {
        "claim": "a replica's update time, replicated / sharded >= 4 (8 CPU replicas, LARS)",
        "setup": {
            "parameters": variants["replicated"][0].count_params(),
            "replicas": 8,
            "optimizer": "LARS",
            "steps_per_round": STEPS,
            "rounds": rounds,
        },
        "update_seconds_per_replica": {
            "replicated": summarize(base),
            "sharded": summarize(sharded, baseline=base),
        },
        "last_round_by_replica": replicas_seen,
        "per_round_ratio": spread(ratios),
        "met": statistics.median(ratios) >= 4.0,
        "machine": machine_info(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="profiled rounds of each variant")
    args = parser.parse_args(argv)
    result = measure(args.rounds)
    save_result("weight_update_time", result)


if __name__ == "__main__":
    main()
