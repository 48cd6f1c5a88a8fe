"""Names shared by the torch-free command line and the torch parts."""

BACKEND_NAMES = ("allgather", "alltoall", "dedup", "hierarchical")
