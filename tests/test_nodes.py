"""Node-local roots across simulated nodes: one torchrun launcher per node on 127.0.0.1 (gloo),
each node with its own tmpfs as its local root, the partner level and the durable tier.

The pure planning (which step every node can reach, where each file is read) is tested
directly; the rest runs tests/support/node_worker.py under ``torchrun --nnodes=K --node-rank=i``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
from conftest import mounted_tmpfs
from dist_helpers import free_port
from node_launch import launch_nodes, wipe

from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_envelope import CommitStamp
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.manager.node_copies import homes, restore_copies
from dcp_datastates.manager.checkpoint_root import ResumeOrder
from dcp_datastates.manager.nodes import DURABLE, OWN, PARTNER, NodeMap, NodeReport, StepCopy, plan_node_load
from dcp_datastates.manager.resume import Listing, plan_node_resume

WORKER = os.path.join(os.path.dirname(__file__), "support", "node_worker.py")


# -- planning, without processes --------------------------------------------------------


def test_node_map_groups_ranks_by_node_key_and_rings_partners():
    nodes = NodeMap.of_keys(["b", "b", "a", "a", "c", "c"], rank=3)
    assert nodes.members == ((0, 1), (2, 3), (4, 5))
    assert (nodes.node, nodes.is_leader, nodes.leader(1)) == (1, False, 2)
    assert [nodes.partner(n) for n in range(3)] == [1, 2, 0]
    assert NodeMap.single(4, 0).partner(0) is None


def _copy(seq: int, ranks: dict, held=None) -> StepCopy:
    layout = {r: RankFiles(r, f"rank{r:05d}-{seq:012x}.data", f"rank{r:05d}-{seq:012x}.index") for r in ranks}
    files = {n: 1 for r in (held if held is not None else ranks) for n in layout[r].file_names()}
    files[METADATA_FILE] = 1
    return StepCopy(CommitStamp(seq, 0, 1), files, layout)


def test_plan_takes_the_newest_step_every_file_of_which_someone_holds():
    ranks = {0: None, 1: None}
    # step 30: node 1 lost its root, nobody holds rank 1's files; step 20: node 1's files are
    # in node 0's partner copy; step 10 everywhere.
    reports = [
        NodeReport(0, {10: _copy(1, ranks, [0]), 20: _copy(2, ranks, [0]), 30: _copy(3, ranks, [0])},
                   {20: _copy(2, ranks, [1])}, set()),
        NodeReport(1, {10: _copy(1, ranks, [1])}, {}, set()),
    ]
    plan = plan_node_load(reports, durable=[], given_up=[], step=None)
    assert plan.candidates == [20, 10]
    assert plan.missing[30] == ["rank00001-000000000003.data", "rank00001-000000000003.index"]
    src = plan.sources(20, node=1)
    assert src["rank00001-000000000002.data"] == (0, PARTNER)
    assert src["rank00000-000000000002.data"] == (0, OWN)
    # node 1 lost step 20: it gets rank 1's files back from node 0's partner copy, its .metadata last
    restore = restore_copies(plan, 20, reports, NodeMap(((0,), (1,)), 0))
    assert restore.restored == {1: ["rank00001-000000000002.data", "rank00001-000000000002.index", METADATA_FILE]}
    assert [(c.src, c.dst, c.tag, c.hold) for c in restore.copies] == [(0, 1, PARTNER, False)] * 2 + [(0, 1, OWN, True)]
    # relaunched with 2 ranks per node (ranks 0-1 on node 0, 2-3 on node 1): saved rank 1 is still node 1's
    restore = restore_copies(plan, 20, reports, NodeMap(((0, 1), (2, 3)), 2))
    assert restore.restored[1][:2] == ["rank00001-000000000002.data", "rank00001-000000000002.index"]
    assert {c.dst for c in restore.copies} == {2}
    # with the durable tier holding this very save of step 30, it is reachable: node 1's files come from there
    plan = plan_node_load(reports, durable=[30], given_up=[], step=None, durable_stamps={30: CommitStamp(3, 0, 1)})
    assert plan.candidates[0] == 30 and plan.sources(30, 1)["rank00001-000000000003.data"] == DURABLE
    # another save of step 30 there (an earlier one, before a rollback): its files are not these
    plan = plan_node_load(reports, durable=[30], given_up=[], step=None, durable_stamps={30: CommitStamp(2, 7, 1)})
    assert plan.candidates == [20, 10]
    # a step only the durable tier holds: a candidate, read there as a whole (no node's sources)
    plan = plan_node_load(reports, durable=[40], given_up=[], step=None, durable_stamps={})
    assert plan.candidates[0] == 40 and 40 not in plan.copies and plan.newest_known == 40
    # a step a node's pointer gave up is never resumed; an explicit step is the only candidate
    reports[0].abandoned = {20}
    assert plan_node_load(reports, [], [], None).candidates == [10]
    assert plan_node_load(reports, [], [], 10).candidates == [10]


def test_plan_of_a_step_saved_twice_keeps_the_newest_save():
    ranks = {0: None, 1: None}
    reports = [NodeReport(0, {5: _copy(9, ranks, [0])}, {}, set()), NodeReport(1, {5: _copy(4, ranks, [1])}, {}, set())]
    plan = plan_node_load(reports, [], [], None)
    # node 1 holds an older save of step 5: its files are not the newest save's, so 5 is unreachable
    assert plan.candidates == [] and 5 in plan.missing


def test_the_node_load_plan_is_the_load_plan_with_what_the_nodes_report():
    ranks = {0: None, 1: None}
    reports = [
        NodeReport(0, {10: _copy(1, ranks, [0]), 30: _copy(3, ranks, [0])}, {}, set(), {20: "ValueError: bad trailer"}),
        NodeReport(1, {10: _copy(1, ranks, [1])}, {}, set()),
    ]
    listing = Listing(ResumeOrder([30, 10], [], None, None), uncommitted=[40])
    nodes = plan_node_load(reports, [], [], None)
    plan = plan_node_resume(listing, nodes, reports, None, "/run", None)
    # the nodes' candidates, not rank 0's listing (which offered 30): no node holds rank 1's files of 30
    assert plan.candidates == [10] and plan.local == {10} and plan.newest_known == 30 and plan.error is None
    assert plan.warnings == [
        "skipping /run/step_00000040: it was never committed (an interrupted or failed save)",
        "skipping step 30: no node holds rank00001-000000000003.data, rank00001-000000000003.index (a node lost its root)",
        "node 0: the checkpoint of step 20 cannot be read (ValueError: bad trailer)",
    ]
    # an explicit step no node holds whole: the error names the files, and the durable tier checked too
    plan = plan_node_resume(listing, plan_node_load(reports, [], [], 30), reports, 30, "/run", "s3://b/run")
    assert plan.candidates == [] and "no node holds rank00001-000000000003.data" in str(plan.error)
    assert "(nor does s3://b/run)" in str(plan.error)
    # the durable tier did not answer and no node holds anything: raised, not a fresh start
    listing = Listing(ResumeOrder([], [], None, None), uncommitted=[], tier_error="timed out")
    plan = plan_node_resume(listing, plan_node_load([], [], [], None), [], None, "/run", "s3://b/run")
    assert plan.candidates == [] and "did not answer (timed out)" in str(plan.error)


# -- simulated nodes --------------------------------------------------------------------


@pytest.fixture
def node_roots(tmp_path):
    """Two nodes' local roots: a tmpfs each, mounted for the test."""
    with contextlib.ExitStack() as stack:
        yield [str(stack.enter_context(mounted_tmpfs(tmp_path / f"node{i}", "size=64m"))) for i in range(2)]


