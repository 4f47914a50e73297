"""The scheduler's running totals."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    """Running totals, for metrics and for tests that must know a path was taken."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_queries: int = 0  # tokens looked up in the prefix cache at admission
    num_prefix_hits: int = 0  # of which found
    num_refused_requests: int = 0  # requests failed because the worker refused them
    # Speculative decoding: per request and verified step, d drafts of which a were accepted.
    num_spec_requests: int = 0  # request-steps that carried drafts
    num_draft_tokens: int = 0  # sum of d
    num_accepted_tokens: int = 0  # sum of a
    # [K] each: how often a step had a j-th draft, and how often it was accepted (acceptance
    # stops at the first rejection, so accepted_per_position never increases with j).
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.num_spec_requests += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        drafted, accepted = self.drafted_per_position, self.accepted_per_position
        if len(drafted) < num_drafts:
            drafted.extend([0] * (num_drafts - len(drafted)))
            accepted.extend([0] * (num_drafts - len(accepted)))
        for j in range(num_drafts):
            drafted[j] += 1
        for j in range(num_accepted):
            accepted[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens since start; 0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
