"""A quorum of the same members as the committed quorum before it reuses its process
group (collectives.py, "Reuse"); other members, or an abort, build a fresh one. The rule
is docs/protocol.md's ("Group reuse, the one rule"), and a member written from that
document alone sums with the library's through every case (issue 32)."""

from __future__ import annotations

import datetime
import pathlib
import threading

import torch
import torch.distributed as dist

from asyncdiloco.worker.collectives import QuorumCollectives, QuorumGroup


def _stub(monkeypatch) -> tuple[QuorumCollectives, list[int]]:
    """Collectives whose ``_build`` makes a marker object per call (no sockets)."""
    qc = QuorumCollectives("127.0.0.1", None, torch.device("cpu"))
    built: list[int] = []

    def build(group: QuorumGroup, timeout_s: float) -> object:
        built.append(group.quorum_id)
        return object()

    monkeypatch.setattr(qc, "_build", build)
    return qc, built


def _q(quorum_id: int, members: tuple[int, ...], rank: int = 0) -> QuorumGroup:
    return QuorumGroup(quorum_id, rank, len(members), store=None, members=members)


def test_same_members_after_a_commit_reuse_the_group(monkeypatch):
    qc, built = _stub(monkeypatch)
    first = qc.open(_q(1, (3, 5, 8)), 5.0)
    qc.keep()
    assert qc.open(_q(2, (3, 5, 8)), 5.0) is first
    qc.keep()
    assert qc.open(_q(3, (3, 5, 8)), 5.0) is first
    assert built == [1] and (qc.groups_built, qc.groups_reused) == (1, 2)


def test_other_members_or_another_rank_rebuild_the_group(monkeypatch):
    qc, built = _stub(monkeypatch)
    first = qc.open(_q(1, (3, 5, 8)), 5.0)
    qc.keep()
    second = qc.open(_q(2, (3, 5)), 5.0)  # a member left
    assert second is not first
    qc.keep()
    third = qc.open(_q(3, (3, 5), rank=1), 5.0)  # same ids, this member at another rank
    assert third is not second
    qc.keep()
    assert qc.open(_q(4, (3, 5, 9), rank=1), 5.0) is not third  # a newcomer
    assert built == [1, 2, 3, 4]


def test_an_aborted_round_or_no_decision_rebuilds_the_group(monkeypatch):
    qc, built = _stub(monkeypatch)
    qc.open(_q(1, (3, 5)), 5.0)
    qc.drop()  # aborted
    qc.open(_q(2, (3, 5)), 5.0)
    # no keep(): the round's decision never arrived here (an error before the vote)
    qc.open(_q(3, (3, 5)), 5.0)
    assert built == [1, 2, 3]


def test_a_quorum_without_its_member_list_never_reuses(monkeypatch):
    qc, built = _stub(monkeypatch)
    qc.open(QuorumGroup(1, 0, 2, store=None), 5.0)
    qc.keep()
    qc.open(QuorumGroup(2, 0, 2, store=None), 5.0)
    assert built == [1, 2]


