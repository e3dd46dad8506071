"""What a conformance check reports: one finding per problem, in a check group, failing or only a warning.

Why warnings exist at all: CloudEvents has SHOULDs (attribute names of at most 20 characters) and the NATS binding
changed between versions (1.0.2 knows only structured mode without headers; the current draft reads a message
without a CloudEvents `Content-Type` as binary mode). A feed that follows the older text is not wrong, but a tenant
should hear about it; it must not fail the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Finding", "Group", "Severity", "failure", "warning"]


class Group(StrEnum):
    """The check groups of a report, in the order it prints them."""

    BINDING = "binding"
    ENVELOPE = "envelope"
    SUBJECT = "subject"
    SCHEMA = "schema"
    DUPLICATES = "duplicates"
    ISOLATION = "isolation"


class Severity(StrEnum):
    FAILURE = "failure"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: its group, a reason that names the attribute, field or probe, and how bad it is."""

    group: Group
    reason: str
    severity: Severity = Severity.FAILURE


def failure(group: Group, reason: str) -> Finding:
    return Finding(group, reason, Severity.FAILURE)


def warning(group: Group, reason: str) -> Finding:
    return Finding(group, reason, Severity.WARNING)
