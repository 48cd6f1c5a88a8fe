"""Cost model of dispatch and combine at cluster scale (NumPy only).

Traffic is counted exactly from a sampled routing (one representative rank's tokens, the
routing being the same distribution on every rank); time is, per stage, the slowest link's
bytes over its effective bandwidth plus a fixed stage latency. Effective bandwidth saturates
with the SMs a kernel uses: ``bw(sms) = peak x efficiency x (1 - exp(-sms / tau))``. The
constants and their calibration are in docs/cost-model.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..names import metadata_bytes  # noqa: F401  (the planner's name for it too)
from .catalog import Hardware, MoEModel

ALGORITHMS = ("allgather", "alltoall", "dedup", "hierarchical", "deepep-ll")
NCCL_ALGORITHMS = ("alltoall", "allgather")     # NCCL collectives (Megatron's alltoall and allgather dispatchers)

# Calibration (docs/cost-model.md): achievable fraction of the datasheet link bandwidth, the
# SM count at which a link is ~95% saturated, per-stage latency, FP8 dispatch byte-rate penalty.
NVLINK_EFFICIENCY = {"h800": 0.96}          # H800's catalog figure is already the achievable 160 GB/s
NVLINK_EFFICIENCY_DEFAULT = 0.55            # Hybrid-EP B200 EP8: 536 GB/s algorithm bandwidth at 16 SMs
NIC_EFFICIENCY = 0.90
SATURATING_SMS = {"hopper": {"nvlink": 8, "nic": 4}, "blackwell": {"nvlink": 16, "nic": 4}}
STAGE_LATENCY_S = {"normal": 15e-6, "deepep-ll": 5e-6, "nccl": 25e-6}
FP8_ROW_OVERHEAD_S = 3.7e-9                  # per FP8 row handled (scales, quantized layout): Hybrid-EP B200


@dataclass
class Routing:
    """How tokens pick experts: ``uniform``, ``zipf:<alpha>``, ``grouped`` (DeepSeek-V3 style:
    ``group_topk`` of ``num_groups`` expert groups, then top-k inside them) or a ``.npy``
    file of recorded ``topk_idx`` ([world, N, K] or [N, K])."""

    spec: str = "uniform"

    def sample(self, model: MoEModel, tokens: int, seed: int = 0) -> np.ndarray:
        if int(tokens) < 1:
            raise ConfigError(f"--tokens {tokens}: give a positive number of tokens per rank, e.g. --tokens 4096")
        rng = np.random.default_rng(seed)
        e, k = model.num_experts, model.topk
        if self.spec == "uniform":
            return _uniform_subsets(rng, tokens, e, k)
        if self.spec.startswith("zipf:"):
            try:
                alpha = float(self.spec.split(":", 1)[1])
            except ValueError:
                alpha = float("nan")
            if not np.isfinite(alpha) or alpha < 0:
                raise ConfigError(f"--routing {self.spec!r}: the Zipf exponent must be a number >= 0, e.g. zipf:1.2")
            scores = -alpha * np.log(np.arange(1, e + 1)) + rng.gumbel(size=(tokens, e))
        elif self.spec == "grouped":
            if not model.num_groups:
                raise ConfigError(f"--routing grouped needs a model with expert groups ({model.name} has none): "
                                  "use uniform or zipf:<alpha>")
            # As Megatron's group-limited top-k: a group scores the sum of its best k / group_topk
            # experts, the best group_topk groups are kept, and the top-k is taken inside them
            # (so a kept group almost always holds one of the k).
            g = model.num_groups
            scores = rng.random((tokens, e))
            best = np.sort(scores.reshape(tokens, g, e // g), axis=2)[:, :, -max(1, k // model.group_topk):]
            chosen = np.argpartition(-best.sum(axis=2), model.group_topk - 1, axis=1)[:, :model.group_topk]
            allowed = np.zeros((tokens, g), bool)
            np.put_along_axis(allowed, chosen, True, axis=1)
            scores = np.where(np.repeat(allowed, e // g, axis=1), scores, -1.0)
        else:
            return self.recorded(model)
        return np.argpartition(-scores, k - 1, axis=1)[:, :k]

    def recorded(self, model: MoEModel, every_rank: bool = False) -> np.ndarray:
        """Rank 0's ``topk_idx`` from a ``.npy`` file (every rank's tokens with ``every_rank``),
        checked against the model."""
        path = Path(self.spec)
        if path.suffix != ".npy" or not path.is_file():
            raise ConfigError(f"--routing {self.spec!r}: give uniform, zipf:<alpha>, grouped, or a .npy file of "
                              "topk_idx ([world, N, K] or [N, K])")
        try:
            idx = np.load(path)
        except Exception as err:
            raise ConfigError(f"--routing {self.spec!r}: cannot read it as .npy ({err})") from None
        if idx.ndim == 3:
            idx = idx.reshape(-1, idx.shape[-1]) if every_rank else idx[0]
        if idx.ndim != 2 or not idx.size or not np.issubdtype(idx.dtype, np.integer):
            raise ConfigError(f"--routing {self.spec!r}: expected integer topk_idx [N, K] or [world, N, K], got "
                              f"{idx.dtype} {list(idx.shape)}")
        if idx.max() >= model.num_experts or idx.min() < -1:
            raise ConfigError(f"--routing {self.spec!r}: expert ids {idx.min()}..{idx.max()} do not fit the "
                              f"{model.num_experts} experts of {model.name} (-1 marks a dropped slot)")
        return idx.astype(np.int64)


@dataclass
class EPLayout:
    ep: int
    domain: int

    @property
    def domains(self) -> int:
        return self.ep // self.domain


@dataclass
class Traffic:
    """Rows one rank sends per link class, and the busiest receiver's rows, per stage."""

    stages: list = field(default_factory=list)     # [{"link": "nvlink"|"nic"|"local", "send": rows, "recv": rows}]
    rows: dict = field(default_factory=dict)       # send rows per class: self / intra / inter
    logical_rows: int = 0                          # (token, destination rank) pairs, for algorithm bandwidth
    # (token, destination domain) pairs, the sender's own domain included: what DeepEP and
    # Hybrid-EP count as the bytes of their published internode ("RDMA") bandwidth.
    domain_rows: int = 0
    # Rows expertrail's engine passes through memory on one rank besides the exchanges: "copy",
    # dispatch's gathers before each hop and expansion into expert rows; "reduce", combine's
    # weighted sums of copies, one per hop (every rank routing alike, so a rank receives as
    # many rows as it sends).
    passes: dict = field(default_factory=dict)


