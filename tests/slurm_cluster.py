"""A real one-node Slurm cluster on this host, for tests: munged, slurmctld and slurmd.

    with SlurmCluster() as slurm:
        job = slurm.sbatch("examples/slurm/train_imagenet_cpu.sbatch", "--epochs", "2",
                           options=["--nodes=1", "--ntasks-per-node=2"], output="job.out")
        state = slurm.wait(job, timeout=300)   # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

The cluster lives in a temporary folder of its own: a generated `slurm.conf` (this host's short
name with the CPUs and memory `slurmd -C` finds, free ports, `ProctrackType=proctrack/linuxproc`,
`TaskPlugin=task/none`, `select/cons_tres`, no accounting), its state, spool and log folders, and a
munge key with a munged on a socket of its own (`AuthInfo=socket=...`), so a munged or Slurm
already running on the host is left alone. The daemons run in the foreground as children of this
process; `stop()` cancels the jobs, ends the daemons and every process a job left, and removes the
folder. Without `slurmdbd` there is no `sacct`: a job's state and exit code come from `scontrol
show job`, which keeps a finished job for `MinJobAge` (5 minutes).

Slurm commands run with `env` (`SLURM_CONF` set, the caller's `SLURM_*` variables dropped).
`unavailable()` says why a cluster cannot start here (Debian: `apt-get install -y slurm-wlm
munge`; the daemons run as root).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tpu_scale.launch import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "sinfo", "squeue")
INSTALL = "apt-get install -y slurm-wlm munge"
FINISHED_STATES = (
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED TIMEOUT"
).split()
_SYSTEM_BIN = ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin")


def _program(name):
    """The path of a Slurm or munge program (daemons live in /usr/sbin, often not on the PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SYSTEM_BIN])
    return shutil.which(name, path=path)


def unavailable():
    """Why a Slurm cluster cannot start on this host, or None when it can."""
    missing = [name for name in DAEMONS + CLIENTS if _program(name) is None]
    if missing:
        return f"Slurm is not installed here (no {', '.join(missing)}); install it: {INSTALL}"
    if os.geteuid() != 0:
        return "the Slurm daemons of a test cluster run as root (SlurmUser=root); run as root"
    return None


