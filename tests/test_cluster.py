"""`tpu_scale.cluster`: which cluster a process joins, from its arguments and environment.

The multi-process runs (the launcher's `TF_CONFIG`, a Slurm step) are in tests/test_launch.py;
these check the order, the errors and the Kubernetes manifest's `TF_CONFIG` without processes.
"""

import json
import os
import re

import pytest
import tensorflow as tf

from tpu_scale import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "examples", "kubernetes", "train_imagenet.yaml")
TWO_WORKERS = {"cluster": {"worker": ["host1:2222", "host2:2222"]}}
SLURM_STEP = {
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}


@pytest.fixture
def environ(monkeypatch, tmp_path):
    """A clean environment: no cluster variables, and no nvidia-smi on the PATH."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in ("TF_CONFIG", "TPU_NAME", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", str(tmp_path))

    def set_all(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_all


def tf_config(index=0, **config):
    return json.dumps(dict(TWO_WORKERS, task={"type": "worker", "index": index}, **config))


def test_this_host_alone(environ):
    found = cluster.discover()
    assert (found.source, found.num_workers, found.is_multi_worker) == ("local", 1, False)
    environ(TF_CONFIG=json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker"}}))
    assert cluster.discover().source == "local"  # one worker is no cluster
    environ(SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0", SLURM_NTASKS="1")
    assert cluster.discover().source == "local"  # nor is a Slurm step of one task


def test_tf_config_of_two_workers(environ):
    environ(TF_CONFIG=tf_config(1))
    found = cluster.discover()
    assert (found.source, found.num_workers, found.is_multi_worker) == ("TF_CONFIG", 2, True)
    assert isinstance(found.resolver, tf.distribute.cluster_resolver.TFConfigClusterResolver)
    assert (found.resolver.task_type, found.resolver.task_id) == ("worker", 1)
    assert "task worker 1" in found.description


def test_slurm_step_of_two_tasks_on_cpu_nodes(environ):
    environ(**SLURM_STEP, TPU_SCALE_SLURM_PORT_BASE="7000")
    found = cluster.discover()
    assert (found.source, found.num_workers, found.is_multi_worker) == ("Slurm", 2, True)
    assert found.resolver.cluster_spec().as_dict() == {"worker": ["node1:7000", "node2:7000"]}
    assert found.resolver.get_task_info() == ("worker", 1)
    assert found.resolver.num_accelerators() == {"GPU": 0}


def test_slurm_gpus_per_task_come_from_slurm(environ):
    environ(**SLURM_STEP, SLURM_GPUS_ON_NODE="4", SLURM_GPUS_PER_TASK="a100:4")
    try:
        found = cluster.discover()
        assert found.resolver.num_accelerators() == {"GPU": 4}
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # TensorFlow's resolver sets it


def _block_layout(nodes, tasks_per_node):
    """(node, local index) of each SLURM_PROCID under Slurm's default block distribution."""
    return [(node, k) for node, tasks in zip(nodes, tasks_per_node) for k in range(tasks)]


@pytest.mark.parametrize(
    "nodelist,tasks_per_node,nodes,counts",
    [
        ("n[9-10]", "1(x2)", ["n9", "n10"], [1, 1]),
        ("n[1-2,10]", "1(x3)", ["n1", "n2", "n10"], [1, 1, 1]),
        ("n[9-10]", "2(x2)", ["n9", "n10"], [2, 2]),
        ("n[1-2,10]", "2,1,2", ["n1", "n2", "n10"], [2, 1, 2]),
    ],
)
def test_slurm_task_i_is_procid_i_on_its_own_node(environ, nodelist, tasks_per_node, nodes, counts):
    layout = _block_layout(nodes, counts)
    want = [f"{node}:{7000 + k}" for node, k in layout]
    for procid, (node, local) in enumerate(layout):
        environ(
            SLURM_STEP_NUM_TASKS=str(len(layout)),
            SLURM_STEP_NODELIST=nodelist,
            SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
            SLURM_PROCID=str(procid),
            SLURMD_NODENAME=node,
            SLURM_LOCALID=str(local),
            TPU_SCALE_SLURM_PORT_BASE="7000",
        )
        found = cluster.discover()  # checks the task's own address against its node and index
        assert found.resolver.cluster_spec().as_dict() == {"worker": want}
        assert found.resolver.get_task_info() == ("worker", procid)


