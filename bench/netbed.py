"""Emulated Ethernet testbed: run a bitcoll TCP job with its ranks on separate hosts joined by
rate-limited links, all on this machine.

Usage (as root; needs iproute2's ``ip`` and ``tc``)::

    python bench/netbed.py --hosts 4 --rate 1gbit bench/osu_sign_allreduce.py -m 64M \\
        --compare-float32 --algorithm default,allgather
    python bench/netbed.py --hosts 2 --rate 10gbit bench/osu_allreduce.py --impl gloo
    python bench/netbed.py --hosts 4 --rate 1gbit --probe train.py --steps 50
    python bench/netbed.py --hosts 3 --rate 1gbit -m some.module args...
    python bench/netbed.py --hosts 2 --rate 10gbit --probe        # only measure a link
    python bench/netbed.py --hosts 4 --rate 100mbit --rtt 50 bench/osu_allreduce.py -m 8,1M

Topology
--------
A switch and ``--hosts`` hosts, each a network namespace of its own (named
``bitcollnet<pid>-sw`` and ``bitcollnet<pid>-h<k>``). Host ``k`` has one interface ``eth0``
with address ``10.99.0.<k+1>/24``; a veth pair joins it to port ``h<k>`` of a Linux bridge in
the switch namespace. Both ends of every link are shaped with ``tc ... tbf rate R burst B
latency 50ms``, so each host has a full-duplex link of ``--rate`` to the switch, like a
switched Ethernet (traffic from one host to another crosses two shaped links). There is no
added delay by default (this kernel has no netem); link latency is that of the veth pairs
(tens of microseconds). ``--rtt MS`` replaces the bridge with a user-space switch that delays
every frame by ``MS / 2`` milliseconds (``bench/netbed_delay.py``; ``--loss PCT`` also drops
that share of its frames), so that hosts are a round trip of ``MS`` apart: far links. TCP
then needs send buffers of at least the bandwidth-delay product: bitcoll's 128 KiB default
caps a connection at about 256 KiB per round trip, ``BITCOLL_SEND_BUFFER=0`` leaves the sizing
to the kernel.

Running the job
---------------
Host ``k`` runs ``python -m launch --nnodes H --node-rank k -n P --master-addr 10.99.0.1
--master-port 29400 <script or -m module> <args>`` inside its namespace (``P`` =
``--nproc-per-host``, default 1), so the ranks get the launcher's environment contract
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...; see ``python -m pydoc launch.__main__``),
``bitcoll.init()`` connects them over the shaped links, and every output line carries its
``[rank R]`` prefix. bitcoll's own store listens on ``--master-port + 1`` = 29401
(``BITCOLL_MASTER_PORT``), so torch.distributed and bitcoll can share a script. The testbed
generates one ``BITCOLL_SECRET`` for the whole job (unless its environment has one) and gives
it to every host's launcher, so that the hosts' ranks authenticate each other; it is never
printed. ``GLOO_SOCKET_IFNAME=eth0`` is set (unless already set) so that torch.distributed's
gloo uses the shaped interface too. Paths are taken relative to the current directory, as by
``python``. As with the launcher, the first argument that is not a testbed option is the
script (``-m``: the module), and everything from there on goes to the ranks.

CPU: the hosts share this machine's cores. Unless ``--no-pin``, host ``k``'s processes are
pinned to its share of the usable cores ``C``: cores ``[k C / H, (k + 1) C / H)`` when there
are at least as many cores as hosts, else core ``k mod C``. Programs that size their thread
pools by the cores they may use (``train.py``'s torch threads, ``os.sched_getaffinity``) then
see their host's share instead of oversubscribing the machine.

Before the job the testbed prints one line, ``netbed: H hosts x P ranks, links RATE (tbf burst
B), bitcoll TCP, hosts pinned to their share of the cores``, and gives the job ``B`` in
``NETBED_BURST``; with ``--probe`` it first sends 64 MiB from host 1 to host 0 over one TCP
connection (``bench/netbed_helpers.py``) and prints the measured rate (``netbed: probe host 1
-> host 0: X Gbit/s``). ``--model-link`` tells the ranks' cost model (:mod:`bitcoll.plan`) that
rate (else the nominal one) and the added round trip through ``BITCOLL_COST_REMOTE_BANDWIDTH``
and ``BITCOLL_COST_REMOTE_LATENCY``, as a user of such a cluster would configure it or ``python
-m bitcoll.probe`` on two hosts would measure it, and, where more hosts than cores share the
machine, the share of a core of the hosts on the busiest core (``1 / ceil(H / C)``: 3 hosts on
2 cores get half a core, not two thirds, since a collective runs at its slowest rank's pace)
through ``BITCOLL_COST_HOST_CORES`` (a rank pinned to a shared core would count it as its own);
without it the ranks plan with the model they find. A failing host is reported on stderr
(``netbed: host 1 exited with status 3; stopped the other hosts``) after its launcher's own
report.

MPI
---
With ``--mpi`` one ``mpiexec`` (the one next to this interpreter, else on ``PATH``) starts
the ranks instead, in MPMD form with Hydra's fork launcher: ``mpiexec -launcher fork -n P ip
netns exec <host 0> python <target> : -n P ip netns exec <host 1> python <target> : ...``
(each segment wrapped in ``bench/netbed_helpers.py pin`` unless ``--no-pin``), with
``MPIR_CVAR_NOLOCAL=1``, ``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=eth0``, ``FI_PROVIDER=tcp``
and ``FI_TCP_IFACE=eth0`` unless already set: the namespaces share the hostname and
``/dev/shm``, and without these MPICH would pass messages through shared memory instead of
the shaped links. ``bitcoll.init()`` then picks the MPI backend; ``bench/osu_allreduce.py
--impl mpi4py`` measures MPICH's own ``Allreduce``.

Exit status and clean-up
------------------------
The hosts' launchers (or the one ``mpiexec``) are supervised by the launcher's own
supervisor (:mod:`launch.supervise`), each in a session of its own. The job's status: 0 if
every host's launcher exits 0, otherwise the status of the launcher that failed first in time
(the others are stopped with SIGTERM, SIGKILL ``--grace-period`` + 2 s later, which leaves
their own launchers the ``--grace-period`` to stop their ranks first). SIGINT or SIGTERM is
forwarded to the job once (a second one sends SIGKILL). The namespaces (and with them the
links) are always removed before the testbed exits; those of a testbed that was killed with
SIGKILL are removed by the next testbed that starts (it says so on stderr). Not root, no
``ip``/``tc``, or bad options: status 2 with a message; a testbed that cannot be built (or a
job that cannot be started): status 1 with the failing command's error.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launch.supervise import Supervisor, describe_exit

PREFIX = "bitcollnet"
_OURS = re.compile(rf"^{PREFIX}(\d+)-(sw|h\d+)$")
SUBNET = "10.99.0"
MASTER_PORT = 29400
#: Not MASTER_PORT + 1: the launchers give that one to bitcoll's store (BITCOLL_MASTER_PORT).
PROBE_PORT = 29402
PROBE_BYTES = 64 << 20
MAX_HOSTS = 250
DEFAULT_GRACE = 5.0
#: The testbed waits this much longer than --grace-period before it SIGKILLs a launcher, so
#: that the launcher has SIGKILLed its own ranks first (they run in sessions of their own and
#: would outlive it).
HOST_GRACE_MARGIN = 2.0
SECRET_ENV = "BITCOLL_SECRET"
#: Environment variable that tells the job the links' tbf bucket in bytes (the burst a link
#: passes faster than its rate after a pause: benchmarks that want the link's steady rate
#: time loops long enough to outlast it, as ``bench/cost_validate.py`` does).
BURST_ENV = "NETBED_BURST"
#: The programs run inside the namespaces (pinning, the probe's two ends).
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netbed_helpers.py")
#: The user-space switch with a delay line (``--rtt``).
DELAY_LINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netbed_delay.py")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class SetupError(RuntimeError):
    """An ``ip`` or ``tc`` command failed while building the testbed."""


def parse_rate(text: str) -> int:
    """``"1gbit"``, ``"100mbit"``, ``"2.5gbit"``... to bits per second (tc's decimal units).
    Raises ValueError for anything else or a rate below 1 mbit."""
    m = _RATE.match(text.strip().lower())
    if m is None:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 2.5gbit, got {text!r}")
    bits = int(float(m.group(1)) * _UNITS[m.group(2)])
    if bits < 10**6:
        raise ValueError(f"rate must be at least 1mbit, got {text!r}")
    return bits


def default_burst(rate_bits: int) -> int:
    """tbf bucket size in bytes for ``rate_bits``: one millisecond of traffic, at least 256 KiB
    (a bucket smaller than a few TSO packets throttles TCP below the nominal rate)."""
    return max(256 << 10, rate_bits // 8 // 1000)


@dataclass(frozen=True)
class Testbed:
    """Names and addresses of one testbed."""

    hosts: int
    rate: str
    burst: int
    prefix: str
    delayed: bool = False
    """Whether the ports are left out of the kernel's bridge for the user-space delay line
    (``--rtt``, :mod:`netbed_delay`)."""

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def host(self, k: int) -> str:
        return f"{self.prefix}-h{k}"

    @staticmethod
    def address(k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def namespaces(self) -> list[str]:
        return [self.switch] + [self.host(k) for k in range(self.hosts)]

    def setup_commands(self) -> list[list[str]]:
        """The ``ip``/``tc`` commands that build the testbed, in order."""
        sw = self.switch
        shape = ["root", "tbf", "rate", self.rate, "burst", str(self.burst), "latency", "50ms"]
        cmds = [["ip", "netns", "add", sw],
                ["ip", "-n", sw, "link", "set", "lo", "up"],
                ["ip", "-n", sw, "link", "add", "sw", "type", "bridge"],
                ["ip", "-n", sw, "link", "set", "sw", "up"]]
        for k in range(self.hosts):
            h, port = self.host(k), f"h{k}"
            cmds += [["ip", "netns", "add", h],
                     ["ip", "-n", h, "link", "set", "lo", "up"],
                     ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name",
                      "eth0", "netns", h],
                     *([] if self.delayed else
                       [["ip", "-n", sw, "link", "set", port, "master", "sw"]]),
                     ["ip", "-n", sw, "link", "set", port, "up"],
                     ["ip", "-n", h, "addr", "add", f"{self.address(k)}/24", "dev", "eth0"],
                     ["ip", "-n", h, "link", "set", "eth0", "up"],
                     ["ip", "netns", "exec", h, "tc", "qdisc", "add", "dev", "eth0", *shape],
                     ["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", port, *shape]]
        return cmds

    def build(self) -> None:
        """Run :meth:`setup_commands`; raise SetupError (after removing what was made) when
        one fails."""
        try:
            for cmd in self.setup_commands():
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise SetupError(f"`{' '.join(cmd)}` failed: "
                                     f"{done.stderr.strip() or done.returncode}")
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Delete every namespace of this testbed that exists (the links go with them)."""
        existing = set(list_namespaces())
        for ns in self.namespaces():
            if ns in existing:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def start_delay_line(bed: Testbed, rtt_ms: float, loss_pct: float) -> subprocess.Popen[str]:
    """Start the user-space switch with its delay line (:mod:`netbed_delay`) in the switch
    namespace, every port attached, ``rtt_ms / 2`` milliseconds per traversal; return once it
    forwards. SetupError when it does not start."""
    ports = ",".join(f"h{k}" for k in range(bed.hosts))
    cmd = ["ip", "netns", "exec", bed.switch, sys.executable, DELAY_LINE, "--ports", ports,
           "--delay-ms", str(rtt_ms / 2), "--loss", str(loss_pct)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("delay line up"):
        proc.kill()
        proc.wait()
        raise SetupError(f"the delay line did not start: {line.strip() or proc.returncode}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns list`` shows."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of testbeds whose process no longer exists (left behind when a
    testbed was killed with SIGKILL); return their names."""
    stale = [ns for ns in list_namespaces()
             if (m := _OURS.match(ns)) is not None and not _alive(int(m.group(1)))]
    for ns in stale:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    return stale


def invocation(hosts: int, rate: str, mpi: bool = False, rtt_ms: float = 0.0) -> list[str]:
    """The command line prefix that runs a job on a testbed of ``hosts`` hosts with links of
    ``rate`` (``mpi``: ranks started by mpiexec; ``rtt_ms`` > 0: that round trip added by the
    delay line, ``--rtt``); append the script and its arguments."""
    return [sys.executable, os.path.abspath(__file__), *(["--mpi"] if mpi else []),
            "--hosts", str(hosts), "--rate", rate, *(["--rtt", f"{rtt_ms:g}"] if rtt_ms else [])]


def host_cpus(k: int, hosts: int, cores: Sequence[int]) -> list[int]:
    """The cores host ``k`` of ``hosts`` is pinned to (see the module docstring)."""
    c = len(cores)
    if c >= hosts:
        return list(cores[k * c // hosts:(k + 1) * c // hosts])
    return [cores[k % c]]


def helper(*args: str) -> list[str]:
    """The command that runs :mod:`netbed_helpers` (``pin``, ``probe-server``,
    ``probe-client``) with ``args`` under this interpreter."""
    return [sys.executable, HELPERS, *args]


def job_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus what every host's job gets (unless ``base`` has it): gloo on the shaped
    interface (``GLOO_SOCKET_IFNAME=eth0``) and one fresh ``BITCOLL_SECRET`` shared by every
    host's launcher."""
    env = dict(base)
    env.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    env.setdefault(SECRET_ENV, secrets.token_hex(32))
    return env


def model_link(env: Mapping[str, str], gbit: float, rtt_ms: float,
               host_cores: float | None = None) -> dict[str, str]:
    """The cost model's link fields for a link of ``gbit`` Gbit/s with ``rtt_ms`` of round
    trip (``--model-link``), and ``host_cores`` (a host's share of the machine's cores where
    the hosts share cores: a process pinned to a core it shares sees one core of its own), as
    ``BITCOLL_COST_*`` variables; those ``env`` already sets stay the user's."""
    out = {"BITCOLL_COST_REMOTE_BANDWIDTH": f"{gbit * 1e9 / 8:.6g}"}
    if rtt_ms > 0:
        out["BITCOLL_COST_REMOTE_LATENCY"] = f"{rtt_ms / 2e3:.6g}"
    if host_cores is not None:
        out["BITCOLL_COST_HOST_CORES"] = f"{host_cores:.6g}"
    return {k: v for k, v in out.items() if k not in env}


def mpi_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what makes MPICH use TCP on ``eth0`` between the namespaces (they share
    the hostname and /dev/shm, so MPICH would otherwise take its shared-memory path)."""
    out = dict(env)
    out.setdefault("MPIR_CVAR_NOLOCAL", "1")
    out.setdefault("UCX_TLS", "tcp,self")
    out.setdefault("UCX_NET_DEVICES", "eth0")
    out.setdefault("FI_PROVIDER", "tcp")
    out.setdefault("FI_TCP_IFACE", "eth0")
    return out


def mpi_command(bed: Testbed, mpiexec: str, nproc: int, target: Sequence[str],
                cpus: list[list[int]] | None) -> list[str]:
    """One ``mpiexec`` (MPMD form, fork launcher) whose k-th segment runs ``nproc`` ranks in
    host ``k``'s namespace, pinned to ``cpus[k]`` when given."""
    cmd = [mpiexec, "-launcher", "fork"]
    for k in range(bed.hosts):
        if k:
            cmd.append(":")
        pin = [] if cpus is None else helper("pin", ",".join(str(c) for c in cpus[k]))
        cmd += ["-n", str(nproc), *pin, "ip", "netns", "exec", bed.host(k), sys.executable,
                *target]
    return cmd


def host_command(bed: Testbed, k: int, nproc: int, target: Sequence[str],
                 grace: float) -> list[str]:
    """The command that runs host ``k``'s launcher inside its namespace."""
    return ["ip", "netns", "exec", bed.host(k), sys.executable, "-m", "launch",
            "--nnodes", str(bed.hosts), "--node-rank", str(k), "-n", str(nproc),
            "--master-addr", bed.address(0), "--master-port", str(MASTER_PORT),
            "--grace-period", str(grace), *target]


def probe(bed: Testbed) -> float:
    """Send :data:`PROBE_BYTES` from host 1 to host 0 over one TCP connection; return the rate
    the receiver saw, in Gbit/s."""
    server = subprocess.Popen(["ip", "netns", "exec", bed.host(0),
                               *helper("probe-server", str(PROBE_PORT))],
                              stdout=subprocess.PIPE, text=True)
    try:
        subprocess.run(["ip", "netns", "exec", bed.host(1),
                        *helper("probe-client", bed.address(0), str(PROBE_PORT),
                                str(PROBE_BYTES))],
                       check=True, timeout=120)
        out, _ = server.communicate(timeout=30)
        return float(out.strip())
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


class Job:
    """The hosts' launchers (or one mpiexec): start them, supervise them with the launcher's
    :class:`~launch.supervise.Supervisor`, report the first failure."""

    def __init__(self, cmds: list[list[str]], env: dict[str, str], grace: float,
                 cpus: list[list[int]] | None = None, names: list[str] | None = None) -> None:
        self.cmds, self.env, self.grace, self.cpus = cmds, env, grace, cpus
        self.names = names or [f"host {k}" for k in range(len(cmds))]
        self.supervisor = Supervisor(grace + HOST_GRACE_MARGIN, group=False)

    def run(self) -> int:
        """Start every launcher and wait; return the job's exit status."""
        sup = self.supervisor
        with sup.handle_signals():
            procs: list[subprocess.Popen[bytes]] = []
            try:
                # Start them all before the supervisor's threads exist: preexec_fn is only
                # safe in a process without other threads.
                for k, cmd in enumerate(self.cmds):
                    pin = None if self.cpus is None else self.cpus[k]
                    procs.append(subprocess.Popen(
                        cmd, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True,
                        preexec_fn=None if pin is None
                        else lambda c=pin: os.sched_setaffinity(0, c)))
            except OSError as exc:
                print(f"netbed: cannot start the job: {exc}", file=sys.stderr, flush=True)
                for p in procs:
                    p.kill()
                    p.wait()
                return 1
            for p in procs:
                sup.add(p)
            try:
                outcome = sup.wait()
            finally:
                self._stop()
        if outcome.failed is not None:
            k, rc = outcome.failed
            print(f"netbed: {self.names[k]} {describe_exit(rc)}"
                  + ("; stopped the other hosts" if outcome.stopped else ""),
                  file=sys.stderr, flush=True)
        return outcome.status()

    def _stop(self) -> None:
        """Only left to do after an error in :meth:`run`: SIGTERM the launchers still running,
        SIGKILL after the grace period."""
        live = self.supervisor.running()
        for p in live:
            p.terminate()
        deadline = time.monotonic() + self.supervisor.grace_period
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="netbed", usage="netbed [options] (script.py | -m module) [args...]",
        allow_abbrev=False,
        description="Run a bitcoll TCP job on an emulated Ethernet: one network namespace "
                    "per host, rate-limited links to a bridge (needs root and iproute2).")
    p.add_argument("--hosts", type=int, default=4, help="hosts (default 4)")
    p.add_argument("--nproc-per-host", type=int, default=1, metavar="P",
                   help="ranks per host (default 1)")
    p.add_argument("--rate", default="1gbit",
                   help="link rate per host and direction, tc units (default 1gbit)")
    p.add_argument("--burst", type=int, default=None, metavar="BYTES",
                   help="tbf bucket in bytes (default: 1 ms of traffic, at least 256 KiB)")
    p.add_argument("--rtt", type=float, default=0.0, metavar="MS",
                   help="round-trip time between hosts in milliseconds, added by a user-space "
                        "delay line in the switch (bench/netbed_delay.py; default 0: the "
                        "kernel's bridge, no added delay)")
    p.add_argument("--loss", type=float, default=0.0, metavar="PCT",
                   help="with --rtt: percent of frames the delay line drops (default 0)")
    p.add_argument("--mpi", action="store_true",
                   help="run the ranks with mpiexec (MPICH over TCP) instead of the launcher")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin each host's processes to its share of the cores")
    p.add_argument("--probe", action="store_true",
                   help="measure one TCP stream host 1 -> host 0 before the job")
    p.add_argument("--model-link", action="store_true",
                   help="tell the ranks' cost model the link, as a user of such a cluster "
                        "would (BITCOLL_COST_REMOTE_BANDWIDTH: the probed rate with --probe, "
                        "else the nominal one; with --rtt also BITCOLL_COST_REMOTE_LATENCY; "
                        "where pinned hosts share cores, BITCOLL_COST_HOST_CORES: a host's "
                        "share)")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when stopping the job (default 5)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run a library module as a script, like python -m")
    p.add_argument("target", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def parse_command_line(ap: argparse.ArgumentParser, argv: Sequence[str]
                       ) -> tuple[argparse.Namespace, list[str]]:
    """The testbed's options and the job's target (``[script, args...]``, ``[-m, module,
    args...]``, or ``[]`` for a probe only); exits 2 through ``ap.error`` on bad options."""
    args = ap.parse_args(list(argv))
    target: list[str] = args.target
    if target and target[0] == "--":
        target = target[1:]
    if not target and (args.module or not args.probe):
        ap.error("give the script (or -m module) to run and its arguments")
    if args.module:
        target = ["-m", *target]
    return args, target


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args, target = parse_command_line(ap, sys.argv[1:] if argv is None else argv)
    if not 1 <= args.hosts <= MAX_HOSTS:
        ap.error(f"--hosts must be in [1, {MAX_HOSTS}], got {args.hosts}")
    if args.nproc_per_host < 1:
        ap.error(f"--nproc-per-host must be >= 1, got {args.nproc_per_host}")
    if args.probe and args.hosts < 2:
        ap.error("--probe needs at least 2 hosts")
    try:
        rate_bits = parse_rate(args.rate)
    except ValueError as exc:
        ap.error(str(exc))
    burst = default_burst(rate_bits) if args.burst is None else args.burst
    if burst < 1500:
        ap.error(f"--burst must be at least one packet (1500 bytes), got {burst}")
    if args.rtt < 0 or not 0 <= args.loss < 100 or (args.loss and not args.rtt):
        ap.error("--rtt must be >= 0 and --loss in [0, 100), and --loss needs --rtt")
    if os.geteuid() != 0:
        ap.error("the testbed creates network namespaces: run it as root")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        ap.error(f"{' and '.join(missing)} not found (install iproute2)")

    mpiexec = None
    if args.mpi:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        mpiexec = beside if os.path.exists(beside) else shutil.which("mpiexec")
        if mpiexec is None:
            ap.error("--mpi: no mpiexec next to this interpreter or on PATH")

    stale = remove_stale()
    if stale:
        print(f"netbed: removed the namespaces of earlier testbeds that no longer run: "
              f"{', '.join(stale)}", file=sys.stderr)
    bed = Testbed(args.hosts, args.rate.strip().lower(), burst, f"{PREFIX}{os.getpid()}",
                  delayed=args.rtt > 0)
    try:
        bed.build()
    except SetupError as exc:
        print(f"netbed: cannot build the testbed: {exc}", file=sys.stderr)
        return 1
    delay_line: subprocess.Popen[str] | None = None
    try:
        if bed.delayed:
            delay_line = start_delay_line(bed, args.rtt, args.loss)
        print(f"netbed: {args.hosts} hosts x {args.nproc_per_host} ranks, links {bed.rate} "
              f"(tbf burst {burst}), {'mpiexec (MPICH over TCP)' if args.mpi else 'bitcoll TCP'}"
              + ("" if args.no_pin else ", hosts pinned to their share of the cores")
              + (f", round trip {args.rtt:g} ms added in user space"
                 + (f", {args.loss:g}% frame loss" if args.loss else "")
                 if bed.delayed else ""),
              flush=True)
        gbit = parse_rate(args.rate) / 1e9
        if args.probe:
            gbit = probe(bed)
            print(f"netbed: probe host 1 -> host 0: {gbit:.3f} Gbit/s", flush=True)
        if not target:
            return 0
        env = job_environment(os.environ)
        env[BURST_ENV] = str(burst)
        cpus = None
        share: float | None = None
        if not args.no_pin:
            usable = sorted(os.sched_getaffinity(0))
            cpus = [host_cpus(k, args.hosts, usable) for k in range(args.hosts)]
            if args.hosts > len(usable):
                # the busiest core's hosts: a collective runs at its slowest rank's pace
                share = 1 / -(-args.hosts // len(usable))
        if args.model_link:
            env.update(model_link(env, gbit, args.rtt, share))
            print(f"netbed: the ranks' cost model is told the link: {gbit:.3f} Gbit/s"
                  + (f", {args.rtt / 2:g} ms one way" if args.rtt else "")
                  + (f", {share:g} cores per host" if share is not None else ""), flush=True)
        if mpiexec is not None:
            cmd = mpi_command(bed, mpiexec, args.nproc_per_host, target, cpus)
            return Job([cmd], mpi_env(env), args.grace_period, names=["mpiexec"]).run()
        cmds = [host_command(bed, k, args.nproc_per_host, target, args.grace_period)
                for k in range(args.hosts)]
        return Job(cmds, env, args.grace_period, cpus).run()
    finally:
        if delay_line is not None:
            delay_line.terminate()
            try:
                delay_line.wait(5)
            except subprocess.TimeoutExpired:
                delay_line.kill()
                delay_line.wait()
        bed.remove()


if __name__ == "__main__":
    sys.exit(main())
