"""A quorum of the same members as the committed quorum before it reuses its process
group (collectives.py, "Reuse"); other members, or an abort, build a fresh one."""

from __future__ import annotations

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