def test_a_reused_gloo_group_sums_again_without_a_rendezvous():
    """Two members in threads: quorum 2 (same members, after a commit) sums in quorum
    1's group and never touches its own store; quorum 3 (a new member list) rendezvouses."""
    stores = {q: dist.HashStore() for q in (1, 2, 3)}
    sums: dict[tuple[int, int], float] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            qc = QuorumCollectives("127.0.0.1", None, torch.device("cpu"))
            for q, members in ((1, (4, 6)), (2, (4, 6)), (3, (4, 7))):
                buf = torch.full((8,), float(rank + q))
                qc.allreduce_sum(buf, QuorumGroup(q, rank, 2, stores[q], members), 20.0)
                sums[(q, rank)] = float(buf[0])
                qc.keep()
            assert (qc.groups_built, qc.groups_reused) == (2, 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a member hung"
    assert not errors, errors
    assert sums == {(q, r): float(2 * q + 1) for q in (1, 2, 3) for r in (0, 1)}
    assert stores[2].num_keys() == 0  # the reused group did not rendezvous
    assert stores[3].num_keys() > 0


# ----------------------------------------------- a member written from the protocol alone
PROTOCOL = pathlib.Path(__file__).parent.parent / "docs" / "protocol.md"

#: docs/protocol.md's rule, as the member below implements it (the test checks the
#: document still says so).
RULE = (
    "reuses the process group of its previous quorum (the last quorum it was a member of), with no "
    "rendezvous, if and only if all three hold: (a) that quorum's round committed, as this member's own "
    "`Commit` reply said; (b) the new `QuorumReply.members` (worker ids in rank order) equals the previous "
    "quorum's; (c) the world size is above 1. In every other case it builds a fresh group under "
    "`q<new quorum id>`"
)


class DocumentMember:
    """A sync member's group handling written from docs/protocol.md ("Group reuse, the one
    rule") alone, sharing no code with collectives.py: gloo over the quorum's store under
    the prefix ``q<quorum id>``, reused only after a commit for the same member list."""

    def __init__(self) -> None:
        self.kept: tuple[tuple[int, ...], object] | None = None  # (members, group) of a committed quorum
        self.current: tuple[tuple[int, ...], object] | None = None
        self.built = 0

    def open(self, quorum_id: int, rank: int, members: tuple[int, ...], store, timeout_s: float):
        kept, self.kept = self.kept, None
        if kept is not None and kept[0] == members and len(members) > 1:
            self.current = kept
            return kept[1]
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"q{quorum_id}", store), rank, len(members), options)
        self.current, self.built = (members, group), self.built + 1
        return group

    def decided(self, committed: bool | None) -> None:
        """The Commit reply's decision (None: the call failed, nothing learned)."""
        self.kept = self.current if committed else None


def test_the_protocol_states_the_one_reuse_rule():
    text = " ".join(PROTOCOL.read_text().split())  # the document's line breaks do not matter
    assert RULE in text, "docs/protocol.md must state the group reuse rule the library follows"
    assert "builds a fresh process group" not in text  # what it said before: a fresh group for every quorum


def test_a_member_written_from_the_protocol_sums_with_the_librarys_through_reuses_and_rebuilds():
    """The library's member (worker 4, rank 0) and a DocumentMember (worker 6, then 9 after
    a rejoin; rank 1) through: a fresh group, a reuse, a reuse whose round aborts, a fresh
    group after the abort, new members, a reuse, and a decision one of them never learned
    on both sides alike. Had either built while the other reused, its rendezvous would
    time out and the test fail."""
    plan = [  # (quorum id, members, decision: True commit, False abort, None not learned)
        (1, (4, 6), True),
        (2, (4, 6), True),
        (3, (4, 6), False),
        (4, (4, 6), True),
        (5, (4, 9), True),
        (6, (4, 9), None),
        (7, (4, 9), True),
    ]
    stores = {q: dist.HashStore() for q, _, _ in plan}
    sums: dict[tuple[int, int], float] = {}
    errors: list[BaseException] = []
    counts: dict[str, tuple[int, int]] = {}

    def library() -> None:
        qc = QuorumCollectives("127.0.0.1", None, torch.device("cpu"))
        for q, members, decision in plan:
            buf = torch.full((8,), 1.0 + q)
            qc.allreduce_sum(buf, QuorumGroup(q, 0, len(members), stores[q], members), 20.0)
            sums[(q, 0)] = float(buf[0])
            if decision is True:
                qc.keep()
            elif decision is False:
                qc.drop()
        counts["library"] = (qc.groups_built, qc.groups_reused)

    def documented() -> None:
        member = DocumentMember()
        for q, members, decision in plan:
            buf = torch.full((8,), 100.0 * q)
            member.open(q, 1, members, stores[q], 20.0).allreduce([buf]).wait()
            sums[(q, 1)] = float(buf[0])
            member.decided(decision)
        counts["document"] = (member.built, len(plan) - member.built)

    def run(target) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in (library, documented)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a member hung"
    assert not errors, errors
    assert sums == {(q, r): 1.0 + q + 100.0 * q for q, _, _ in plan for r in (0, 1)}
    fresh = {1, 4, 5, 7}  # the first; after an abort; new members; after an unknown decision
    assert counts == {"library": (4, 3), "document": (4, 3)}
    for q, _, _ in plan:
        assert (stores[q].num_keys() > 0) == (q in fresh), q  # a reused group never touches its store
