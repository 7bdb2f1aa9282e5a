"""The plan: everything the CLI prints, as a JSON-ready dict, and its text table."""

import numpy as np

from tpu_scale.plan.catalog import gradient_bytes
from tpu_scale.plan.cost import price_algorithms
from tpu_scale.plan.sizing import input_rate, suggest_bn_group
from tpu_scale.plan.update import SOURCES as UPDATE_SOURCES
from tpu_scale.plan.update import UPDATE_BYTES_PER_PARAM, weight_update


def plan(
    hardware,
    model=None,
    params=None,
    dtype="float32",
    per_core_batch=None,
    target_images_per_sec=None,
    optimizer="lars",
):
    """Everything the CLI prints, as a JSON-ready dict.

    Args:
      hardware: a `Hardware` (`tpu_slice`, `gpu_cluster`).
      model, params, dtype: the gradient (see `gradient_bytes`); default model `"resnet50"`.
      per_core_batch: examples per replica, for the BN group and the step-time share; optional.
      target_images_per_sec: the job's target; default the node's known rate.
      optimizer: the update to price, one of `tpu_scale.plan.update.OPTIMIZERS`.

    Returns:
      dict with `hardware`, `model`, `algorithms` (per algorithm: `steps`, `seconds`, ...), `best`,
      `input`, `bn_group` (or None), `step` (or None), `weight_update` (see
      `tpu_scale.plan.update.weight_update`; its shares of the step only with a step time whose
      rate fits the model: ResNet-50 at the node's known rate, or a given target) and `sources`.
    """
    if model is None and params is None:
        model = "resnet50"
    num_params, num_bytes = gradient_bytes(model, params, dtype)
    algorithms = price_algorithms(hardware, num_bytes)
    rate = input_rate(hardware, target_images_per_sec)
    result = {
        "hardware": hardware.describe(),
        "model": {
            "name": model or "custom",
            "params": num_params,
            "dtype": dtype,
            "bytes": num_bytes,
        },
        "algorithms": algorithms,
        "best": min(algorithms, key=lambda a: algorithms[a]["seconds"]),
        "input": rate,
        "bn_group": None,
        "step": None,
        "weight_update": None,
        "sources": list(hardware.sources),
    }
    step_seconds = None
    if per_core_batch is not None:
        bn = suggest_bn_group(hardware.mesh, per_core_batch)
        bn[f"{hardware.node}s_per_group"] = len(np.unique(hardware.node_ids()[bn["first_group"]]))
        result["bn_group"] = bn
        global_batch = per_core_batch * hardware.num_replicas
        step_seconds = (
            global_batch / rate["target_images_per_sec"] if rate["target_images_per_sec"] else None
        )
        result["step"] = {
            "global_batch": int(global_batch),
            "seconds_at_target": step_seconds,
            "gradient_sum_share": {
                a: (v["seconds"] / step_seconds if step_seconds else None)
                for a, v in algorithms.items()
            },
        }
    known_rate = target_images_per_sec is not None or model == "resnet50"
    result["weight_update"] = weight_update(
        hardware, num_params, optimizer, step_seconds if known_rate else None
    )
    if result["weight_update"] is not None:
        result["sources"] += list(UPDATE_SOURCES)
    return result


def strategy_hardware(strategy):
    """The planner's `Hardware` for the hardware `create_strategy` found (`auto_algorithm.hardware`),
    or None where it has no figures for it or the strategy carries none."""
    from tpu_scale.plan import choice

    found = getattr(getattr(strategy, "auto_algorithm", None), "hardware", None)
    if found is None:
        return None
    hardware = choice.hardware_cluster(**found)
    if hardware is not None and tuple(hardware.mesh.shape) != tuple(strategy.mesh.shape):
        return None  # a mesh the figures do not describe
    return hardware