def run_nodes(roots: list[str], phase: str, steps: str, settings: dict | None = None, nproc: int = 1,
              expect_killed: bool = False, env: dict | None = None, grace_s: float = 1.0) -> list[str]:
    """The worker's ``phase`` on every node (tests/support/node_launch.py); every node must exit 0
    unless ``expect_killed`` (a node kills itself: then every rank is stopped). No rank's Python
    code may bind, listen on or connect a socket (the worker's audit hook says each): the bytes
    between nodes go over torch.distributed."""
    _wall, codes, outs = launch_nodes(roots, nproc, [WORKER, phase, steps, json.dumps(settings or {})], env=env,
                                      until_killed=expect_killed, grace_s=grace_s)
    if not expect_killed:
        for i, (code, out) in enumerate(zip(codes, outs)):
            assert code == 0, f"node {i} exited {code}:\n{out[-4000:]}"
    sockets = [line for out in outs for line in out.splitlines() if line.startswith("SOCKET ")]
    assert not sockets, sockets
    return outs


def logged(outs: list[str], text: str) -> list[str]:
    return [line for out in outs for line in out.splitlines() if line.startswith("LOG ") and text in line]


def resumed(outs: list[str]) -> set:
    return {line.split()[1] for out in outs for line in out.splitlines() if line.startswith("RESUMED ")}


