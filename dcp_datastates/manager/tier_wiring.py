"""Opening a manager's copy tiers: the durable tier (``durable=``) and the partner level
(``partner=True``), with what each start owes them (the copies an earlier run left undone)."""

from __future__ import annotations

import os
import weakref

from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.manager.durable_tier import DurableTier, commit_rule_for
from dcp_datastates.manager.local_retention import LocalRetention
from dcp_datastates.manager.manager_state import ManagerState
from dcp_datastates.manager.node_copies import missing_partner_copies
from dcp_datastates.manager.partner_tier import PartnerTier
from dcp_datastates.manager.reporting import warn_manager
from dcp_datastates.manager.retention import RetentionPolicy
from dcp_datastates.manager.survey import survey_tier


def open_durable_tier(st: ManagerState, retention: LocalRetention) -> None:
    """Open the store; the owner's leaders survey it (:func:`survey.survey_tier`); then every
    rank drains again the committed local steps whose own save is not durable there yet.

    A store that does not answer does not stop the run: it trains and saves locally, and every
    committed local step is queued, to be copied (or found there already) once the store
    answers; only a resume that needs the tier fails."""
    opts = st.options
    policy = RetentionPolicy(opts.durable_keep_last, opts.durable_keep_every)
    st.tier = tier = DurableTier(
        os.fspath(opts.durable), rank=st.rank, read_back=opts.durable_read_back,
        # node-local roots: the other nodes' leaders learn when rank 0 committed each copy
        commit=commit_rule_for(st.rank, st.nodes.is_leader, policy),
        retry_s=opts.durable_retry_s, store_options=opts.durable_options,
        on_durable=weak_call(retention, "on_durable"), warn=warn_manager,
    )
    if not st.owner:
        return

    def survey_root():
        return survey_tier(st.root, tier, policy, st.bases.referred_steps, warn_manager)

    if st.node_level is not None:  # each node's root, surveyed by its leader
        surveys = st.ranks.on_leaders(survey_root, f"surveying the durable tier {tier.url}", st.nodes)
        survey = surveys[st.nodes.node]
        st.undrained_run = set(surveys[st.nodes.node_of(0)].undrained)
        for other in surveys:  # every rank the same: the run's rollbacks and newest sequence
            st.rollbacks.update(other.rollbacks)
            st.saw_sequence(other.newest_sequence)
    else:
        survey = st.ranks.on_rank0(survey_root, f"surveying the durable tier {tier.url}")
    st.settled.update(survey.settled)
    st.rollbacks.update(survey.rollbacks)
    st.saw_sequence(survey.newest_sequence)
    if survey.error is not None:
        warn_manager(
            f"the durable tier {tier.url} did not answer ({survey.error}): the run goes on locally; "
            f"the committed local steps {survey.undrained} are copied there once it answers "
            f"(retried for {opts.durable_retry_s:.0f} s at a time), and kept locally until then"
        )
    if st.rank == 0 and survey.mirror is not None:
        tier.mirror_pointer(survey.mirror)
    for s in survey.undrained:  # in commit order: an incremental step commits there after its bases
        try:
            mine = _drain_share(st, s)
        except Exception as exc:  # noqa: BLE001 - this step stays local-only; said once
            warn_manager(f"step {s} is committed locally but not on {tier.url}, and cannot be drained: {exc}")
            continue
        for files in mine:
            tier.enqueue(s, st.path_of(s), files)


def _drain_share(st: ManagerState, step: int) -> list:
    """The saved ranks' files of ``step`` this rank drains again: of the ranks whose files the
    root holds (a node's, with node-local roots), every W-th (W: the ranks sharing the root),
    whatever the number of ranks the step was saved with."""
    reader = DataStatesReader(st.path_of(step))
    reader.load_metadata()
    files = reader.require_layout().own_ranks
    members = st.nodes.members[st.nodes.node]
    if st.node_level is not None:
        here = set(os.listdir(st.path_of(step)))
        files = [f for f in files if all(n in here for n in f.file_names())]
    return [f for j, f in enumerate(files) if members[j % len(members)] == st.rank]


def open_partner_tier(st: ManagerState, retention: LocalRetention) -> None:
    """The partner level (:mod:`manager.partner_tier`); at start, every copy a partner lacks of
    the steps each node keeps is made again, in step order, on every rank alike."""
    if st.nodes.partner(st.nodes.node) is None:
        warn_manager(f"partner=True, but the run has one node: {st.root} has no partner to copy to")
        return
    st.partner = partner = PartnerTier(st.node_level, st.ranks, st.options, warn=warn_manager,
                                       on_copied=weak_call(retention, "on_partner_copied"))
    if st.owner and st.nodes.is_leader:
        partner.clear_incomplete()  # what interrupted copies left here
    for step, senders in missing_partner_copies(st.node_level.reports(), st.nodes, st.options.partner_keep_last):
        partner.redo(step, st.path_of(step), senders)


def weak_call(obj, name: str):
    """``obj.name`` without keeping ``obj`` alive (a copy thread must not pin the manager's parts)."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        return getattr(target, name)(*args) if target is not None else None

    return call
