"""A step's speculative verifications, counted for usage and metrics: per sequence (onto its
update) and per draft position."""

from __future__ import annotations

from pagedinfer.engine.core.scheduler_output import SequenceUpdate


def attribute_verifications(updates: list[SequenceUpdate], checks: list[tuple[int, int, int]]) -> None:
    """Each sequence's verifications of this step onto its update, in emission order, for the
    request's usage (a chained step verifies several times per sequence; its no-draft device
    steps stay in the list: the output processor walks the tokens by them)."""
    by_seq = {u.seq_id: u for u in updates}
    for seq_id, drafts, accepted in checks:
        u = by_seq.get(seq_id)
        if u is not None:
            if u.verifications is None:
                u.verifications = []
            u.verifications.append((drafts, accepted))


def per_position_counts(checks: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(drafts verified, accepted) per draft position over the step's verifications: a
    verification of k drafts that accepted a checks positions 0..k-1 and accepts 0..a-1."""
    width = max(k for _, k, _ in checks)
    drafted, accepted = [0] * width, [0] * width
    for _, k, a in checks:
        for i in range(k):
            drafted[i] += 1
        for i in range(a):
            accepted[i] += 1
    return tuple(drafted), tuple(accepted)
