"""alltoall's index helpers on one process: the received -> expert-major order, the landing
pieces (by simulating the exchange of every rank), and the copies of the sent pairs."""
import pytest
import torch

from expertrail.dispatch.alltoall import expert_major_order, landing_pieces, pair_copies


def _counts(p, local, seed, zero_some=True):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (p, p, local), generator=g)          # [source, destination, expert]
    if zero_some:
        counts[0] = 0                                                  # a rank that sends nothing
    return counts


@pytest.mark.parametrize("p,local,seed", [(1, 1, 0), (2, 3, 1), (4, 2, 2), (3, 5, 3)])
def test_expert_major_order_lists_received_rows_by_expert_then_source(p, local, seed):
    recv_counts = _counts(p, local, seed)[:, 0]                        # what rank 0 receives [P, E_local]
    received = [(s, e, i) for s in range(p) for e in range(local) for i in range(int(recv_counts[s, e]))]
    expected = sorted(range(len(received)), key=lambda j: (received[j][1], received[j][0], received[j][2]))
    assert expert_major_order(recv_counts, int(recv_counts.sum())).tolist() == expected


@pytest.mark.parametrize("p,local,seed", [(1, 1, 0), (2, 3, 1), (4, 2, 2), (3, 5, 3)])
def test_landing_pieces_put_every_run_in_its_expert_major_place(p, local, seed):
    """Every rank sends its pieces; matching piece j to peer q with piece j from us on q lands
    the rows expert-major, by source within an expert, with each expert's padding after."""
    counts = _counts(p, local, seed)
    padding = torch.randint(0, 3, (p, local), generator=torch.Generator().manual_seed(seed))
    layouts, sent = [], []
    for r in range(p):
        layout = landing_pieces(counts[r], counts[:, r], padding[r])
        layouts.append(layout)
        labels = [(r, q, e, i) for q in range(p) for e in range(local) for i in range(int(counts[r, q, e]))]
        sent.append(labels)
    for r in range(p):
        pieces_in = [[None] * size for size in layouts[r]["recv_sizes"]]
        for q in range(p):                                             # what q sends r
            out_pieces, starts, at = layouts[q]["send_sizes"], [], 0
            for size in out_pieces:
                starts.append(at)
                at += size
            for a, b in zip(layouts[q]["send"][r], layouts[r]["recv"][q]):
                assert out_pieces[a] == len(pieces_in[b])
                pieces_in[b] = sent[q][starts[a]:starts[a] + out_pieces[a]]
        landed = [row for piece in pieces_in for row in piece]
        expected = []
        for e in range(local):
            expected += [(s, r, e, i) for s in range(p) for i in range(int(counts[s, r, e]))]
            expected += [None] * int(padding[r, e])
        assert landed == expected


def test_pair_copies_find_each_tokens_k_th_copy():
    pairs = torch.tensor([5, 0, 3, 1, 4])                              # n * K + k with K = 2, token 1 k 0 dropped
    copies = pair_copies(pairs, 3, 2)
    assert copies.dense().tolist() == [[1, 3], [-1, 2], [4, 0]]
    assert pair_copies(pairs[:0], 3, 0) is None
