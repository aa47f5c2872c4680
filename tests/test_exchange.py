"""The exchange (dcp_datastates/exchange): its pure plans, and its transfers between gloo ranks
(tests/support/exchange_workers.py): read-once rounds, whole files from rank to rank with
their checks, a peer that dies mid-transfer. Read-once DCP loads: tests/test_read_once.py."""

from __future__ import annotations

import ast
import json
import os
import pathlib
from collections import defaultdict

import numpy as np
import pytest

from dcp_datastates.exchange.plan import chain, ops_of, pack, plan_reads

HERE = os.path.dirname(__file__)
PACKAGE = pathlib.Path(HERE).parent / "dcp_datastates"


def _cases():
    import exchange_workers

    return exchange_workers.CASES


def _reports(out) -> list[dict]:
    return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out), key=lambda n: int(n[4:-5]))]


# -- plans ------------------------------------------------------------------------------


def test_pack_splits_large_pieces_joins_small_ones_and_round_robins_the_routes():
    msgs = pack([((0, 1), [(0, 10), (1, 3), (2, 25)]), ((2, 0), [(3, 4)])], chunk_bytes=8)
    assert [(m.route, m.nbytes) for m in msgs] == [((0, 1), 8), ((2, 0), 4), ((0, 1), 8), ((0, 1), 8),
                                                  ((0, 1), 8), ((0, 1), 6)]
    pieces = defaultdict(int)
    for m in msgs:
        assert m.nbytes == sum(s.nbytes for s in m.segments) <= 8
        for s in m.segments:
            assert s.at == pieces[s.piece]  # each piece in order, no byte twice
            pieces[s.piece] += s.nbytes
    assert dict(pieces) == {0: 10, 1: 3, 2: 25, 3: 4}
    with pytest.raises(ValueError, match="chunk_bytes"):
        pack([], 0)


def test_every_send_meets_its_receive_in_order_and_forwards_follow_their_receives():
    rng = np.random.default_rng(3)
    routes = []
    for _ in range(30):
        ranks = [int(r) for r in rng.permutation(6)[: int(rng.integers(2, 6))]]
        routes.append((tuple(ranks), [(len(routes), int(rng.integers(1, 40)))]))
    msgs = pack(routes, chunk_bytes=16)
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank in range(6):
        ops = ops_of(msgs, rank)
        for i, op in enumerate(ops):
            (sends[(rank, op.peer)] if op.send else recvs[(op.peer, rank)]).append((op.message.index, op.hop))
            if op.send and op.hop > 0:
                got = ops[op.after]
                assert not got.send and got.message is op.message and got.hop == op.hop - 1 and op.after < i
    assert sends == recvs  # between each pair, the same messages in the same order


def test_chains_cross_each_node_boundary_once():
    nodes = [0, 0, 1, 1, 2, 2]
    assert chain(3, [0, 1, 2, 4, 5], nodes) == (3, 2, 0, 1, 4, 5)
    assert chain(1, [5, 0], None) == (1, 0, 5)


def _needs(reads_by_rank):
    out = []
    for reads in reads_by_rank:
        names = sorted({k for k, _o, _n in reads})
        out.append((names, np.array([names.index(k) for k, _o, _n in reads], np.int32),
                    np.array([o for _k, o, _n in reads], np.int64), np.array([n for _k, _o, n in reads], np.int64)))
    return out


def _reader_loads(plan):
    """How many bytes each rank reads from storage under ``plan``."""
    reads = defaultdict(int)
    for p in plan.pieces:
        reads[p.reader] += p.nbytes
    return reads


