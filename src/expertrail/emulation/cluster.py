"""An emulated multi-node cluster on one Linux machine: network namespaces joined by shaped links.

Each node is a network namespace with its loopback up and one veth pair into a bridge in the
root namespace::

    node 0 (netns)                        root netns                      node 1 (netns)
    ranks 0..R-1 --lo (fast)              +--------+                      ranks R..2R-1
       <prefix>v0 10.a.b.1  <--veth-->  <prefix>b0  bridge  <prefix>b1  <--veth-->  <prefix>v1 10.a.b.2
       tbf egress (shaped)              tbf egress (shaped)               tbf egress ...

Ranks of one node talk over the namespace's loopback (traffic to a node's own address never
leaves it): the fast, "NVLink" class. Traffic between nodes crosses two veths and the bridge,
shaped with a token bucket (`tc tbf`) on the egress of both ends of every veth, so each
direction of each node's link runs at the requested rate. Ranks are started per node with
torchrun's multi-node rendezvous (`Cluster.run`), exactly as on a cluster, with gloo bound to
the node's veth (GLOO_SOCKET_IFNAME).

Names carry a unique prefix (``er`` + 4 hex digits), so clusters may coexist; each cluster
records itself in `STATE_DIR` with its owner's pid, and `down` (or ``expertrail cluster down``)
removes any cluster whose owner is gone. Teardown runs on context exit, at interpreter exit and
on SIGTERM / SIGINT / SIGHUP.

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, `tc`). Packet loss is a random drop on each
link's egress with nftables (`nft`); a delay needs tc's netem, which many kernels (this
machine's among them) are built without: asking for one there raises and says so.
"""
from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError, ExpertrailError

STATE_DIR = Path(os.environ.get("EXPERTRAIL_CLUSTER_DIR", "/run/expertrail-clusters"))
ANY_PREFIX = r"er[0-9a-f]{4}"
PREFIX_PATTERN = re.compile(rf"^{ANY_PREFIX}$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
# tc reads these as BYTES per second (1gbps = 8 gbit/s); refused, with the bit form to write instead.
_BYTE_UNITS = {"bps": "bit", "kbps": "kbit", "mbps": "mbit", "gbps": "gbit", "tbps": "tbit"}
_TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}      # divisors: 100us -> 100 / 1e6 exactly


class ClusterError(ExpertrailError, RuntimeError):
    """The emulated cluster cannot be built, run or removed (permissions, tools, a failed step)."""


# How long a packet may wait in the shaper's FIFO (tbf latency). The measurements in docs/ were
# taken with this; fabrics queue far less (docs/emulated-cluster.md, "How it works").
DEFAULT_QUEUE_S = 0.05


@dataclass(frozen=True)
class LinkSpec:
    """One direction of an inter-node link: ``rate`` bits/s, one-way ``delay`` seconds, ``loss``
    fraction of packets dropped, ``queue`` seconds of line rate the shaper's FIFO holds before
    it drops (tbf's ``latency``: how long a packet can wait behind others). Parsed from
    ``"1gbit"``, ``"1gbit,delay=100us,loss=0.01,queue=5ms"`` (loss also as ``1%``)."""

    rate: float
    delay: float = 0.0
    loss: float = 0.0
    queue: float = DEFAULT_QUEUE_S

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts:
            raise ConfigError("--inter-link is empty: give a rate such as 1gbit (optionally ,delay=100us,loss=0)")
        rate = _parse_rate(parts[0])
        delay = loss = 0.0
        queue = DEFAULT_QUEUE_S
        for part in parts[1:]:
            key, _, value = part.partition("=")
            if key == "delay":
                delay = _parse_time(value)
            elif key == "queue":
                queue = _parse_time(value, "queue")
                if queue < 1e-3:
                    raise ConfigError(f"--inter-link {text!r}: queue must be >= 1ms (the shaper needs room for a "
                                      "64 KiB segment)")
            elif key == "loss":
                loss = _float(value[:-1], "loss") / 100 if value.endswith("%") else _float(value, "loss")
            else:
                raise ConfigError(f"--inter-link {text!r}: unknown setting {key!r}; use rate,delay=T,loss=P,queue=T")
        if not 0 <= loss < 1:
            raise ConfigError(f"--inter-link {text!r}: loss must be in [0, 1) (or a percentage such as 1%)")
        return cls(rate, delay, loss, queue)

    def __str__(self) -> str:
        text = f"{self.rate / 1e9:g}gbit" if self.rate >= 1e9 else f"{self.rate / 1e6:g}mbit"
        if self.delay:
            text += f",delay={self.delay * 1e6:g}us"
        if self.loss:
            text += f",loss={self.loss * 100:g}%"
        if self.queue != DEFAULT_QUEUE_S:
            text += f",queue={self.queue * 1e3:g}ms"
        return text


