"""Where a command's ranks run: local gloo processes, the ranks of a torchrun launch, or an
emulated cluster (the command run again under torchrun on every node). Every command that
needs ranks starts them through here."""
from __future__ import annotations

import os

from ..errors import ExpertrailError
from .arguments import given


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_CLUSTER_OPTIONS = ("--nodes", "--ranks-per-node", "--inter-link")


def on_cluster(args) -> int:
    """`bench` / `train` with ``--nodes N``: bring an emulated cluster up, run this same
    command on it under torchrun (one launcher per node), tear it down."""
    from ..emulation.cluster import Cluster
    inner, skip = [], False
    for arg in args.argv_seen:            # the same options, less the cluster's own
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _CLUSTER_OPTIONS:
            skip = "=" not in arg
            continue
        inner.append(arg)
    if args.command == "bench" and not given(args, "--domain-size"):
        inner += ["--domain-size", str(args.ranks_per_node)]
    cluster = Cluster(args.nodes, args.inter_link)
    try:
        with cluster:
            cluster.run(["-m", "expertrail", args.command, *inner,
                         *(["--no-progress"] if args.command == "bench" else [])], args.ranks_per_node)
    except KeyboardInterrupt:
        raise after_interrupt(cluster) from None
    return 0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a cluster run, saying what became of the cluster; `main` prints it as one
    line and exits 130."""


def after_interrupt(cluster, kept: bool = False) -> Interrupted:
    """What Ctrl-C left of ``cluster``: torn down (checked), or with ``kept`` (a cluster of
    `cluster up`) still up, its run's processes ended."""
    from ..emulation import cluster as cl
    if kept:
        return Interrupted(f"the command's ranks were stopped; cluster {cluster.prefix} is still up "
                            f"(`expertrail cluster down {cluster.prefix}` removes it)")
    if not cluster.prefix:
        return Interrupted("no cluster was brought up")
    if cluster.prefix in cl.list_clusters() or any(n.startswith(cluster.prefix) for n in cl.leftovers()):
        return Interrupted(f"cluster {cluster.prefix} was not fully removed: run `expertrail cluster down "
                            f"{cluster.prefix}`")
    return Interrupted(f"cluster {cluster.prefix} torn down")


def note_emulated(report: dict, **more) -> None:
    """On an emulated cluster, put in ``report["emulated"]`` the cluster this rank runs on (the
    environment `emulation.cluster` gives its ranks) and ``more``; elsewhere nothing."""
    name = os.environ.get("EXPERTRAIL_CLUSTER")
    if name:
        report["emulated"] = {"cluster": name, "inter_link": os.environ.get("EXPERTRAIL_INTER_LINK", "?"), **more}


class Ranks:
    """The ranks a command runs on, as a context manager: ``world`` local gloo processes, or,
    launched by torchrun (also on an emulated cluster), the launch's ranks, this process one of
    them (its process group made on entry, torn down together on a clean exit).

    ``run(fn, *args)`` runs ``fn(rank, world, *args)`` on every rank (collective) and returns
    this process's result (rank 0's for local ranks); ``reports`` says whether this process
    prints the command's report (local ranks' owner, or torchrun's rank 0). ``cuda``: NCCL on
    the GPUs where there are enough, else gloo. ``malloc_heap``: see `emulation.launch`.
    """

    def __init__(self, world: int, cuda: bool = False, malloc_heap: bool = False):
        self.torchrun = under_torchrun()
        self.world, self.rank = world, 0
        self._cuda, self._malloc_heap, self._pool = cuda, malloc_heap, None

    def __enter__(self) -> "Ranks":
        import torch
        if self.torchrun:
            import torch.distributed as dist
            nccl = self._cuda and torch.cuda.is_available()
            if nccl:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if nccl else "gloo")
            if self._malloc_heap:
                from ..emulation.launch import use_heap_for_large_buffers
                use_heap_for_large_buffers()
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            from ..emulation.launch import LocalRanks
            nccl = self._cuda and torch.cuda.is_available() and torch.cuda.device_count() >= self.world
            self._pool = LocalRanks(self.world, backend="nccl" if nccl else "gloo",
                                    malloc_heap=self._malloc_heap).__enter__()
        return self

    @property
    def reports(self) -> bool:
        return self.rank == 0

    @property
    def ranks_per_node(self) -> int | None:
        """torchrun's ranks per node (``LOCAL_WORLD_SIZE``); None for local ranks."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None if self.torchrun else None

    def run(self, fn, *args, **kwargs):
        if self.torchrun:
            return fn(self.rank, self.world, *args, **kwargs)
        return self._pool.run(fn, *args, **kwargs)[0]

    def attempt(self, fn, *args, **kwargs) -> tuple:
        """`run`, with a failure on the ranks given back as ``(None, message)`` for a command
        that reports it and goes on ((result, None) otherwise). Under torchrun only expertrail's
        own errors are caught: they are raised on every rank alike."""
        from ..emulation.launch import RankError
        try:
            return self.run(fn, *args, **kwargs), None
        except RankError as err:
            first = err.errors[min(err.errors)]
            return None, f"raised on rank(s) {sorted(err.errors)}: {first[0]}"
        except ExpertrailError as err:
            if not self.torchrun:
                raise
            return None, f"raised: {err}"

    def __exit__(self, kind, *exc) -> None:
        if self._pool is not None:
            self._pool.__exit__(kind, *exc)
        elif kind is None:
            import torch.distributed as dist
            dist.barrier()          # tear down together: a rank that leaves early aborts its peers' gloo threads
            dist.destroy_process_group()
