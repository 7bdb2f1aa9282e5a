"""A user's process, as the package leaves it: what importing it, creating a strategy and training
with `fit` change in it, seen from a fresh process that already holds TensorFlow and Keras.

Nothing may change. Everything a user's process has is compared before and after: environment variables, every
thread's scheduling policy, signal handlers, stderr's file, the cycle collector, hidden
`sys.modules` entries, log levels, warnings filters, Keras's global dtype policy and the methods
every loaded Keras and TensorFlow class resolves, inherited ones included.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_USER_PROGRAM = r"""
import gc, json, logging, os, signal, sys, tempfile, warnings

import numpy as np
import tensorflow as tf
import keras
# Keras's TensorBoard callback imports TensorBoard at its first summary, and that import (boto3's)
# adds a warnings filter whoever writes the summary: loaded first, as in a process that has
# written one.
import tensorboard.summary

def methods():
    # Every callable each loaded Keras or TensorFlow class resolves, by identity of what it finds.
    seen = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if not name.startswith(("keras", "tensorflow")):
            continue
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or not cls.__module__.startswith(("keras", "tensorflow")):
                continue
            key = f"{cls.__module__}.{cls.__qualname__}"
            if key in seen:
                continue
            found = {}
            for attr in dir(cls):
                # What the class resolves: the raw entry of the first class in its MRO that has it.
                owner = next((c for c in cls.__mro__ if attr in vars(c)), None)
                if owner is None or owner is object:
                    continue
                raw = vars(owner)[attr]
                if callable(raw) or isinstance(raw, (staticmethod, classmethod, property)):
                    found[attr] = (id(raw), owner.__module__)
            seen[key] = found
    return seen

def threads():
    policies = {}
    for t in os.listdir("/proc/self/task"):
        try:
            policies[t] = os.sched_getscheduler(int(t))
        except OSError:
            pass
    return sorted(set(policies.values()))

def snapshot():
    stderr = os.fstat(2)
    return dict(
        environ=dict(os.environ),
        threads=threads(),
        signals={s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
        stderr=(stderr.st_dev, stderr.st_ino, id(sys.stderr)),
        gc=(gc.isenabled(), gc.get_freeze_count(), gc.get_threshold()),
        hidden_modules=sorted(k for k, v in sys.modules.items() if v is None),
        log_levels={n: l.level for n, l in logging.root.manager.loggerDict.items() if isinstance(l, logging.Logger)},
        root_log=(logging.root.level, len(logging.root.handlers)),
        warnings=[repr(f) for f in warnings.filters],
        dtype_policy=keras.mixed_precision.global_policy().name,
        methods=methods(),
    )

before = snapshot()

import tpu_scale
from tpu_scale import data, layers, training

strategy = tpu_scale.create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4))
folder = tempfile.mkdtemp()
data.make_synthetic_imagenet(folder, num_classes=4, train_examples=64, validation_examples=21, image_shape=(16, 16))
train = data.ImageNetInput(f"{folder}/train-*", is_training=True, image_size=16, global_batch_size=32)
validation = data.exact_evaluation(
    data.ImageNetInput(f"{folder}/validation-*", is_training=False, image_size=16, global_batch_size=32),
    strategy, 21)  # 21 examples in batches of 32 on 8 replicas: an uneven last batch
with strategy.scope():
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, strides=2, padding="same"),
        layers.DistributedBatchNormalization(group_size=4),
        keras.layers.ReLU(),
        keras.layers.DepthwiseConv2D(3, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(5),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
model.fit(training.train_dataset(strategy, train), epochs=2, steps_per_epoch=2,
          validation_data=validation.dataset, validation_steps=validation.steps,
          callbacks=training.run_callbacks(os.path.join(folder, "run"), strategy), verbose=0)
model.evaluate(validation.dataset, steps=validation.steps, verbose=0)

after = snapshot()
changed = {}
for key in ("environ", "threads", "signals", "stderr", "gc", "hidden_modules", "root_log", "warnings", "dtype_policy"):
    if before[key] != after[key]:
        changed[key] = [before[key], after[key]] if key != "environ" else {
            k: [before[key].get(k), after[key].get(k)]
            for k in set(before[key]) | set(after[key]) if before[key].get(k) != after[key].get(k)}
levels = {n: [l, after["log_levels"].get(n)] for n, l in before["log_levels"].items() if after["log_levels"].get(n) != l}
if levels:
    changed["log_levels"] = levels
methods = sorted(
    [cls, attr, after["methods"][cls].get(attr, (None, None))[1]]
    for cls, found in before["methods"].items()
    for attr, value in found.items()
    if after["methods"].get(cls, {}).get(attr, (None,))[0] != value[0])
print("CHANGES " + json.dumps(dict(changed=changed, methods=methods, classes=len(before["methods"]))))
"""


def test_import_create_strategy_and_fit_leave_the_process_as_found():
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _USER_PROGRAM], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("CHANGES ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[0][len("CHANGES ") :])
    assert report["classes"] > 1000  # Keras's and TensorFlow's classes were looked at
    assert report["changed"] == {}
    # No method of any Keras or TensorFlow class is replaced or wrapped.
    assert report["methods"] == [], report["methods"][:20]