@pytest.mark.parametrize("seed", range(6))
def test_read_plans_cover_every_read_once_with_balanced_readers(seed):
    rng = np.random.default_rng(seed)
    world = 4
    reads = []
    for r in range(world):
        mine = [("a", 0, 4096 * 64)] if seed % 2 == 0 else []  # replicated
        mine += [("b", 4096 * int(rng.integers(0, 50)), 4096 * int(rng.integers(1, 20))) for _ in range(5)]
        reads.append(mine)
    plan = plan_reads(_needs(reads), chunk_bytes=4096 * 3)
    # every byte every read wants lies in exactly one piece that one of its rows is
    for r, mine in enumerate(reads):
        for i, (key, off, n) in enumerate(mine):
            row = next(int(x) for x in plan.rows_of(r) if plan.row_read[x] == i)
            got = sorted((p.start, p.end) for p in plan.pieces if row in p.rows)
            assert got[0][0] == off and got[-1][1] == off + n and all(a[1] == b[0] for a, b in zip(got, got[1:]))
            assert all(plan.keys[p.key] == key for p in plan.pieces if row in p.rows)
    # storage reads: the union of the reads, once
    union = {k: set() for k in "ab"}
    for mine in reads:
        for k, o, n in mine:
            union[k].update(range(o // 4096, (o + n) // 4096))
    assert sum(p.nbytes for p in plan.pieces) == 4096 * sum(len(v) for v in union.values())
    load = _reader_loads(plan)
    if seed % 2 == 0:  # the replicated range is shared out
        assert max(load.values()) < 2.5 * min(load.values())
    # each message carries pieces to ranks that need them, along their route
    for m in plan.messages:
        for seg in m.segments:
            p = plan.pieces[seg.piece]
            wanted = {int(plan.row_rank[x]) for x in p.rows}
            assert set(m.route[1:]) == wanted - {p.reader} and m.route[0] == p.reader


def test_read_plans_prefer_the_node_that_holds_a_file_and_say_when_nobody_can():
    reads = [[], [], [("f", 0, 100)], [("f", 0, 100), ("g", 0, 10)]]  # ranks 2, 3 on node 1 want f, g
    nodes = [0, 0, 1, 1]

    def access(rank, key):
        return {("f", 0): 0, ("f", 1): 0, ("f", 2): None, ("f", 3): None}.get((key, rank), None if key == "g" else 1)

    plan = plan_reads(_needs(reads), chunk_bytes=64, access=access, nodes=nodes)
    f = next(p for p in plan.pieces if plan.keys[p.key] == "f")
    assert f.reader in (0, 1) and next(m for m in plan.messages).route[1:] == (2, 3)  # one hop into node 1
    g = next(p for p in plan.pieces if plan.keys[p.key] == "g")
    assert g.reader is None and not any(s.piece == plan.pieces.index(g) for m in plan.messages for s in m.segments)


def test_the_package_opens_no_socket_of_its_own():
    """Bytes between ranks go over torch.distributed: no module binds, listens or connects.
    (The node key reads the host name; nothing else of ``socket`` is used.)"""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        uses = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "socket"}
        imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "socket" for a in n.names}
        assert uses <= {"gethostname"} and not imports, f"{path}: socket.{sorted(uses | imports)}"
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert not calls & {"bind", "listen", "accept", "create_server", "create_connection"}, f"{path}: {calls}"


# -- transfers between ranks --------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.subprocess
@pytest.mark.slow
def test_read_rounds_of_unequal_counts_deliver_every_read_bit_exact(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    (root / "f.data").write_bytes(os.urandom(4096 * 256))
    out = tmp_path / "out"
    out.mkdir()
    _cases().run_ranks("read_rounds", 4, tmp_path / "logs", root=str(root), out=str(out))
    got = _reports(out)
    assert [g["rounds"] for g in got] == [4] * 4  # every rank took part in the longest run of rounds
    assert sum(g["received"] for g in got) > 0
    assert sum(g["read"] for g in got[1:]) > 0  # rank 0's whole-file read was shared out


@pytest.mark.dist
@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["ok", pytest.param("damage", marks=pytest.mark.slow), pytest.param("flip", marks=pytest.mark.slow)])
def test_files_copied_between_ranks_are_checked_on_both_ends(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    _cases().run_ranks("copy_files", 4, tmp_path / "logs", root=str(tmp_path), out=str(out), mode=mode)
    outcomes = _reports(out)[0]["outcomes"]
    assert all(o == outcomes for o in (r["outcomes"] for r in _reports(out)))  # every rank learns every outcome
    failed = {(src, dst, name): error for src, dst, name, error in outcomes if error is not None}
    if mode == "ok":
        assert not failed
    elif mode == "damage":  # rank 3's data file is damaged on its disk: refused where it is read
        ((key, error),) = failed.items()
        assert key[0] == 3 and key[2].startswith("rank00003-") and key[2].endswith(".data")
        assert "reading it on rank 3" in error and "checksum mismatch" in error and key[2] in error
    else:  # a message rank 2 sent was damaged on the way: refused where it arrived, named
        assert failed and all(src == 2 and dst == 3 for src, dst, _n in failed)
        assert any("writing it on rank 3" in e and ("corrupt" in e or "checksum mismatch" in e) for e in failed.values())


@pytest.mark.dist
@pytest.mark.subprocess
def test_a_peer_that_dies_mid_transfer_fails_it_on_the_other_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _cases().run_ranks("peer_dies", 2, tmp_path / "logs", root=str(tmp_path), out=str(out), timeout_s=5.0)
    (got,) = _reports(out)  # rank 1 died
    assert got["seconds"] < 5.0 + 10, got
    assert "rank 1" in got["error"] and "exchange_timeout_s" in got["error"] and got["broken"]
    assert not (tmp_path / "dst" / "big").exists()  # only its temporary, never the file