def _rank_members(topk_idx: np.ndarray, local: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``topk_idx [T, K]`` (-1 = none) and ``local`` experts per rank: (pairs [P], the
    (token, expert) pairs each rank gets; member bool [T, P], whether a token has an expert on
    each rank)."""
    valid = topk_idx >= 0
    owner = np.where(valid, topk_idx // local, p)
    member = np.zeros((topk_idx.shape[0], p + 1), bool)
    np.put_along_axis(member, owner, True, axis=1)
    return np.bincount(owner[valid], minlength=p)[:p], member[:, :p]


def count_traffic(topk_idx: np.ndarray, model: MoEModel, layout: EPLayout, algorithm: str) -> Traffic:
    """Rows on each link for rank 0 sending ``topk_idx [T, K]`` (all ranks route alike)."""
    p, d = layout.ep, layout.domain
    t = topk_idx.shape[0]
    pairs, member = _rank_members(topk_idx, model.num_experts // p, p)
    in_domain = member.reshape(t, p // d, d).any(2)
    logical = int(member.sum())
    same = np.arange(p) < d                                       # rank 0's domain
    tr = Traffic(logical_rows=logical, domain_rows=int(in_domain.sum()))
    expert_rows = int(pairs.sum())                                # (token, expert) pairs: the expert rows
    if algorithm in ("alltoall", "deepep-ll", "dedup"):
        per_rank = pairs if algorithm != "dedup" else member.sum(0)
        tr.rows = {"self": int(per_rank[0]), "intra": int(per_rank[1:d].sum()), "inter": int(per_rank[~same].sum())}
        recv = int(per_rank.max()) * p                            # every sender alike: the hottest rank
        tr.stages = [{"link": "nvlink", "send": tr.rows["intra"], "recv": recv * (d - 1) // p},
                     {"link": "nic", "send": tr.rows["inter"], "recv": recv * (p - d) // p}]
        sent = int(per_rank.sum())
        # alltoall lands rows in place and weights them at the source; dedup expands on arrival
        # and pre-sums a token's experts before its row goes back.
        passes = sent if algorithm != "dedup" else sent + expert_rows
        tr.passes = {"copy": passes, "reduce": passes}
    elif algorithm == "hierarchical":
        remote_domains = int(in_domain[:, 1:].sum())
        # As rail peer in domain j, a rank forwards rows of p/d senders: to every rank of j
        # holding an expert of the token, except itself.
        per_domain = member.reshape(t, p // d, d)
        forwarded = (per_domain.sum(2, keepdims=True) - per_domain).sum(0)        # [domains, d]
        intra = int(forwarded.max()) * (p // d)
        tr.rows = {"self": int(in_domain[:, 0].sum()), "intra": intra, "inter": remote_domains}
        # The rail peer in domain j receives from the p/d - 1 senders of its rail in other domains.
        tr.stages = [{"link": "nic", "send": remote_domains, "recv": int(in_domain.sum(0).max()) * (p // d - 1)},
                     {"link": "nvlink", "send": intra, "recv": intra}]
        # Gathers for both hops and the expansion; in combine a sum on each of the three levels.
        passes = int(in_domain.sum()) + logical + expert_rows
        tr.passes = {"copy": passes, "reduce": passes}
    elif algorithm == "allgather":
        tr.rows = {"self": t, "intra": t * (d - 1), "inter": t * (p - d)}
        tr.stages = [{"link": "nvlink", "send": tr.rows["intra"], "recv": tr.rows["intra"]},
                     {"link": "nic", "send": tr.rows["inter"], "recv": tr.rows["inter"]}]
        # The padded send copy and the pick of local expert rows; combine sums into every
        # gathered row, then each token's p partial sums.
        tr.passes = {"copy": t + expert_rows, "reduce": expert_rows + p * t}
    else:
        raise ConfigError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    return tr


def rows_by_link(topk_idx_per_rank: list, num_experts: int, layout: EPLayout, algorithm: str) -> dict:
    """Rows every rank hands to collectives in one dispatch, summed over ranks, per link class
    (``self`` / ``intra`` / ``inter``), from every rank's own routing: the exact form of
    `count_traffic` (which samples one rank), as expertrail's engine sends them, so the bench
    can check one against the other.

    topk_idx_per_rank: P arrays [N_r, K] (-1 = none). Per algorithm, rows from source s to q:
    alltoall one per (token, expert on q); dedup one per (token, q holding one of its experts);
    allgather the most tokens of any rank (padded) to every q; hierarchical first one per
    (token, domain D holding one of its experts) to the rank of D with s's local index, then,
    from there, one per (row, rank of D holding an expert of the token).
    """
    p, d = layout.ep, layout.domain
    local = num_experts // p
    totals = {"self": 0, "intra": 0, "inter": 0}

    def add(src: int, dst: np.ndarray, rows: np.ndarray) -> None:
        same_domain = dst // d == src // d
        totals["self"] += int(rows[dst == src].sum())
        totals["intra"] += int(rows[same_domain & (dst != src)].sum())
        totals["inter"] += int(rows[~same_domain].sum())

    ranks = np.arange(p)
    for src, idx in enumerate(topk_idx_per_rank):
        pairs, member = _rank_members(np.asarray(idx), local, p)
        if algorithm in ("alltoall", "deepep-ll"):
            add(src, ranks, pairs)
        elif algorithm == "dedup":
            add(src, ranks, member.sum(0))
        elif algorithm == "allgather":          # the all-gather pads every rank to the most tokens
            add(src, ranks, np.full(p, max(np.shape(i)[0] for i in topk_idx_per_rank)))
        elif algorithm == "hierarchical":
            in_domain = member.reshape(-1, p // d, d).any(2)     # [N, domains]
            rail_peers = np.arange(p // d) * d + src % d
            add(src, rail_peers, in_domain.sum(0))
            for dom in range(p // d):                            # hop 2, from the rail peer in dom
                via = rail_peers[dom]
                rows = member[in_domain[:, dom]][:, dom * d:(dom + 1) * d].sum(0)
                add(via, np.arange(dom * d, (dom + 1) * d), rows)
        else:
            raise ConfigError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    return totals


def link_bandwidth(hw: Hardware, link: str, sms: int | None) -> float:
    """Effective bytes/s of one GPU's link with ``sms`` SMs driving it (None: NCCL, not SM-bound).
    A measured machine's figures are achieved bandwidths already."""
    if hw.measured:
        return (hw.nvlink_GBps if link == "nvlink" else hw.nic_GBps) * 1e9
    if link == "nvlink":
        peak = hw.nvlink_GBps * NVLINK_EFFICIENCY.get(hw.name, NVLINK_EFFICIENCY_DEFAULT)
    else:
        peak = hw.nic_GBps * NIC_EFFICIENCY
    if sms is None:
        return peak * 1e9
    sat = SATURATING_SMS.get(hw.arch, SATURATING_SMS["hopper"])[link]
    return peak * 1e9 * (1 - np.exp(-3.0 * sms / sat))


def row_bytes(model: MoEModel, precision: str, direction: str) -> int:
    """Bytes of one token row: BF16, or FP8 with one fp32 scale per 128 values (dispatch only;
    combine is BF16 as in DeepEP and Hybrid-EP), or FP32 (the CPU bench's other dtype)."""
    if precision == "fp8" and direction == "dispatch":
        return model.hidden + 4 * -(-model.hidden // 128)        # as expertrail.kernels.fp8.row_bytes
    return 4 * model.hidden if precision == "fp32" else 2 * model.hidden


def stage_latency(hw: Hardware, kind: str, link: str) -> float:
    """Fixed seconds of one exchange stage over ``link``: measured on a measured machine, else
    the kernel family's default (``STAGE_LATENCY_S``)."""
    measured = hw.nvlink_latency_us if link == "nvlink" else hw.nic_latency_us
    return measured * 1e-6 if measured is not None else STAGE_LATENCY_S[kind]


@dataclass
class Prediction:
    algorithm: str
    dispatch_s: float
    combine_s: float
    rows: dict
    bytes: dict
    bottleneck: str
    algo_bandwidth_GBps: float
    sms: int | None
    # With several domains: the internode bandwidth as DeepEP and Hybrid-EP publish it, per
    # direction: (token, destination domain) rows, the sender's own domain included, x row
    # bytes / time (docs/cost-model.md, "Across domains"). None inside one domain.
    slow_link_GBps: dict | None = None


def predict(hw: Hardware, model: MoEModel, layout: EPLayout, algorithm: str, topk_idx: np.ndarray,
            sms: int | None = None, precision: str = "bf16", pipelined: bool | int = True,
            engine: bool = False) -> Prediction:
    """Predicted dispatch and combine time of ``algorithm`` for rank 0's ``topk_idx``.

    pipelined: how the stages of a two-level route overlap. True: they stream (DeepEP's and
    Hybrid-EP's kernels move fine-grained chunks from the NIC stage into the NVLink stage), the
    slowest link sets the time; False: one after the other; an int n: each block crosses the
    slow link in n pieces, each forwarded as it lands (expertrail's hierarchical route with
    ``pipeline_chunks=n``), so the slowest link's time plus 1/n of the others' (`piped`).
    engine: predict expertrail's own engine rather than DeepEP's or Hybrid-EP's kernels:
    dispatch rows carry its metadata (`metadata_bytes`), and on a machine with measured local
    pass figures (``Hardware.local_copy_GBps``, ``local_reduce_GBps``) its local passes
    (`Traffic.passes`: dispatch's copies, combine's sums) add their time."""
    if layout.ep < 1 or layout.domain < 1 or model.num_experts % layout.ep or layout.ep % layout.domain:
        raise ConfigError(f"EP {layout.ep} must divide {model.num_experts} experts and be a multiple of the "
                          f"domain size {layout.domain}")
    tr = count_traffic(topk_idx, model, layout, algorithm)
    kind = "deepep-ll" if algorithm == "deepep-ll" else ("nccl" if algorithm in NCCL_ALGORITHMS else "normal")
    driving = None if kind == "nccl" else sms

    def phase(direction):
        size = row_bytes(model, precision, direction)
        if engine and direction == "dispatch":
            size += metadata_bytes(algorithm, model.topk)
        times, rows = {}, 0
        for st in tr.stages:
            busiest = max(st["send"], st["recv"])
            if busiest == 0:
                continue
            rows = max(rows, busiest)
            times[st["link"]] = times.get(st["link"], 0.0) + busiest * size / link_bandwidth(hw, st["link"], driving)
        if not times:
            return 0.0, "none"
        # Links work concurrently (pipelined chunks on the two-level path); each stage adds latency.
        overhead = rows * FP8_ROW_OVERHEAD_S if size < 2 * model.hidden else 0.0
        transfer = piped(list(times.values()), pipelined)
        return transfer + overhead + local_passes(direction) + sum(stage_latency(hw, kind, link) for link in times), \
            max(times, key=times.get)

    def local_passes(direction):
        pass_bandwidth = hw.local_copy_GBps if direction == "dispatch" else hw.local_reduce_GBps
        if not engine or not pass_bandwidth:
            return 0.0
        rows = tr.passes["copy" if direction == "dispatch" else "reduce"]
        return rows * row_bytes(model, precision, direction) / (pass_bandwidth * 1e9)

    dispatch, bottleneck = phase("dispatch")
    combine, _ = phase("combine")
    logical = tr.logical_rows * 2 * model.hidden
    slow_link = None
    if layout.domains > 1 and dispatch > 0:
        slow_link = {d: tr.domain_rows * row_bytes(model, precision, d) / t / 1e9
                     for d, t in (("dispatch", dispatch), ("combine", combine))}
    return Prediction(algorithm, dispatch, combine, tr.rows,
                      {k: v * row_bytes(model, precision, "dispatch") for k, v in tr.rows.items()},
                      bottleneck, logical / dispatch / 1e9 if dispatch > 0 else 0.0, sms, slow_link)


def piped(stage_times: list, pipelined: bool | int) -> float:
    """Time of stages that run as a pipeline of ``pipelined`` pieces (True: infinitely many,
    the slowest stage's time; False: one, their sum): the slowest stage plus one piece of each
    other, the pipeline's fill and drain."""
    if not stage_times:
        return 0.0
    slowest = max(stage_times)
    pieces = float("inf") if pipelined is True else 1 if pipelined is False else max(1, int(pipelined))
    return slowest + (sum(stage_times) - slowest) / pieces


def _uniform_subsets(rng: np.random.Generator, n: int, e: int, k: int) -> np.ndarray:
    """int64 [n, k]: for each of n tokens k distinct experts of e, every k-subset equally likely
    (Floyd's algorithm, vectorized over tokens: O(n k^2), no [n, e] score matrix, so EP 4096
    with thousands of experts samples in milliseconds)."""
    chosen = np.empty((n, k), dtype=np.int64)
    for i, j in enumerate(range(e - k, e)):
        pick = rng.integers(0, j + 1, size=n)
        taken = (chosen[:, :i] == pick[:, None]).any(axis=1)
        chosen[:, i] = np.where(taken, j, pick)
    return chosen
