"""`expertrail cluster up|run|status|down`: an emulated multi-node cluster on this machine
(docs/emulated-cluster.md)."""
from __future__ import annotations

import argparse
import os
import sys

from ...errors import ConfigError
from ..arguments import inter_link_argument, positive_int
from ..ranks import after_interrupt


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="an emulated multi-node cluster on this machine (network namespaces, "
                                       "shaped links)",
                       description="N emulated nodes: network namespaces joined by veth links to a bridge, the "
                                   "inter-node links shaped with tc (token bucket) in both directions; ranks of a "
                                   "node share its loopback. Needs root (CAP_NET_ADMIN) and iproute2. See "
                                   "docs/emulated-cluster.md.")
    verbs = p.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="bring a cluster up and leave it up (until `cluster down`)")
    run = verbs.add_parser("run", help="run a command on every node under torchrun's multi-node launch",
                           description="Runs `torchrun --nnodes N --node-rank i --nproc-per-node R --rdzv-endpoint "
                                       "<node 0>:PORT COMMAND` inside each node's namespace (a python script, "
                                       "-m module, or any program). Without --name, a cluster is brought up for "
                                       "the run and torn down after it, also on failure or Ctrl-C.")
    for q in (up, run):
        q.add_argument("--nodes", type=positive_int(2), default=2, help="emulated nodes (default %(default)s)")
        inter_link_argument(q)
    run.add_argument("--ranks-per-node", type=positive_int(2), default=2,
                     help="ranks per node (torchrun --nproc-per-node; the EP domain size by default) "
                          "(default %(default)s)")
    run.add_argument("--name", help="run on this cluster (from `cluster up`) instead of a new one")
    run.add_argument("--port", type=positive_int(29400), default=29400,
                     help="rendezvous port on node 0 (default %(default)s)")
    run.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped (default: none)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="the command each rank runs, after --")
    down = verbs.add_parser("down", help="remove clusters: the named ones, or with --all every one (also "
                                         "what a killed run left behind)")
    down.add_argument("names", nargs="*", help="cluster names, as `cluster status` lists them")
    down.add_argument("--all", action="store_true", help="every emulated cluster on this machine")
    verbs.add_parser("status", help="list the emulated clusters on this machine")


def _check_cluster_command(command: list, nodes: int, ranks_per_node: int) -> None:
    """`cluster run`'s command, before the cluster comes up: the script, module or program
    exists here (every node runs it from this directory, with this Python), and ``expertrail
    bench`` / ``train`` get the checks they would get with ``--nodes``."""
    import importlib.util
    import shutil
    head = command[0]
    if head == "-m":
        if len(command) < 2:
            raise ConfigError("-m needs a module, e.g. expertrail cluster run -- -m expertrail bench")
        if importlib.util.find_spec(command[1].split(".")[0]) is None:
            raise ConfigError(f"-m {command[1]}: no module {command[1].split('.')[0]!r} in {sys.executable}")
        inner = command[2:] if command[1] == "expertrail" else None
    elif head.endswith(".py"):
        if not os.path.isfile(head):
            raise ConfigError(f"{head}: no such script (each node runs it from {os.getcwd()})")
        inner = None
    elif shutil.which(head) is None:
        raise ConfigError(f"{head!r}: not a program on PATH nor a .py script; give a script, -m module or program "
                          "after --")
    else:
        inner = command[1:] if os.path.basename(head) == "expertrail" else None
    if inner and inner[0] in ("bench", "train"):
        from ..cli import parser
        from . import bench, train
        sub = parser().parse_args(inner)
        world, ranks = nodes * ranks_per_node, f"--nodes {nodes} x --ranks-per-node {ranks_per_node}"
        try:
            if sub.command == "bench":
                bench.check(bench.config_of(sub), world, sub.domain_size, ranks, decode=sub.decode)
            else:
                train.check(train.config_of(sub), world, ranks)
        except ConfigError as err:
            note = ""
            if str(err).startswith("--domain-size") and "--domain-size" not in {a.split("=", 1)[0] for a in inner}:
                note = (f" (bench's default; `bench --nodes` sets it to the ranks per node, here give "
                        f"--domain-size {ranks_per_node})")
            raise ConfigError(f"{' '.join(command[:3])}: {err}{note}") from None


def run(args) -> int:
    from ...emulation import cluster as cl
    if args.verb == "status":
        records = cl.list_clusters()
        for name, r in sorted(records.items()):
            owner = r.get("owner_pid")
            state = "kept up" if owner == 0 else (f"owned by pid {owner}" if cl.process_alive(int(owner or -1))
                                                  else "left behind (owner gone)")
            link = cl.LinkSpec(**r["inter_link"]) if "inter_link" in r else "?"
            print(f"{name}: {r.get('nodes', '?')} nodes {', '.join(r.get('address', []))}, inter-link {link}, {state}")
        stray = sorted(cl.leftover_prefixes() - set(records))
        for name in stray:
            print(f"{name}: namespaces or links with no record (remove with `expertrail cluster down {name}`)")
        if not records and not stray:
            print("no emulated cluster")
        return 0
    if args.verb == "down":
        names = sorted(set(cl.list_clusters()) | cl.leftover_prefixes()) if args.all else args.names
        if not names:
            raise ConfigError("name the clusters to remove (see `expertrail cluster status`), or give --all")
        for name in names:
            removed = cl.teardown(name)
            print(f"{name}: removed {len(removed)} namespaces, links and records" if removed else f"{name}: nothing left")
        return 0
    link = args.inter_link                # a LinkSpec: parsed (and checked) with the arguments
    if args.verb == "up":
        c = cl.Cluster(args.nodes, link).up(keep=True)
        print(f"{c.prefix}: {c.nodes} nodes ({', '.join(c.address)}), inter-link {link}; "
              f"run with `expertrail cluster run --name {c.prefix} -- ...`, remove with `expertrail cluster down {c.prefix}`")
        return 0
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ConfigError("give the command after --, e.g. expertrail cluster run -- my_script.py --steps 10")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout:g}: give the seconds the run may take, > 0 (or leave it out)")
    if args.port > 65535:
        raise ConfigError(f"--port {args.port}: give a TCP port, 1..65535")
    cluster = cl.Cluster.attach(args.name) if args.name else cl.Cluster(args.nodes, link)
    _check_cluster_command(command, cluster.nodes, args.ranks_per_node)     # before anything starts
    try:
        if args.name:
            cluster.run(command, args.ranks_per_node, args.timeout, args.port)
            return 0
        with cluster as c:
            print(f"cluster {c.prefix}: {c.nodes} nodes x {args.ranks_per_node} ranks, inter-link {link} (emulated)",
                  file=sys.stderr)
            c.run(command, args.ranks_per_node, args.timeout, args.port)
    except KeyboardInterrupt:
        raise after_interrupt(cluster, kept=bool(args.name)) from None
    return 0