def free_port_base(count):
    """A port p with p .. p + count - 1 all free on localhost (Slurm's TensorFlow resolver gives the
    k-th task on a node the port base + k)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            base = s.getsockname()[1]
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("localhost", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports on localhost")


def _node_line():
    """`NodeName=... CPUs=... RealMemory=...` for this host, as slurmd itself sees it."""
    out = subprocess.run(
        [_program("slurmd"), "-C"], capture_output=True, text=True, check=True
    ).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("NodeName=")), None)
    if line is None:
        raise RuntimeError(f"`slurmd -C` printed no NodeName line: {out!r}")
    return line


class SlurmCluster:
    """A one-node Slurm cluster on this host (module docstring); a context manager.

    Attributes:
      folder: the cluster's temporary folder (conf, state, spool, logs, munge).
      conf: the path of its `slurm.conf`.
      node: the node's name (this host's short name).
      cpus: the node's CPUs.
      env: the environment for Slurm commands (`SLURM_CONF` set).
    """

    def __init__(self, timeout=60.0):
        """Args: timeout: seconds to wait for the node to become idle at `start()`."""
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.timeout = timeout
        self.folder = None
        self.conf = None
        self.node = None
        self.cpus = None
        self.env = None
        self._daemons = {}

    # ----------------------------------------------------------------------- start and stop

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        """Writes the configuration, starts munged, slurmctld and slurmd, waits for an idle node.

        Raises:
          RuntimeError: a daemon exited or the node did not become idle in time; the message
            names the daemon's log and holds its last lines.
        """
        self.folder = tempfile.mkdtemp(prefix="tpu_scale_slurm_")
        if len(self.folder) > 60:
            # Unix socket paths hold at most 107 bytes (munged's, slurmstepd's in the spool folder).
            os.rmdir(self.folder)
            self.folder = tempfile.mkdtemp(prefix="tpu_scale_slurm_", dir="/tmp")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self):
        def path(*parts):
            return os.path.join(self.folder, *parts)

        for sub in ("state", "spool", "log", "munge", "munge_key"):
            os.makedirs(path(sub))
        os.chmod(path("munge"), 0o755)  # clients reach the socket; the key's folder stays 0700
        os.chmod(path("munge_key"), 0o700)
        key = path("munge_key", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        socket_path = path("munge", "munge.socket")

        node_line = _node_line()
        fields = dict(field.split("=", 1) for field in node_line.split())
        self.node, self.cpus = fields["NodeName"], int(fields["CPUs"])
        controller_port, node_port = free_ports(2)
        self.conf = path("slurm.conf")
        with open(self.conf, "w") as f:
            f.write(
                _CONF.format(
                    node=self.node,
                    node_line=node_line,
                    controller_port=controller_port,
                    node_port=node_port,
                    socket=socket_path,
                    folder=self.folder,
                )
            )
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = self.conf

        self._spawn(
            "munged",
            [
                "--foreground",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={path('munge', 'munged.pid')}",
                f"--log-file={path('log', 'munged.log')}",
                f"--seed-file={path('munge', 'munged.seed')}",
            ],
        )
        self._wait(lambda: os.path.exists(socket_path), "munged", "munge socket")
        self._spawn("slurmctld", ["-D", "-f", self.conf])
        self._spawn("slurmd", ["-D", "-f", self.conf])
        self._wait(lambda: self.node_state() == "idle", "slurmctld slurmd", "idle node")

    def _spawn(self, name, args):
        log = open(os.path.join(self.folder, "log", f"{name}.out"), "w")
        with log:
            self._daemons[name] = subprocess.Popen(
                [_program(name), *args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal reaches the tests, not these
            )

    def _wait(self, ready, daemons, what):
        deadline = time.monotonic() + self.timeout
        while not ready():
            for name, process in self._daemons.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {process.returncode} before the cluster had its {what}; its log:\n{self.log_tail(name)}"
                    )
            if time.monotonic() > deadline:
                logs = "\n".join(self.log_tail(name) for name in daemons.split())
                raise RuntimeError(
                    f"Slurm cluster: still no {what} after {self.timeout:.0f} s; the logs of {daemons}:\n{logs}"
                )
            time.sleep(0.2)

    def log_tail(self, daemon, lines=30):
        """The last lines of a daemon's log file (and of what it printed), with their paths."""
        text = []
        for name in (f"{daemon}.log", f"{daemon}.out"):
            log = os.path.join(self.folder, "log", name)
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
                text.append(f"--- {log}\n" + "\n".join(tail))
        return "\n".join(text) or f"(no log of {daemon} in {self.folder}/log)"

    def stop(self):
        """Cancels every job, ends the daemons and what the jobs left, removes the folder."""
        if self.folder is None:
            return
        if self._daemons.get("slurmctld") and self._daemons["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", "--full", *jobs, check=False)
                deadline = time.monotonic() + 30
                while (
                    time.monotonic() < deadline
                    and self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                ):
                    time.sleep(0.2)
        for name in reversed(DAEMONS):
            process = self._daemons.pop(name, None)
            if process is None:
                continue
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._end_leftovers()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

    def _end_leftovers(self):
        """Kills what the cluster started and left behind (slurmstepd, tasks): the processes whose
        environment names this cluster's `slurm.conf`."""
        if not self.conf or not os.path.isdir("/proc"):
            return
        mark = f"SLURM_CONF={self.conf}".encode() + b"\0"
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            if pid == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark not in f.read() + b"\0":
                        continue
                os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    # ----------------------------------------------------------------------- commands and jobs

    def run(self, *command, check=True, timeout=60, env=None, cwd=None):
        """Runs a Slurm command (`"squeue", "-h"`) in `env`; returns the `CompletedProcess`.

        Args:
          *command: the program and its arguments.
          check: raise when it fails.
          timeout: seconds.
          env: variables added to `env` for this command.
          cwd: the folder to run it in.

        Raises:
          RuntimeError: with `check`, the command failed; the message holds its output.
        """
        result = subprocess.run(
            command,
            env=dict(self.env, **(env or {})),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode:
            raise RuntimeError(
                f"`{' '.join(command)}` failed with exit code {result.returncode}:\n{result.stdout}{result.stderr}"
            )
        return result

    def node_state(self):
        """The node's state as `sinfo` prints it (`idle`, `mixed`, `allocated`, `down*`, ...)."""
        result = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False, timeout=10)
        return result.stdout.strip() if result.returncode == 0 else None

    def sbatch(self, script, *args, options=(), output=None, env=None, cwd=None):
        """Submits `script` with `args` (the script's own arguments); returns the job id.

        Args:
          script: the batch script's path.
          *args: arguments after the script (the script sees them as "$@").
          options: sbatch options before the script (they win over its #SBATCH lines).
          output: the job's output file (stdout and stderr), or None for the script's own.
          env: variables added to the job's environment (sbatch passes its own on).
          cwd: the folder to submit from (the job's SLURM_SUBMIT_DIR).
        """
        command = ["sbatch", "--parsable", *options]
        if output:
            command.append(f"--output={output}")
        result = self.run(*command, script, *args, env=env, cwd=cwd)
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id):
        """The job's fields from `scontrol show job` (`JobState`, `ExitCode`, `Reason`, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id, timeout):
        """Waits for a job to finish; returns its `job()` fields.

        Raises:
          TimeoutError: it has not finished within `timeout` seconds (it is cancelled).
        """
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in FINISHED_STATES:
                return fields
            if time.monotonic() > deadline:
                self.run("scancel", "--full", str(job_id), check=False)
                raise TimeoutError(
                    f"Slurm job {job_id} did not finish within {timeout:.0f} s (state {fields.get('JobState')}, reason {fields.get('Reason')}); it was cancelled."
                )
            time.sleep(0.2)

    def task_pids(self, job_id, step=0):
        """`{global task id: pid}` of a job step's tasks (`scontrol listpids`)."""
        out = self.run("scontrol", "listpids", f"{job_id}.{step}").stdout
        pids = {}
        for line in out.splitlines()[1:]:
            pid, _, _, _, global_id = (line.split() + [""] * 5)[:5]
            if global_id.isdigit():
                pids[int(global_id)] = int(pid)
        return pids


