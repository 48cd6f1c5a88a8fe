"""`expertrail balance`: balancedness before and after replicating hot experts (torch-free;
the work is `balance.report`)."""
from __future__ import annotations

from ..arguments import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("balance", help="balancedness before and after replicating hot experts",
                       description="Plans replicas and placement for measured (--load) or Zipf expert loads and "
                                   "prints balancedness (mean / max tokens per rank) for contiguous placement and "
                                   "each policy. Torch-free.")
    p.add_argument("--load", help="token counts [layers, experts] in .npy, .csv or .json")
    p.add_argument("--zipf", type=float, help="Zipf exponent of synthetic loads")
    p.add_argument("--experts", type=positive_int(64))
    p.add_argument("--layers", type=positive_int(1), default=1)
    p.add_argument("--ranks", type=positive_int(8), required=True)
    p.add_argument("--redundant", type=int, default=0, help="extra physical slots for replicas")
    p.add_argument("--domains", type=positive_int(2), default=1)
    p.add_argument("--groups", type=positive_int(8), default=None, help="expert groups for the hierarchical policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PATH.png")


def run(args) -> int:
    from ...balance.report import run as report
    return report(args)