def _float(value: str, what: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--inter-link: {what} {value!r} is not a number") from None


def _parse_rate(text: str) -> float:
    """Bits per second of ``1gbit``, ``200mbit``, ``500kbit``, ``1e6bit``... Only bit units:
    tc reads ``bps``, ``kbps``, ``mbps``, ``gbps`` as bytes per second, which a reader of
    "1gbps" takes for 1 Gbit/s; those are refused with the two forms one may have meant."""
    match = re.fullmatch(r"([0-9][0-9.e+-]*)\s*([a-z]+)", text.strip().lower())
    try:
        number, unit = match.group(1), match.group(2)
        value = float(number)
    except (AttributeError, ValueError):
        number, unit, value = None, None, None
    if unit in _BYTE_UNITS:
        bits, eight = _BYTE_UNITS[unit], f"{value * 8:g}{_BYTE_UNITS[unit]}"
        raise ConfigError(f"--inter-link rate {text!r}: tc reads {unit!r} as bytes per second ({eight}); "
                          f"write {number}{bits}, or {eight} if you meant bytes")
    if unit not in _UNITS:
        raise ConfigError(f"--inter-link rate {text!r}: write a number and a bit unit ({', '.join(_UNITS)}), "
                          "e.g. 1gbit or 200mbit")
    rate = value * _UNITS[unit]
    if rate < 1e5:
        raise ConfigError(f"--inter-link rate {text!r} is below 100kbit: too slow for a collective to finish")
    if rate == float("inf"):
        raise ConfigError(f"--inter-link rate {text!r}: give a finite rate, e.g. 1gbit")
    return rate


def _parse_time(text: str, what: str = "delay") -> float:
    match = re.fullmatch(r"([0-9.]+)\s*(s|ms|us|ns)", text.lower())
    if not match:
        raise ConfigError(f"--inter-link {what} {text!r}: write a number and a unit, e.g. 100us or 1ms")
    return _float(match.group(1), what) / _TIME_UNITS[match.group(2)]


# ---------------------------------------------------------------------------- system commands
def _sh(*argv: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run one iproute2 command (inside ``netns`` when given); raise ClusterError with its
    message when it fails and ``check``."""
    full = (["ip", "netns", "exec", netns] if netns else []) + list(argv)
    done = subprocess.run(full, capture_output=True, text=True)
    if check and done.returncode:
        raise ClusterError(f"`{' '.join(full)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def check_prerequisites() -> None:
    """Raise ClusterError naming what is missing: root / CAP_NET_ADMIN, `ip`, `tc`."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs iproute2 ({', '.join(missing)} not found): "
                           "apt-get install iproute2")
    probe = f"erprobe{os.getpid() % 100000}"
    done = subprocess.run(["ip", "link", "add", probe, "type", "bridge"], capture_output=True, text=True)
    if done.returncode:
        raise ClusterError("the emulated cluster needs CAP_NET_ADMIN (run as root, or in a container started with "
                           f"--cap-add NET_ADMIN): creating a bridge failed: {done.stderr.strip()}")
    subprocess.run(["ip", "link", "del", probe], capture_output=True)


def kernel_has_qdisc(kind: str) -> bool:
    """Whether this kernel's tc knows qdisc ``kind`` (netem is often built out)."""
    probe = f"erq{os.getpid() % 100000}"
    if subprocess.run(["ip", "link", "add", probe, "type", "dummy"], capture_output=True).returncode:
        return False
    try:
        args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1gbit", "burst", "64kb", "latency", "10ms"]}[kind]
        return subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", kind, *args],
                              capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True)