def test_slurm_gpus_follow_the_task_order(environ):
    # n9 runs tasks 0 and 1, n10 task 2; task 1 takes n9's second pair of GPUs.
    environ(
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_NODELIST="n[9-10]",
        SLURM_STEP_TASKS_PER_NODE="2,1",
        SLURM_PROCID="1",
        SLURMD_NODENAME="n9",
        SLURM_LOCALID="1",
        SLURM_GPUS_ON_NODE="4",
        SLURM_GPUS_PER_TASK="2",
    )
    try:
        found = cluster.discover()
        assert found.resolver.cluster_spec().as_dict() == {
            "worker": ["n9:8888", "n9:8889", "n10:8888"]
        }
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # TensorFlow's resolver sets it


def test_tensorflows_slurm_resolver_sorts_hosts_as_strings(environ):
    # What `_workarounds.slurm_node_order` puts right: TensorFlow gives SLURM_PROCID 0, which
    # runs on n9, the address of n10. When this fails, TensorFlow keeps the node list's order.
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm_lib

    environ(
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="n[9-10]",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURM_PROCID="0",
    )
    theirs = slurm_lib.SlurmClusterResolver(gpus_per_node=1, auto_set_gpu=False)
    assert theirs.cluster_spec().as_dict() == {"worker": ["n10:8888", "n9:8888"]}
    assert theirs.get_task_info() == ("worker", 0)


@pytest.mark.parametrize(
    "variables,runs_on",
    [
        # --distribution=cyclic: task 1 on the second node, though the block layout puts it on n9.
        ({"SLURM_PROCID": "1", "SLURMD_NODENAME": "n10", "SLURM_LOCALID": "0"}, "runs on n10,"),
        # --distribution=plane or a hostfile: the right node, another task's port.
        ({"SLURM_PROCID": "0", "SLURMD_NODENAME": "n9", "SLURM_LOCALID": "1"}, "n9 as its task 1"),
    ],
)
def test_a_task_slurm_placed_otherwise_is_an_error(environ, variables, runs_on):
    environ(
        SLURM_STEP_NUM_TASKS="4",
        SLURM_STEP_NODELIST="n[9-10]",
        SLURM_STEP_TASKS_PER_NODE="2(x2)",
        **variables,
    )
    with pytest.raises(ValueError, match="needs Slurm's default block distribution") as e:
        cluster.discover()
    assert runs_on in str(e.value) and "--distribution=block" in str(e.value)


def test_an_explicit_resolver_comes_first(environ):
    environ(TF_CONFIG=tf_config(0), **SLURM_STEP)  # would conflict without the argument
    given = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["a:1", "b:1", "c:1"]}), task_type="worker", task_id=2
    )
    found = cluster.discover(cluster_resolver=given)
    assert (found.source, found.num_workers, found.resolver) == ("cluster_resolver", 3, given)
    with pytest.raises(ValueError, match="tpu= or cluster_resolver=, not both"):
        cluster.discover(tpu="local", cluster_resolver=given)


def test_a_tpu_comes_from_the_argument_or_tpu_name(environ):
    assert (cluster.discover(tpu="local").source, cluster.discover(tpu="local").tpu) == (
        "tpu",
        "local",
    )
    environ(TPU_NAME="my-tpu")
    found = cluster.discover()
    assert (found.source, found.tpu, found.is_multi_worker) == ("tpu", "my-tpu", False)


