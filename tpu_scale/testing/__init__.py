"""Helpers for testing distributed training on one machine.

run_workers      runs a function in N localhost worker processes under TF_CONFIG (a real cluster)
collective_ops   the collective ops of a graph and of every function it calls
group_size       the static group size of a collective op
train_graphs     the graphs Keras traced for `model.fit`
write_digits_folder  scikit-learn's digits as a folder of class folders (real images)

The one-node Slurm cluster the tests start (root daemons) lives with them, in
`tests/slurm_cluster.py`.
"""

from tpu_scale.testing.digits import write_digits_folder
from tpu_scale.testing.graphs import collective_ops, group_size, train_graphs
from tpu_scale.testing.multiworker import run_workers

__all__ = [
    "collective_ops",
    "group_size",
    "run_workers",
    "train_graphs",
    "write_digits_folder",
]