# ---------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    """N emulated nodes. ``with Cluster(2, LinkSpec.parse("1gbit")) as c: c.run([...], 2)``.

    nodes: number of namespaces; inter_link: the shaping of each node's link, both directions.
    Attributes after `up`: prefix (unique name part), netns[i], ifname[i] (the veth inside
    node i), address[i] (its IPv4 address).
    """

    nodes: int
    inter_link: LinkSpec
    prefix: str = ""
    subnet: str = ""
    owner_pid: int = 0
    netns: list = field(default_factory=list)
    ifname: list = field(default_factory=list)
    address: list = field(default_factory=list)

    def __post_init__(self):
        if not 1 <= int(self.nodes) <= 250:
            raise ConfigError(f"nodes={self.nodes} must be in 1..250 (one /24 of addresses per cluster)")
        self.nodes = int(self.nodes)

    # ---- lifecycle
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    @classmethod
    def attach(cls, prefix: str) -> "Cluster":
        """A recorded cluster (brought up by another process, e.g. ``expertrail cluster up``)."""
        record = list_clusters().get(prefix)
        if record is None or "nodes" not in record:
            names = ", ".join(sorted(list_clusters())) or "none"
            raise ClusterError(f"no emulated cluster named {prefix!r} (recorded: {names}); "
                               "start one with `expertrail cluster up`")
        fields_ = {k: v for k, v in record.items() if k in ("prefix", "subnet", "owner_pid", "netns",
                                                            "ifname", "address")}
        return cls(record["nodes"], LinkSpec(**record["inter_link"]), **fields_)

    def up(self, keep: bool = False) -> "Cluster":
        """Create the namespaces, bridge, veths, addresses and shaping; record the cluster.
        ``keep``: leave it up when this process ends (``expertrail cluster up``); it stays
        until `down` / ``expertrail cluster down``. Otherwise it goes with this process."""
        check_prerequisites()
        if self.inter_link.delay and not kernel_has_qdisc("netem"):
            raise ClusterError(
                f"--inter-link {self.inter_link}: a delay needs tc's netem qdisc, which this kernel does not have "
                "(CONFIG_NET_SCH_NETEM is not set); give a rate, and a loss if wanted, e.g. 1gbit,loss=1%")
        if self.inter_link.loss and shutil.which("nft") is None:
            raise ClusterError(f"--inter-link {self.inter_link}: packet loss is applied with nftables (a random "
                               "drop on each link's egress); install it: apt-get install nftables")
        remove_stale_clusters()
        self.prefix = self.prefix or _new_prefix()
        self.subnet = self.subnet or _free_subnet()
        self.owner_pid = 0 if keep else os.getpid()
        net = ipaddress.ip_network(self.subnet)
        self.netns = [f"{self.prefix}n{i}" for i in range(self.nodes)]
        self.ifname = [f"{self.prefix}v{i}" for i in range(self.nodes)]
        self.address = [str(net.network_address + i + 1) for i in range(self.nodes)]
        self._save()                      # recorded first, so a crash half-way is still cleaned up
        if not keep:
            _install_signal_handlers()
            _LIVE[self.prefix] = self
        try:
            bridge = f"{self.prefix}br"
            _sh("ip", "link", "add", bridge, "type", "bridge")
            _sh("ip", "link", "set", bridge, "up")
            for i, ns in enumerate(self.netns):
                outside = f"{self.prefix}b{i}"
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "set", "lo", "up", netns=ns)
                _sh("ip", "link", "add", self.ifname[i], "type", "veth", "peer", "name", outside)
                _sh("ip", "link", "set", self.ifname[i], "netns", ns)
                _sh("ip", "link", "set", outside, "master", bridge, "up")
                _sh("ip", "addr", "add", f"{self.address[i]}/{net.prefixlen}", "dev", self.ifname[i], netns=ns)
                _sh("ip", "link", "set", self.ifname[i], "up", netns=ns)
                self._shape(self.ifname[i], ns)
                self._shape(outside, None)
        except BaseException:
            self.down()
            raise
        return self

    def _shape(self, dev: str, netns: str | None) -> None:
        """Token-bucket egress shaping of ``dev`` to the link rate. The bucket holds at least a
        64 KiB GSO segment (veths hand over up to 64 KiB at once), else tbf would split it."""
        rate = self.inter_link.rate
        burst = max(64 * 1024 + 1514, int(rate / 8 / 250))     # ~4 ms of line rate, >= one GSO segment
        _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{int(rate)}bit", "burst", str(burst),
            "latency", f"{self.inter_link.queue * 1e6:g}us", netns=netns)
        if self.inter_link.delay:
            _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "netem", "delay",
                f"{self.inter_link.delay * 1e6:g}us", netns=netns)
        if self.inter_link.loss:
            # A random drop on the device's egress (nftables netdev egress hook, numgen): the
            # kernel's netem would do it, but is often built out. Per-namespace tables; the
            # root namespace's is removed by `teardown`.
            table, per_million = f"{self.prefix}loss", round(self.inter_link.loss * 1e6)
            _sh("nft", "add", "table", "netdev", table, netns=netns)
            _sh("nft", "add", "chain", "netdev", table, dev,
                f"{{ type filter hook egress device {dev} priority 0 ; }}", netns=netns)
            _sh("nft", "add", "rule", "netdev", table, dev, "numgen", "random", "mod", "1000000", "<",
                str(per_million), "counter", "drop", netns=netns)

    def down(self) -> None:
        """Remove everything of this cluster: processes in its namespaces, namespaces (their
        veths go with them), bridge, record. Safe to call twice."""
        if not self.prefix:
            return
        teardown(self.prefix)
        _LIVE.pop(self.prefix, None)
        if not _LIVE:
            _restore_signal_handlers()

    # ---- running ranks
    def torchrun_commands(self, command: list, ranks_per_node: int, port: int = 29400) -> list:
        """The per-node launch lines: ``ip netns exec <node> torchrun --nnodes N --node-rank i
        --nproc-per-node R --rdzv-backend static --rdzv-endpoint <node 0>:port ...``, running
        ``command`` (a python script with its arguments, ``-m module ...``, or any program).
        The static rendezvous gives node i the global ranks [i*R, (i+1)*R), as a fixed-size
        multi-node job has (c10d's elastic rendezvous numbers nodes in the order they join).
        Each node runs on its own share of this machine's cores (`node_cores`), as a node has
        cores of its own: torch then sizes its thread pool to them."""
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        if command and command[0] not in ("-m",) and not command[0].endswith(".py"):
            torchrun.append("--no-python")
        cores = self.node_cores()
        pin = [["taskset", "-c", ",".join(map(str, share))] for share in cores] if cores else [[]] * self.nodes
        return [["ip", "netns", "exec", ns, *pin[i], *torchrun, "--nnodes", str(self.nodes), "--node-rank", str(i),
                 "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "static",
                 "--rdzv-endpoint", f"{self.address[0]}:{port}", "--rdzv-id", self.prefix,
                 "--local-addr", self.address[i], "--max-restarts", "0", *command]
                for i, ns in enumerate(self.netns)]

    def node_cores(self) -> list | None:
        """The cores each node's ranks may run on: this process's cores dealt out in equal
        contiguous shares, one per node (the remainder unused), or None (no pinning) when
        there are fewer cores than nodes or no `taskset` (util-linux) to pin with."""
        available = sorted(os.sched_getaffinity(0))
        share = len(available) // self.nodes
        if share == 0 or shutil.which("taskset") is None:
            return None
        return [available[i * share:(i + 1) * share] for i in range(self.nodes)]

    def node_env(self, i: int) -> dict:
        """Environment of node i's ranks: gloo bound to the node's link, so traffic to another
        node crosses it (and traffic inside the node stays on its loopback), and the cluster's
        name, link and node count for reports."""
        return dict(os.environ, GLOO_SOCKET_IFNAME=self.ifname[i], TP_SOCKET_IFNAME=self.ifname[i],
                    EXPERTRAIL_CLUSTER=self.prefix, EXPERTRAIL_INTER_LINK=str(self.inter_link),
                    EXPERTRAIL_NODES=str(self.nodes))

    def run(self, command: list, ranks_per_node: int, timeout: float | None = None, port: int = 29400,
            capture: bool = False) -> list:
        """Run ``command`` on every node under torchrun; wait for all; return each node's
        CompletedProcess (stdout/stderr captured when ``capture``). A node that fails, or a
        timeout, stops the others; raises ClusterError naming the node and its exit status.
        Ctrl-C (KeyboardInterrupt) ends every launcher and its ranks at once with SIGKILL, so
        that none prints a traceback on the way out (torchrun answers SIGTERM with one), and
        is raised again."""
        if not self.prefix:
            raise ClusterError("the cluster is not up: call up() or use it as a context manager")
        if int(ranks_per_node) < 1:
            raise ConfigError(f"ranks_per_node={ranks_per_node} must be at least 1")
        out = subprocess.PIPE if capture else None
        procs = [subprocess.Popen(argv, env=self.node_env(i), stdout=out, stderr=out, text=True,
                                  start_new_session=True)
                 for i, argv in enumerate(self.torchrun_commands(list(command), ranks_per_node, port))]
        deadline = None if timeout is None else time.monotonic() + timeout
        failed, timed_out, interrupted = None, False, False
        try:
            while failed is None and any(p.poll() is None for p in procs):
                failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            for p in procs:                   # a failed node: the others would wait for it
                if p.poll() is None:
                    (_kill_tree if interrupted else _kill_session)(p)
            results = [subprocess.CompletedProcess(p.args, p.returncode, *p.communicate()) for p in procs]
        if timed_out:
            raise ClusterError(f"cluster {self.prefix}: the command did not finish within {timeout:g} s")
        failed = failed if failed is not None else next((i for i, r in enumerate(results) if r.returncode), None)
        if failed is not None:
            tail = (results[failed].stderr or "")[-2000:]
            raise ClusterError(f"node {failed} of cluster {self.prefix} exited with status "
                               f"{results[failed].returncode}" + (f":\n{tail}" if tail else ""))
        return results

    # ---- records
    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.prefix}.json").write_text(json.dumps(asdict(self)))     # inter_link as a dict too


_LIVE: dict = {}


_PREVIOUS: dict = {}     # signal -> the handler before the first live cluster took it


def _install_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if sig in _PREVIOUS:
            continue
        try:
            _PREVIOUS[sig] = signal.signal(sig, _on_signal)
        except ValueError:            # not the main thread: atexit and `cluster down` still apply
            pass


def _restore_signal_handlers() -> None:
    for sig, handler in _PREVIOUS.items():
        try:
            signal.signal(sig, handler)
        except ValueError:
            pass
    _PREVIOUS.clear()


def _on_signal(signum, frame):
    """Tear every live cluster down, then do what the signal did before (raise
    KeyboardInterrupt for SIGINT, end the process for SIGTERM...)."""
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    _down_all()
    _restore_signal_handlers()
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


@atexit.register
def _down_all() -> None:
    """Tear down every cluster this process owns (at exit, and on a signal)."""
    for cluster in list(_LIVE.values()):
        cluster.down()


def _kill_session(proc: subprocess.Popen) -> None:
    """End a launcher we started and everything it started (its own session), by id."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _children() -> dict:
    """parent pid -> [child pids] of every process on the machine (from /proc)."""
    out: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rpartition(")")[2].split()[1])    # after "pid (comm) state"
            except (OSError, ValueError, IndexError):
                continue                      # gone meanwhile
            out.setdefault(parent, []).append(int(entry))
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """End a launcher we started and every process under it with SIGKILL, by id: torchrun
    starts each rank in a session of its own, so its process group does not hold them. Each
    process found is stopped first (SIGSTOP), so none starts another behind the search; then
    all are killed, with no chance to print (Ctrl-C's way out; `_kill_session` lets torchrun
    stop its ranks itself, and report it)."""
    found, new = set(), {proc.pid}
    while new:
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        found |= new
        children = _children()
        new = {c for pid in found for c in children.get(pid, ())} - found
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _new_prefix() -> str:
    taken = set(list_clusters()) | leftover_prefixes()
    while True:
        prefix = "er" + secrets.token_hex(2)
        if prefix not in taken:
            return prefix


