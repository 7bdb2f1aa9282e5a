"""Two emulated hosts on one machine: network namespaces joined by a veth pair shaped with `tc`.

On loopback, two worker processes exchange bytes at memory speed, so a schedule that sends fewer
bytes between hosts gains little. This module puts each worker in a Linux network namespace of its
own ("host" 0 at 10.77.0.1, "host" 1 at 10.77.0.2), joins the two with a veth pair, and caps each
direction of that pair with a token-bucket filter (`tc qdisc ... tbf rate R`), so every byte between
the workers crosses a full-duplex link of R bit/s. It emulates only the bandwidth: no added delay,
no loss (the kernel here has no `netem`), and the two "hosts" still share the machine's cores and
memory. Figures measured over it are labelled "emulated link (tc)", never a real network.

    with EmulatedLink(gbit=1) as link:        # needs root; always torn down on exit
        check = link.measure()                # socket throughput across the link, both ways at once
        results = link.run_workers("all_reduce:worker", kwargs={...}, cpus_per_worker=4)
    link.settings                             # what to record with the figures

`run_workers` is `tpu_scale.testing.run_workers` with each worker started under `ip netns exec` and
a `TF_CONFIG` naming the namespaces' addresses.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

SUBNET = "10.77.0"
ADDRESSES = (f"{SUBNET}.1", f"{SUBNET}.2")
WORKER_PORT = 23456  # each namespace has its own ports, so a fixed one is always free
PROBE_PORT = 23457
# The tbf queue: a bucket of 2 ms at the rate (at least 64 KiB, so segmentation-offloaded packets
# pass whole) and up to 20 ms of queueing before drops.
BURST_SECONDS = 0.002
MIN_BURST_BYTES = 64 * 1024
LATENCY = "20ms"
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def _tool(name):
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def unavailable_reason():
    """Why this machine cannot emulate the link (a message naming the fix), or None if it can."""
    fix = "or drop --link_gbit to run the two workers over loopback"
    if not sys.platform.startswith("linux"):
        return f"an emulated link needs Linux network namespaces (this is {sys.platform}); {fix}."
    if os.geteuid() != 0:
        return (
            "an emulated link creates network namespaces and shapes a veth pair with tc, which "
            f"needs root: run as root (e.g. with sudo), {fix}."
        )
    missing = [t for t in ("ip", "tc") if _tool(t) is None]
    if missing:
        return (
            f"an emulated link needs iproute2's {' and '.join(missing)} (not found on PATH nor in "
            f"{', '.join(_SBIN)}): install iproute2, {fix}."
        )
    return None


class EmulatedLink:
    """Two network namespaces joined by a veth pair, each direction shaped to `gbit` Gbit/s.

    A context manager: entering creates everything, leaving (normally, on an error, on Ctrl-C or
    on SIGTERM) deletes both namespaces, which also deletes the veth pair.
    """

    def __init__(self, gbit):
        if not gbit > 0:
            raise ValueError(f"gbit must be positive, got {gbit!r}.")
        self.gbit = float(gbit)
        tag = f"tsar{os.getpid()}"  # unique per run; interface names have at most 15 characters
        self.namespaces = (f"{tag}h0", f"{tag}h1")
        self.devices = (f"{tag}v0", f"{tag}v1")
        self.addresses = ADDRESSES
        rate_bytes = self.gbit * 1e9 / 8
        self.burst_bytes = max(MIN_BURST_BYTES, int(rate_bytes * BURST_SECONDS))
        self.tc_commands = [
            f"tc qdisc add dev {dev} root tbf rate {self.gbit:g}gbit burst {self.burst_bytes}b "
            f"latency {LATENCY}"
            for dev in self.devices
        ]
        self._ip, self._tc = _tool("ip"), _tool("tc")
        self._created = []
        self._previous_sigterm = None

    # ----------------------------------------------------------------------- set-up, tear-down

    def _run(self, *command):
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(
                f"Setting up the emulated link: `{' '.join(command)}` failed "
                f"(exit {completed.returncode}): {completed.stderr.strip()}\n"
                "The kernel needs network namespaces, veth and the tbf qdisc; run as root, or "
                "drop --link_gbit to run the two workers over loopback."
            )
        return completed.stdout

    def __enter__(self):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        # SIGTERM (e.g. `kill`, a job runner's timeout) would end Python without running `finally`
        # blocks: turn it into SystemExit so the namespaces are still deleted.
        self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self):
        ip = self._ip
        for ns in self.namespaces:
            self._run(ip, "netns", "add", ns)
            self._created.append(ns)
        dev0, dev1 = self.devices
        self._run(ip, "link", "add", dev0, "type", "veth", "peer", "name", dev1)
        for ns, dev, address in zip(self.namespaces, self.devices, self.addresses):
            self._run(ip, "link", "set", dev, "netns", ns)
            self._run(ip, "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            self._run(ip, "-n", ns, "link", "set", dev, "up")
            self._run(ip, "-n", ns, "link", "set", "lo", "up")
        for ns, command in zip(self.namespaces, self.tc_commands):
            self._run(self._tc, "-n", ns, *command.split()[1:])

    def close(self):
        """Deletes the namespaces (and with them the veth pair); safe to call more than once."""
        errors = []
        for ns in self._created:
            completed = subprocess.run(
                [self._ip, "netns", "del", ns], capture_output=True, text=True
            )
            if completed.returncode != 0:
                errors.append(f"ip netns del {ns}: {completed.stderr.strip()}")
        self._created = []
        # Only if set-up failed between creating the pair and moving it into the namespaces.
        for dev in self.devices:
            if os.path.exists(f"/sys/class/net/{dev}"):
                subprocess.run([self._ip, "link", "del", dev], capture_output=True)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if errors:
            print("emulated link: tear-down left something behind:", *errors, sep="\n  ")

    def __exit__(self, *exc_info):
        self.close()
        return False

    # ----------------------------------------------------------------------- what to record

    @property
    def settings(self):
        """The link's description, for the JSON next to the figures it produced."""
        return {
            "emulated": True,
            "label": f"emulated {self.gbit:g} Gbit/s link (tc)",
            "rate_gbit_per_s": self.gbit,
            "how": (
                "two Linux network namespaces joined by a veth pair, each end shaped with a tc "
                "token-bucket filter (both directions at the rate, full duplex); no added delay or "
                "loss; both namespaces share this machine's cores and memory"
            ),
            "tc": self.tc_commands,
            "mtu": 1500,
            "addresses": list(self.addresses),
        }

    def qdisc_counters(self):
        """Bytes and packets each end's tbf has sent so far, and its drops and overlimits."""
        counters = {}
        for ns, dev in zip(self.namespaces, self.devices):
            out = self._run(self._tc, "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev)
            tbf = [q for q in json.loads(out) if q.get("kind") == "tbf"][0]
            counters[dev] = {
                k: tbf.get(k) for k in ("bytes", "packets", "drops", "overlimits", "requeues")
            }
        return counters

    # ----------------------------------------------------------------------- the rate check

    def measure(self, seconds=1.5):
        """TCP throughput across the link, both directions at once, from Python sockets.

        Each namespace runs a receiver and sends `seconds` worth of data (at the configured rate)
        to the other; a receiver times from its first byte to the sender's close. Expect a little
        under the rate: TCP/IP headers ride in the shaped bytes (about 4% at MTU 1500).

        Returns:
          {"0->1": Gbit/s, "1->0": Gbit/s, "bytes_each_way": n, "seconds": [...]}.
        """
        num_bytes = int(self.gbit * 1e9 / 8 * seconds)
        here = os.path.abspath(__file__)
        receivers = [
            self._spawn(ns, [here, "--_receive", address, str(PROBE_PORT)])
            for ns, address in zip(self.namespaces, self.addresses)
        ]
        senders = [
            self._spawn(ns, [here, "--_send", address, str(PROBE_PORT), str(num_bytes)])
            for ns, address in zip(self.namespaces, reversed(self.addresses))
        ]
        procs = receivers + senders
        try:
            outputs = [p.communicate(timeout=30 + 4 * seconds) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [(p.returncode, err) for p, (_, err) in zip(procs, outputs) if p.returncode]
        if failed:
            raise RuntimeError(f"The link check failed: {failed}")
        received = [json.loads(out) for out, _ in outputs[:2]]
        rate = [round(r["bytes"] * 8 / r["seconds"] / 1e9, 3) for r in received]
        return {
            "1->0": rate[0],  # received in namespace 0
            "0->1": rate[1],
            "unit": "Gbit/s of TCP payload, both directions at once",
            "bytes_each_way": num_bytes,
            "seconds": [round(r["seconds"], 3) for r in received],
        }

    def _spawn(self, ns, args):
        return subprocess.Popen(
            [self._ip, "netns", "exec", ns, sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    # ----------------------------------------------------------------------- the workers

    def run_workers(self, target, kwargs=None, cpus_per_worker=4, timeout=1800):
        """Runs `target(**kwargs)` in two worker processes, one per namespace; returns their values.

        `tpu_scale.testing.run_workers` with `num_workers=2`, each worker started under `ip netns
        exec` (which execs it, so the process held is the worker itself) and a `TF_CONFIG` naming
        10.77.0.1 and 10.77.0.2.
        """
        from tpu_scale.testing import run_workers

        return run_workers(
            target,
            num_workers=2,
            cpus_per_worker=cpus_per_worker,
            kwargs=kwargs,
            timeout=timeout,
            addresses=[f"{address}:{WORKER_PORT}" for address in self.addresses],
            launch_prefixes=[[self._ip, "netns", "exec", ns] for ns in self.namespaces],
        )


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


# --------------------------------------------------------------------------- the probe's two ends


def _receive(address, port):
    with socket.create_server((address, port)) as server:
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            total, start = 0, None
            while True:
                chunk = connection.recv(1 << 20)
                if not chunk:
                    break
                if start is None:
                    start = time.perf_counter()
                total += len(chunk)
            seconds = time.perf_counter() - start if start is not None else float("nan")
    print(json.dumps({"bytes": total, "seconds": seconds}))


def _send(address, port, num_bytes):
    deadline = time.monotonic() + 20
    while True:  # the receiver in the other namespace may not be listening yet
        try:
            connection = socket.create_connection((address, port), timeout=30)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    chunk = b"\0" * (1 << 20)
    with connection:
        while num_bytes > 0:
            n = min(num_bytes, len(chunk))
            connection.sendall(chunk[:n])
            num_bytes -= n


if __name__ == "__main__":
    if sys.argv[1] == "--_receive":
        _receive(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "--_send":
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} --_receive ADDRESS PORT | --_send ADDRESS PORT N")