def steps_in(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_") and os.path.exists(os.path.join(root, n, METADATA_FILE)))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
def test_a_wiped_node_resumes_from_its_partner(node_roots, nproc=2):
    settings = {"partner": True, "keep_last": 2, "partner_keep_last": 2}
    outs = run_nodes(node_roots, "save", "10,20,30", settings, nproc=nproc)
    # the copies and their retention are logged in the partner level's words, never the durable tier's
    lines = [line for out in outs for line in out.splitlines() if line.startswith("LOG ")]
    for node, root in enumerate(node_roots):
        partner = (node + 1) % 2
        for step in (10, 20, 30):
            said = logged(outs, f"step {step}: node {node}'s files copied to node {partner}'s .partner folder (")
            assert len(said) == nproc, said  # each of its ranks
            said = logged(outs, f"step {step}: the partner copy of node {node}'s files is committed in ")
            where = os.path.join(node_roots[partner], ".partner", f"step_{step:08d}")
            assert [line.rsplit(" ", 1)[1] for line in said] == [where], said
        assert f"LOG dcp_datastates.manager.partner_tier partner retention: deleted step 10 from " \
               f"{os.path.join(root, '.partner')}" in lines
    assert all(line.split()[1] != "dcp_datastates.manager.durable_tier" and "durable" not in line for line in lines)
    # every node committed every kept step; each holds the other's files as a partner copy
    for root in node_roots:
        assert steps_in(root) == ["step_00000020", "step_00000030"]
        assert steps_in(os.path.join(root, ".partner")) == ["step_00000020", "step_00000030"]
        own = set(os.listdir(os.path.join(root, "step_00000030")))
        assert not own & set(os.listdir(os.path.join(root, ".partner", "step_00000030"))) - {METADATA_FILE}
    wipe(node_roots[1])
    outs = run_nodes(node_roots, "resume", "40", settings, nproc=nproc)
    assert resumed(outs) == {"30"}
    assert steps_in(node_roots[1]) == ["step_00000030", "step_00000040"]  # copied back, then saved on


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
def test_a_wiped_node_gets_its_files_back_whatever_the_ranks_per_node_of_the_relaunch(node_roots):
    settings = {"partner": True, "keep_last": 2, "partner_keep_last": 2, "exchange_timeout_s": 60}
    run_nodes(node_roots, "save", "2,4,6", settings, nproc=1)
    # 1 rank per node, then 2 (saved ranks 0 | 1, then ranks 0-1 | 2-3); then back to 1
    for step, saved, before, after in ((6, "8", 1, 2), (8, "10", 2, 1)):
        wipe(node_roots[1])
        outs = run_nodes(node_roots, "resume", saved, settings, nproc=after)
        assert resumed(outs) == {str(step)}
        # node 1's own files of the step came back from node 0's partner copy, committed; it saved on
        assert steps_in(node_roots[1]) == [f"step_{step:08d}", f"step_{int(saved):08d}"]
        back = {n.split("-")[0] for n in os.listdir(os.path.join(node_roots[1], f"step_{step:08d}"))} - {METADATA_FILE}
        assert back == {f"rank{r:05d}" for r in range(before, 2 * before)}, back  # its saved ranks' files
        copied = {n.split("-")[0] for n in os.listdir(os.path.join(node_roots[0], ".partner", f"step_{int(saved):08d}"))}
        assert copied - {METADATA_FILE} == {f"rank{r:05d}" for r in range(after, 2 * after)}, copied
        said = logged(outs, "node 1: copied back its")
        assert len(said) == 1 and f"step {step}" in said[0] and "from node 0 (partner copy)" in said[0], said


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
def test_a_node_killed_during_a_partner_copy_leaves_nothing_half_and_the_copy_is_made_at_restart(node_roots):
    settings = {"partner": True, "keep_last": 3, "partner_keep_last": 3, "exchange_timeout_s": 5}
    run_nodes(node_roots, "save", "10", settings)
    outs = run_nodes(node_roots, "save-kill-copy", "20", settings, expect_killed=True, grace_s=10)
    node0 = outs[0]
    assert "TRAINED ON rank 0" in node0, node0[-3000:]
    failed = [line for line in node0.splitlines() if line.startswith("COPY ")]
    assert failed and failed[0].startswith("COPY FAILED DrainError") and "step 20" in failed[0], node0[-3000:]
    # nothing of the interrupted copy is committed on node 0 (node 1's files of step 20)
    assert not os.path.exists(os.path.join(node_roots[0], ".partner", "step_00000020", METADATA_FILE))
    outs = run_nodes(node_roots, "resume", "", settings)
    assert resumed(outs) == {"20"}
    for root in node_roots:  # the restart made the copies the partners lacked
        assert steps_in(os.path.join(root, ".partner")) == ["step_00000010", "step_00000020"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
def test_nodes_whose_newest_steps_differ_agree_on_the_newest_all_can_load(node_roots):
    settings = {"keep_last": 3}
    run_nodes(node_roots, "save", "10,20,30", settings)
    shutil.rmtree(os.path.join(node_roots[1], "step_00000030"))  # node 1 lost its newest step
    os.unlink(os.path.join(node_roots[0], "step_00000010", METADATA_FILE))  # node 0: step 10 uncommitted
    outs = run_nodes(node_roots, "resume", "", settings)
    assert resumed(outs) == {"20"}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
@pytest.mark.parametrize("when", ["save-kill-mid", "save-kill"])
def test_a_node_killed_mid_save_or_mid_copy_restarted_empty_loses_nothing_committed(node_roots, when):
    settings = {"partner": True, "keep_last": 3, "partner_keep_last": 3}
    run_nodes(node_roots, when, "10,20,30", settings, expect_killed=True)
    wipe(node_roots[1])
    outs = run_nodes(node_roots, "resume", "", settings)
    # step 20's partner copies were waited for; step 30 was being saved, or its copies made, when
    # node 1 died: it is resumed only if every file of it survived somewhere
    got = resumed(outs)
    assert got in ({"20"}, {"30"}), outs
    if got == {"20"}:
        assert not os.path.exists(os.path.join(node_roots[0], ".partner", "step_00000030", METADATA_FILE))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
@pytest.mark.s3
@pytest.mark.parametrize("wiped", [[1], [0, 1]])
def test_wiped_nodes_without_partner_resume_from_the_durable_tier(node_roots, s3_server, wiped):
    url = f"s3://{s3_server.bucket}/nodes-{os.getpid()}-{free_port()}"
    settings = {"keep_last": 2, "durable": url}
    run_nodes(node_roots, "save", "10,20", settings, env=s3_server.env())
    for n in wiped:
        wipe(node_roots[n])
    outs = run_nodes(node_roots, "resume", "30", settings, env=s3_server.env())
    assert resumed(outs) == {"20"}
    # one node lost: its files of step 20 copied back; every node lost: step 20 read where it is
    assert steps_in(node_roots[1]) == (["step_00000020", "step_00000030"] if wiped == [1] else ["step_00000030"])


def test_node_options_are_checked_before_anything_is_touched():
    from dcp_datastates import CheckpointManagerOptions as Options

    with pytest.raises(ValueError, match="partner=True .* needs node_local=True"):
        Options(partner=True, incremental=False)
    with pytest.raises(ValueError, match="node_local=True needs incremental=False"):
        Options(node_local=True)
    with pytest.raises(ValueError, match="partner_keep_last"):
        Options(node_local=True, incremental=False, partner=True, partner_keep_last=0)
    with pytest.raises(ValueError, match="checksum_bytes"):
        Options(checksum_bytes=1000)
    assert Options(node_local=True, incremental=False, partner=True, checksum_bytes=4096).partner_keep_last == 2


def test_homes_follow_the_saved_nodes_whatever_the_ranks_per_node():
    ranks = {r: None for r in range(4)}  # saved on 2 nodes x 2 ranks
    node0 = NodeReport(0, {7: _copy(3, ranks, [0, 1])}, {7: _copy(3, ranks, [2, 3])}, set())
    wiped = NodeReport(1, {}, {}, set())
    plan = plan_node_load([node0, wiped], [], [], None)
    assert homes(plan, 7, [node0, wiped], 2) == {0: 0, 1: 0, 2: 1, 3: 1}
    # one node now: nobody lost the step; ranks 2-3 stay in node 0's partner copy
    assert homes(plan, 7, [node0], 1) == {0: 0, 1: 0}
    # two nodes wiped out of three, only the durable tier holds their files: shared in rank order
    six = {r: None for r in range(6)}
    first = NodeReport(0, {7: _copy(3, six, [0, 1])}, {}, set())
    plan = plan_node_load([first, NodeReport(1, {}, {}, set()), NodeReport(2, {}, {}, set())], [7], [], None,
                          {7: CommitStamp(3, 0, 1)})
    reports = [first, NodeReport(1, {}, {}, set()), NodeReport(2, {}, {}, set())]
    assert homes(plan, 7, reports, 3) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    restore = restore_copies(plan, 7, reports, NodeMap(((0, 1), (2, 3), (4, 5)), 0))
    files = [c for c in restore.copies if c.name != METADATA_FILE]
    assert all(c.src == c.dst and c.tag == "durable" for c in files)  # each reads the durable tier itself
    assert sorted(c.dst for c in files) == [2, 2, 3, 3, 4, 4, 5, 5]
    assert {(c.src, c.dst, c.hold) for c in restore.copies if c.name == METADATA_FILE} == {(0, 2, True), (0, 4, True)}