def sharding_advice(strategy, model):
    """One line on what `DistributedOptimizer(..., weight_update_sharding=True)` would save for `model`
    under `strategy`, priced on the hardware `create_strategy` found
    (`strategy.auto_algorithm.hardware`); "" when the planner has no figure (unknown hardware, an
    optimizer it does not price) or nothing to save (a single replica, a TPU).

    Args:
      strategy: a strategy made by `create_strategy`.
      model: a compiled Keras model (its trainable variables and optimizer).
    """
    hardware = strategy_hardware(strategy)
    optimizer = getattr(model, "optimizer", None)
    while getattr(optimizer, "inner_optimizer", None) is not None:  # a wrapper's own optimizer
        optimizer = optimizer.inner_optimizer
    optimizer = type(optimizer).__name__.lower()
    if hardware is None or optimizer not in UPDATE_BYTES_PER_PARAM:
        return ""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    w = weight_update(hardware, params, optimizer)
    if w is None or not w["in_package"] or w["sharded_over"] < 2:
        return ""
    state = w["state_bytes_per_replica"]
    return (
        f"tpu_scale.plan: weight_update_sharding=True would cut the {optimizer} update from "
        f"{format_seconds(w['replicated_seconds'])} to {format_seconds(w['sharded_seconds'])} per "
        f"step and its state per replica from {format_bytes(state['replicated'])} to "
        f"{format_bytes(state['sharded'])} on this hardware "
        "(tpu_scale.DistributedOptimizer(optimizer, weight_update_sharding=True))"
    )


def format_bytes(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s):
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def format_plan(result):
    """The plan as a human-readable table and notes."""
    c, m = result["hardware"], result["model"]
    node = c["node"]
    lines = [
        f"{c['name']}: {c['replicas']} replicas on {c['nodes']} {node}s "
        f"({'x'.join(map(str, c['node_shape']))}), {c['hosts']} host(s), mesh {c['mesh_shape'][0]}x"
        f"{c['mesh_shape'][1]}",
        f"gradient: {m['name']} {m['params']:,} params in {m['dtype']} = "
        f"{format_bytes(m['bytes'])} per replica",
        "",
        f"{'algorithm':<24}{'steps':>7}{'local':>7}{'bytes/' + node:>13}"
        f"{'latency':>11}{'transfer':>11}{'predicted':>11}",
    ]
    for name, a in result["algorithms"].items():
        lines.append(
            f"{name:<24}{a['steps']:>7}{a['local_steps']:>7}{format_bytes(a['bytes_per_node']):>13}"
            f"{format_seconds(a['latency_seconds']):>11}{format_seconds(a['transfer_seconds']):>11}"
            f"{format_seconds(a['seconds']):>11}"
        )
    lines.append(f"fastest: {result['best']}")
    r = result["input"]
    lines += [
        "",
        f"input: {r['target_images_per_sec']:,.0f} img/s ({r['basis']}) -> {r['per_host']:,.0f} "
        "img/s "
        f"per host over {r['hosts']} host(s), {r[f'per_{node}']:,.0f} per {node}",
    ]
    if result["bn_group"]:
        b = result["bn_group"]
        lines.append(
            f"BN group for per-core batch {b['per_core_batch']}: {b['group_size']} replicas "
            f"(a {b['tile_replicas'][0]}x{b['tile_replicas'][1]} tile of the mesh on "
            f"{b[f'{node}s_per_group']} "
            f"{node}(s)), {b['num_groups']} groups; {b['note']}"
        )
    if result["step"] and result["step"]["seconds_at_target"]:
        s = result["step"]
        share = s["gradient_sum_share"][result["best"]]
        lines.append(
            f"step: global batch {s['global_batch']:,} -> "
            f"{format_seconds(s['seconds_at_target'])} per step at the "
            f"target rate; {result['best']} takes {share:.1%} of it if not overlapped"
        )
    w = result.get("weight_update")
    if w:
        state = w["state_bytes_per_replica"]
        lines.append(
            f"weight update ({w['optimizer']}): {format_seconds(w['replicated_seconds'])} per step "
            f"replicated, {format_seconds(w['sharded_seconds'])} sharded "
            f"(weight_update_sharding=True); optimizer state per replica "
            f"{format_bytes(state['replicated'])} -> {format_bytes(state['sharded'])}"
        )
        if w["share_of_step"]:
            share = w["share_of_step"]
            lines.append(
                f"  {share['replicated']:.1%} of the step replicated, {share['sharded']:.2%} "
                f"sharded: predicted step {w['step_speedup']:.3f}x faster with sharding"
            )
        else:
            lines.append("  its share of the step: give --target_images_per_sec for this model")
        if w["in_package"]:
            hosts = " across the hosts" if c["hosts"] > 1 else ""
            lines.append(f"  sharded over all {w['sharded_over']} replicas{hosts}")
        else:
            lines.append(
                f"  sharded over all {w['sharded_over']} replicas, as XLA shards on TPU: "
                "create_strategy does not shard the update on a TPU yet"
            )
    lines += ["", "figures and assumptions:"] + [f"  - {s}" for s in result["sources"]]
    return "\n".join(lines)