@pytest.mark.parametrize(
    "variables,names",
    [
        ({"TPU_NAME": "my-tpu", "TF_CONFIG": tf_config()}, ["TPU_NAME='my-tpu'", "TF_CONFIG"]),
        ({"TF_CONFIG": tf_config(), **SLURM_STEP}, ["TF_CONFIG", "SLURM_STEP_NUM_TASKS=2"]),
        ({"TPU_NAME": "t", **SLURM_STEP}, ["TPU_NAME='t'", "SLURM_STEP_NUM_TASKS=2"]),
    ],
)
def test_two_sources_are_an_error_naming_both(environ, variables, names):
    environ(**variables)
    with pytest.raises(ValueError, match="name a cluster; this process can join only one") as e:
        cluster.discover()
    assert all(name in str(e.value) for name in names), str(e.value)


@pytest.mark.parametrize(
    "config,message",
    [
        ("{not json", "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps(TWO_WORKERS), 'names 2 workers but not this process\'s "task"'),
        (tf_config(2), r"task worker:2 is not in its cluster"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), 'has a "task" but no "cluster"'),
        (json.dumps({"cluster": {"ps": ["p:1"], "worker": ["w:1"]}}), '"ps" tasks'),
    ],
)
def test_half_set_tf_config_is_an_error(environ, config, message):
    environ(TF_CONFIG=config)
    with pytest.raises(ValueError, match=message):
        cluster.discover()


@pytest.mark.parametrize(
    "variables,message",
    [
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, "without SLURM_STEP_NODELIST, "),
        ({**SLURM_STEP, "SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not a whole number"),
        ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, "SLURM_NTASKS=4 tasks but not in a job step"),
        ({**SLURM_STEP, "TPU_SCALE_SLURM_PORT_BASE": "x"}, "TPU_SCALE_SLURM_PORT_BASE='x'"),
    ],
)
def test_half_set_slurm_is_an_error(environ, variables, message):
    environ(**variables)
    with pytest.raises(ValueError, match=re.escape(message)):
        cluster.discover()


def test_cpus_per_worker_from_the_launcher(environ):
    assert cluster.cpus_per_worker() is None
    environ(TPU_SCALE_CPUS_PER_WORKER="3")
    assert cluster.cpus_per_worker() == 3
    environ(TPU_SCALE_CPUS_PER_WORKER="0")
    with pytest.raises(ValueError, match="TPU_SCALE_CPUS_PER_WORKER=0"):
        cluster.cpus_per_worker()


def _expand(value, variables):
    """Kubernetes' expansion of `$(NAME)` in an env value, from the entries defined before it."""
    return re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), value)


def test_kubernetes_manifest_tf_config_is_the_indexed_jobs_pods(environ):
    import yaml  # PyYAML

    with open(MANIFEST) as f:
        service, job, policy = yaml.safe_load_all(f)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    port = container["ports"][0]["containerPort"]
    count = job["spec"]["completions"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == count
    assert (
        pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    )
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    # The workers' unauthenticated port admits the job's own pods and nothing else.
    pods_of_the_job = {"matchLabels": {"job-name": job["metadata"]["name"]}}
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == pods_of_the_job
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": pods_of_the_job}]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    # The pods of an indexed Job are named <job>-<index>, reachable as <job>-<index>.<subdomain>.
    pods = [f"{job['metadata']['name']}-{i}.{pod['subdomain']}:{port}" for i in range(count)]
    for index in range(count):
        variables = {}
        for entry in container["env"]:
            if "valueFrom" in entry:  # the Job's completion index, from the pod's annotation
                path = entry["valueFrom"]["fieldRef"]["fieldPath"]
                assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                variables[entry["name"]] = str(index)
            else:
                variables[entry["name"]] = _expand(entry["value"], variables)
        environ(TF_CONFIG=variables["TF_CONFIG"])
        found = cluster.discover()
        assert found.source == "TF_CONFIG" and found.num_workers == count
        assert found.resolver.cluster_spec().as_dict() == {"worker": pods}
        assert (found.resolver.task_type, found.resolver.task_id) == ("worker", index)