def wait_for_lines(path, pattern, count=1, timeout=120.0, job=None, cluster=None):
    """Waits until `count` lines of the file at `path` match the regex `pattern`; returns the text.

    Args:
      path: a job's output file.
      pattern: a regular expression, searched in each line.
      count: how many lines must match.
      timeout: seconds.
      job, cluster: the job id and its `SlurmCluster`: a job that finishes first is an error.

    Raises:
      TimeoutError: fewer lines matched in time (or the job ended first); the message holds the
        file's last lines.
    """
    deadline = time.monotonic() + timeout
    text = ""
    while True:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text = f.read()
            if sum(bool(re.search(pattern, line)) for line in text.splitlines()) >= count:
                return text
        ended = job is not None and cluster.job(job).get("JobState") in FINISHED_STATES
        if ended or time.monotonic() > deadline:
            why = f"job {job} ended" if ended else f"{timeout:.0f} s passed"
            raise TimeoutError(
                f"{why} before {count} lines of {path} matched {pattern!r}; its end:\n{text[-4000:]}"
            )
        time.sleep(0.1)


_CONF = """\
# A one-node test cluster (tests/slurm_cluster.py).
ClusterName=tpuscale
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/state/slurmctld.pid
SlurmdPidFile={folder}/spool/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{node_line} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
