"""Facts shared by the torch-free planner and command line and the torch engine: the
backends' names, and the metadata bytes each sends beside a row (`metadata_bytes`), so that
neither side imports the other.

The library and the planner name a dispatch by its traffic pattern (`alltoall`, `dedup`,
`hierarchical`, `allgather`); Megatron-Core and the field name the kernels that implement
those patterns (DeepEP, HybridEP). `FIELD_NAMES` and `field_name` give the mapping, so the
planner can print both names (``hierarchical (hybridep)``) and say what it means.
"""

BACKEND_NAMES = ("allgather", "alltoall", "dedup", "hierarchical")


def metadata_bytes(algorithm: str, topk: int) -> int:
    """Bytes of int64 metadata expertrail's engine sends beside each dispatched row: alltoall a
    row's k and weight; dedup and allgather the token's K expert ids and K weights;
    hierarchical (both hops) its source rank and token, K ids and K weights. The backends take
    their ``AllToAllHop.meta_bytes`` from here and the planner counts with it, so both agree."""
    per_row = {"alltoall": 2, "dedup": 2 * topk, "allgather": 2 * topk, "hierarchical": 2 + 2 * topk}
    return 8 * per_row.get(algorithm, 0)

# Algorithm (library / planner name) -> what implements the same traffic in the field.
FIELD_NAMES = {
    "allgather": "Megatron's allgather dispatcher (NCCL all-gather of every token)",
    "alltoall": "Megatron's alltoall dispatcher (NCCL all-to-all, one row per (token, expert))",
    "dedup": "DeepEP normal kernels, intranode (one row per (token, destination rank)); across NVLink domains "
             "no field counterpart (DeepEP goes two-level there)",
    "hierarchical": "DeepEP internode normal kernels on 8-GPU NVLink nodes, HybridEP on NVL36/NVL72 racks "
                    "(one row per (token, remote domain) on the NIC, then NVLink)",
    "deepep-ll": "DeepEP low-latency mode (one row per (token, expert), inference decoding); "
                 "model only, not an expertrail backend",
}


def default_flex_backend(domain_size: int) -> str:
    """Megatron's flex-dispatcher backend for hardware whose NVLink domain joins ``domain_size``
    GPUs: HybridEP on NVL36 / NVL72 racks, DeepEP on 8-GPU nodes."""
    return "hybridep" if domain_size > 8 else "deepep"


def field_name(algorithm: str, domain_size: int = 8, ep: int | None = None) -> str:
    """The short field name of ``algorithm`` on hardware whose NVLink domain joins
    ``domain_size`` GPUs: what ``expertrail plan`` would configure in Megatron-Core. Given
    ``ep``, a one-level ``dedup`` that spans domains has no field counterpart (DeepEP switches to
    its two-level internode kernels there) and keeps its own name."""
    if algorithm == "hierarchical":
        return default_flex_backend(domain_size)
    if algorithm == "dedup" and ep is not None and ep > domain_size:
        return "dedup"
    return {"dedup": "deepep", "deepep-ll": "deepep low-latency"}.get(algorithm, algorithm)


def both_names(algorithm: str, domain_size: int = 8, ep: int | None = None) -> str:
    """``hierarchical (hybridep)``; a name the field shares is printed once (``alltoall``)."""
    other = field_name(algorithm, domain_size, ep)
    return algorithm if other == algorithm else f"{algorithm} ({other})"


NAMES_HELP = """\
names: the library and the planner name an algorithm by its traffic; Megatron-Core names the kernels
  alltoall      = Megatron alltoall dispatcher (NCCL): one row per (token, expert)
  allgather     = Megatron allgather dispatcher (NCCL): every token to every rank
  dedup         = DeepEP normal kernels, intranode (flex + deepep): one row per (token, rank);
                  across NVLink domains it has no field counterpart and keeps its own name
  hierarchical  = DeepEP internode kernels on 8-GPU nodes (flex + deepep), HybridEP on NVL36/NVL72
                  racks (flex + hybridep): one row per (token, remote domain) on the NIC, then NVLink
  deepep-ll     = DeepEP low-latency mode (simulate only; inference decoding, not a library backend)"""