def _netns_names() -> list:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _free_subnet() -> str:
    """A /24 in 10.213.0.0/16 that no address of this machine and no other cluster uses."""
    used = set()
    done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    for match in re.finditer(r"inet (\d+\.\d+\.\d+)\.\d+/", done.stdout):
        used.add(match.group(1))
    for record in list_clusters().values():
        used.add(record.get("subnet", "").rsplit(".", 1)[0])
    for third in secrets.SystemRandom().sample(range(256), 256):
        if f"10.213.{third}" not in used:
            return f"10.213.{third}.0/24"
    raise ClusterError("no free /24 left in 10.213.0.0/16 for another emulated cluster")


def list_clusters() -> dict:
    """prefix -> record of every recorded cluster (live or left behind)."""
    out = {}
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob("er*.json"):
            try:
                out[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                out[path.stem] = {"prefix": path.stem}
    return out


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a cluster's owner; 0 and below: none)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True


def _resources(prefix: str = ANY_PREFIX) -> tuple[list, list, list]:
    """(namespaces, links, nftables tables) on this machine of the clusters whose name matches
    the regex ``prefix``: every name a cluster creates is its prefix plus one of these forms."""
    netns = [n for n in _netns_names() if re.fullmatch(rf"{prefix}n\d+", n)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    links = re.findall(rf"^\d+: ({prefix}(?:br|b\d+|v\d+))[@:]", links, flags=re.M)
    tables = []
    if shutil.which("nft"):
        listed = subprocess.run(["nft", "list", "tables", "netdev"], capture_output=True, text=True).stdout
        tables = re.findall(rf"^table netdev ({prefix}loss)$", listed, flags=re.M)
    return netns, links, tables


def teardown(prefix: str) -> list:
    """Remove cluster ``prefix``: end the processes in its namespaces, delete namespaces,
    veths, bridge and loss table, drop its record. Returns what was removed."""
    if not PREFIX_PATTERN.match(prefix):
        raise ConfigError(f"{prefix!r} is not an emulated cluster's name (er + 4 hex digits)")
    netns, _, _ = _resources(prefix)
    for ns in netns:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:                       # processes inside our namespace are ours
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    _, links, tables = _resources(prefix)       # the namespaces took their veths with them
    for name in links:
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    for table in tables:
        subprocess.run(["nft", "delete", "table", "netdev", table], capture_output=True)
    removed = netns + links + [f"nft table netdev {t}" for t in tables]
    record = STATE_DIR / f"{prefix}.json"
    if record.exists():
        record.unlink()
        removed.append(str(record))
    return removed


def remove_stale_clusters() -> list:
    """Tear down every recorded cluster whose owner process is gone (a killed run); returns
    their names."""
    stale = [p for p, r in list_clusters().items()
             if r.get("owner_pid") != 0 and not process_alive(int(r.get("owner_pid") or -1))]
    for prefix in stale:
        teardown(prefix)
    return stale


def leftovers() -> list:
    """Names of emulated-cluster namespaces, links and nftables tables on this machine (none
    after a clean run)."""
    return [name for names in _resources() for name in names]


def leftover_prefixes() -> set:
    """The cluster names those leftovers belong to."""
    return {name[:6] for name in leftovers()}
