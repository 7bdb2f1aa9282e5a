"""Graph inspection: the collective ops a traced step holds, and their group sizes."""

import tensorflow as tf

COLLECTIVE_OPS = ("CollectiveAllToAllV2", "CollectiveReduceV2", "CollectiveGatherV2")


def collective_ops(graph, types=COLLECTIVE_OPS, seen=None):
    """Every op of `types` in `graph` and the functions it calls (tf.function, cond, while).

    Args:
      graph: a `tf.Graph` or `FuncGraph`.
      types: the op types to collect.
      seen: function names already walked (internal).

    Returns:
      A list of `tf.Operation`s.
    """
    seen = set() if seen is None else seen
    found = []
    for op in graph.get_operations():
        if op.type in types:
            found.append(op)
        for attr in ("f", "then_branch", "else_branch", "body", "cond"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError, TypeError):
                continue
            if name in seen:
                continue
            seen.add(name)
            function = graph._get_function(name)
            if getattr(function, "graph", None) is not None:
                found.extend(collective_ops(function.graph, types, seen))
    return found


def group_size(op):
    """The static group size of a V2 collective op (its second input)."""
    size = tf.get_static_value(op.inputs[1])
    if size is None:
        raise ValueError(f"{op.type} has no static group size")
    return int(size)


def train_graphs(model):
    """The graphs Keras traced for `model.fit`: every tf.function its train function closes over,
    directly or through the Python functions it closes over (keras-nightly wraps the step)."""
    graphs, seen, pending = [], set(), [model.train_function]
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        if isinstance(function, tf.types.experimental.PolymorphicFunction):
            graphs.extend(c.graph for c in function._list_all_concrete_functions())
            function = getattr(function, "python_function", None)
        for cell in getattr(function, "__closure__", None) or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    if not graphs:
        raise ValueError("model.train_function traced no tf.function; call fit first")
    return graphs
