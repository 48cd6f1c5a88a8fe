"""EPGroups: the expert-parallel process groups and the placement of experts on them.

Ranks are laid out EP-innermost: with world W and EP size P, EP group g holds global ranks
``[g*P, (g+1)*P)`` of the parent group. Inside an EP group, EP rank r lives in domain
``r // domain_size`` at local index ``r % domain_size``; its rail group is the ranks with the
same local index in every domain of its EP group (they share a NIC rail).
"""
from __future__ import annotations

import atexit
import datetime
import gc
import math
import os
import time
import weakref
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ConfigError, ConfigMismatchError, ExpertrailError
from .transport import Channel, all_gather_single

DOMAIN_SIZE_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"


def default_domain_size(ep_size: int) -> int:
    """Ranks per fast-link domain when the caller gives none.

    ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` if set (the Hybrid-EP setting), else torchrun's
    ``LOCAL_WORLD_SIZE`` (GPUs of one node share NVLink), else the whole EP group.
    """
    for name in (DOMAIN_SIZE_ENV, "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name)
        if value:
            try:
                size = int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
            if name == "LOCAL_WORLD_SIZE" and ep_size % size:
                continue  # a node larger than the EP group, or not aligned with it: not a domain
            return min(size, ep_size)
    return ep_size


def _group_device(group) -> torch.device:
    """The device collectives of ``group`` take tensors on (NCCL: this rank's GPU)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Gather a short list of ints from every rank of ``group``: result[rank] = that rank's list."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group) * len(values), dtype=torch.int64, device=device)
    all_gather_single(out, mine, group=group)
    return out.view(-1, len(values)).tolist()


@contextmanager
def guarded(op: str, groups: "EPGroups | str", timeout: float | None = None):
    """Turn a backend failure inside a collective into a CollectiveError naming the
    operation, the group, how long it waited and the likely cause.

    ``groups``: the `EPGroups` the collective runs on, or a label for a group that is not one
    (``timeout`` then bounds it). A failed gloo / NCCL group stays broken, so `EPGroups`
    remembers its first failure: every later collective on it raises at once, saying so and
    what to do, instead of failing with gloo's own error or waiting for another timeout.
    """
    health = groups if isinstance(groups, EPGroups) else None
    label = groups.label if health else groups
    timeout = groups.timeout if health else timeout
    if health is not None and health.failure is not None:
        raise CollectiveError(f"{op} on {label} cannot run: {health.failure}. {_REBUILD}")
    start = time.monotonic()
    try:
        yield
    except ExpertrailError:
        raise
    except RuntimeError as err:           # gloo / NCCL: peer closed, timed out, group aborted
        waited = time.monotonic() - start
        limit = f" (the groups' timeout is {timeout:g} s)" if timeout else ""
        cause = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}" if str(err) else type(err).__name__
        what = f"{op} on {label} failed after {waited:.1f} s{limit}"
        if health is not None:
            health.failure = f"an earlier collective on these groups failed ({what})"
        raise CollectiveError(f"{what}: a rank of the group probably exited or stopped calling {op} ({cause})."
                              + (f" {_REBUILD}" if health is not None else "")) from err


# What to do once a group has failed: the same words wherever it is said.
_REBUILD = ("A failed process group cannot be used again: on every rank, destroy it "
            "(torch.distributed.destroy_process_group()), initialise it again, then build new EPGroups and "
            "dispatchers (or restart the job).")


def _field_code(value) -> int:
    """An int64 every rank computes alike for a setting: ints as they are, anything else
    (names, floats, None, dicts of options) as the CRC-32 of its repr."""
    if isinstance(value, (bool, int)) and -2 ** 63 <= int(value) < 2 ** 63:
        return int(value)
    return zlib.crc32(repr(value).encode())


def check_same_on_all_ranks(fields: dict, group, device: torch.device, what: str,
                            groups: "EPGroups | str" = "the process group") -> None:
    """Raise ConfigMismatchError on every rank if any field differs between ranks of ``group``.

    fields: name -> value (int, bool, float, str, None or anything with a stable repr). One
    all-gather of int codes compares them; only when they differ does a second all-gather
    bring every rank's value, so the message names each rank's setting, not a code.
    ``groups``: the EPGroups ``group`` belongs to (or a label), for `guarded`'s errors.
    """
    names = list(fields)
    with guarded(f"the agreement on {what}'s settings", groups):
        table = all_gather_ints([_field_code(fields[n]) for n in names], group, device)
    differing = [n for i, n in enumerate(names) if len({row[i] for row in table}) > 1]
    if differing:
        shown = [None] * dist.get_world_size(group)      # every rank saw the same table: all gather here
        with guarded(f"the agreement on {what}'s settings", groups):
            dist.all_gather_object(shown, [repr(fields[n]) for n in differing], group=group)
        lines = [f"  {n}: " + ", ".join(f"rank {r}={values[i]}" for r, values in enumerate(shown))
                 for i, n in enumerate(differing)]
        raise ConfigMismatchError(
            f"{what} was built with different settings on different ranks; every rank of the "
            "group must pass the same values:\n" + "\n".join(lines))


@dataclass(eq=False)
class EPGroups:
    """Process groups of expert parallelism for this rank.

    Attributes:
        ep_group / ep_size / ep_rank: the ranks that share the experts, and this rank in it.
        ep_ranks: global ranks (of the default group) of the EP group, by EP rank.
        domain_group / domain_size / domain_rank: this rank's fast-link domain and its local
            index in it. ``domain_index`` is the domain's number inside the EP group.
        rail_group: the ranks of the EP group with this rank's local index, one per domain,
            ordered by domain.
        device: the device tensors must be on for these groups (cpu for gloo, cuda for nccl).
        control_group: the EP ranks again, for the exchanges of a few numbers (a dispatch's
            counts and headers, a combine's flags: `dispatch.agreement`), or None to use the
            EP group. On gloo each process group has its own sockets, and a message waits
            behind every byte posted before it on its socket: on the EP group's, the dispatch
            counts of one micro-batch would wait behind another's rows in flight (a whole
            exchange, tens of ms on a 1 Gbit/s link) while the cores sit idle. `from_default`
            makes one on gloo; on NCCL a second communicator would cost GPU memory, and the
            EP group serves.

    `channel` gives the one `transport.Channel` of each process group (the EP, domain and rail
    groups may be the same group, which must then share its tag counter). ``failure`` says
    why these groups cannot be used any more, or is None: the first collective on them that
    failed (`guarded`), after which they are broken for good, or `release` (at exit); every
    later call then raises at once.
    """

    ep_group: object
    ep_size: int
    ep_rank: int
    ep_ranks: tuple[int, ...]
    domain_group: object
    domain_size: int
    rail_group: object
    device: torch.device
    timeout: float | None = None
    control_group: object = None

    def __post_init__(self):
        self._channels = {}
        self.failure: str | None = None
        _built.add(self)

    def release(self, why: str) -> None:
        """Drop this object's process groups (and their channels); every later collective on
        it raises, saying ``why``. `_release_at_exit` calls it for every EPGroups."""
        self.ep_group = self.domain_group = self.rail_group = self.control_group = None
        self._channels.clear()
        self.failure = f"its process groups were released ({why})"

    def check_same(self, fields: dict, what: str) -> None:
        """`check_same_on_all_ranks` over the EP group (collective)."""
        check_same_on_all_ranks(fields, self.ep_group, self.device, what, self)

    def channel(self, group) -> Channel:
        """The `Channel` of ``group`` (one of this object's groups, or None for the default)."""
        key = id(group)
        if key not in self._channels:
            self._channels[key] = Channel(group)
        return self._channels[key]

    @property
    def ep_channel(self) -> Channel:
        return self.channel(self.ep_group)

    @property
    def control_channel(self) -> Channel:
        """The channel of the control exchanges (``control_group``, else the EP group's)."""
        return self.channel(self.control_group if self.control_group is not None else self.ep_group)

    @property
    def domain_channel(self) -> Channel:
        return self.channel(self.domain_group)

    @property
    def rail_channel(self) -> Channel:
        return self.channel(self.rail_group)

    @property
    def label(self) -> str:
        return f"the EP group of global ranks {list(self.ep_ranks)}"

    @property
    def num_domains(self) -> int:
        return self.ep_size // self.domain_size

    @property
    def domain_index(self) -> int:
        return self.ep_rank // self.domain_size

    @property
    def domain_rank(self) -> int:
        return self.ep_rank % self.domain_size

    def domain_of(self, ep_rank: int) -> int:
        """Domain number of an EP rank."""
        return ep_rank // self.domain_size

    def num_local_experts(self, num_experts: int) -> int:
        """Experts per EP rank; raises ConfigError unless ``num_experts % ep_size == 0``."""
        if num_experts <= 0 or num_experts % self.ep_size:
            raise ConfigError(
                f"num_experts={num_experts} must be a positive multiple of ep_size={self.ep_size}; "
                f"choose num_experts in {{{self.ep_size}, {2 * self.ep_size}, ...}} or another ep_size")
        return num_experts // self.ep_size

    def experts_of(self, ep_rank: int, num_experts: int) -> range:
        """Global expert ids held by ``ep_rank`` (contiguous placement)."""
        local = self.num_local_experts(num_experts)
        return range(ep_rank * local, (ep_rank + 1) * local)

    def rank_of_expert(self, num_experts: int) -> torch.Tensor:
        """int64 [E]: EP rank holding each expert."""
        local = self.num_local_experts(num_experts)
        return torch.arange(num_experts, device=self.device) // local

    @classmethod
    def from_default(cls, ep_size: int | None = None, domain_size: int | None = None,
                     group=None, timeout: float | None = None) -> "EPGroups":
        """Build the groups from the default process group or ``group``.

        Every rank of the default process group must call this with the same arguments (new
        groups are collective). ``ep_size`` defaults to the size of ``group``; an EP size
        smaller than it gives several EP groups side by side. ``domain_size`` defaults to
        `default_domain_size`. ``timeout`` (seconds) bounds every collective on these groups
        (dedicated groups are created for it); by default the process group's timeout applies.
        """
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized: call "
                              "torch.distributed.init_process_group(...) first, or use expertrail.emulation.launch")
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        device = _group_device(group)
        ep_size = world if ep_size is None else int(ep_size)
        domain_size = default_domain_size(ep_size) if domain_size is None else int(domain_size)
        # Agree on the sizes before any group is created: differing sizes would hang new_group.
        seconds = _timeout_seconds(timeout)
        check_same_on_all_ranks({"ep_size": ep_size, "domain_size": domain_size, "timeout": seconds}, group,
                                device, "EPGroups")
        if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds (e.g. timeout=60), "
                              "or None to keep the process group's timeout")
        if ep_size < 1 or world % ep_size:
            raise ConfigError(f"ep_size={ep_size} must divide the group size {world}")
        if domain_size < 1 or ep_size % domain_size:
            hint = (f" (taken from {DOMAIN_SIZE_ENV})" if os.environ.get(DOMAIN_SIZE_ENV) else "")
            raise ConfigError(f"domain_size={domain_size}{hint} must divide ep_size={ep_size}; "
                              "set it to the number of ranks joined by the fast link")
        parent = dist.get_process_group_ranks(group)
        ep_lists = [parent[g * ep_size:(g + 1) * ep_size] for g in range(world // ep_size)]
        domain_lists = [ranks[d * domain_size:(d + 1) * domain_size]
                        for ranks in ep_lists for d in range(ep_size // domain_size)]
        rail_lists = [ranks[l::domain_size] for ranks in ep_lists for l in range(domain_size)]
        limit = None if seconds is None else datetime.timedelta(seconds=seconds)
        with guarded("creating the EP, domain and rail groups", "the process group"):
            ep_group = group if len(ep_lists) == 1 and limit is None else _subgroup(ep_lists, limit)
            domain_group = ep_group if domain_size == ep_size else _subgroup(domain_lists, limit)
            rail_group = ep_group if domain_size == 1 else _subgroup(rail_lists, limit)
            control_group = _subgroup(ep_lists, limit) if device.type == "cpu" else None
        ep_ranks = tuple(ep_lists[rank // ep_size])
        return cls(ep_group=ep_group, ep_size=ep_size, ep_rank=rank % ep_size, ep_ranks=ep_ranks,
                   domain_group=domain_group, domain_size=domain_size, rail_group=rail_group,
                   device=device, timeout=seconds, control_group=control_group)


# Every EPGroups of this process, weakly: `_release_at_exit` drops their process groups.
_built: "weakref.WeakSet[EPGroups]" = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Free the process groups EPGroups hold while the interpreter is still whole.

    An EPGroups on one EP group keeps the default group as its EP group, also after
    ``destroy_process_group()``; a gloo group freed during the interpreter's finalization
    aborts the process ("terminate called without an active exception", SIGABRT; measured: 2
    of 6 four-rank torchrun exits, 4 of 8 on an emulated 2x2 cluster, with the EPGroups in a
    module global). The collection frees groups held only by garbage cycles, such as a model's.
    """
    for groups in list(_built):
        groups.release("the process is exiting")
    gc.collect()


def _timeout_seconds(timeout) -> float | None:
    """``timeout`` as float seconds; NaN for a value that is not a number (so that every rank
    first agrees, then raises), None for None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    try:
        return float(timeout) if not isinstance(timeout, bool) else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _subgroup(rank_lists: list[list[int]], timeout=None):
    """This rank's group among disjoint ``rank_lists`` (every rank must call it)."""
    mine, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)
    return mine
