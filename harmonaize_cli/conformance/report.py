"""The conformance report: counts per check group, every failure with its event id, warnings folded by reason.

A group counts messages, not findings: "12 checked, 1 failed" means one message of twelve broke at least one of the
group's rules (its findings are all listed). Warnings repeat on every event of a feed (a missing header), so they are
folded into one line per reason with the number of events. The run itself can fail too (`feed`): the tenant's own
subscription refused, or fewer events than `--events` asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from harmonaize_cli.conformance.checks import MessageResult
from harmonaize_cli.conformance.findings import Group, Severity
from harmonaize_cli.conformance.probes import ProbeResult

__all__ = ["EventFinding", "Report", "Tally"]

MESSAGE_GROUPS: Final = (Group.BINDING, Group.ENVELOPE, Group.SUBJECT, Group.SCHEMA, Group.DUPLICATES)
_WARNING_IDS_KEPT: Final = 5


@dataclass
class Tally:
    checked: int = 0
    failed: int = 0
    warned: int = 0


@dataclass(frozen=True, slots=True)
class EventFinding:
    """A finding about one received message."""

    group: Group
    reason: str
    event_id: str | None
    subject: str


@dataclass
class _Folded:
    count: int = 0
    event_ids: list[str] = field(default_factory=list)


class Report:
    """Collects the results of a run; `passed`, `render()` and `to_json()` say how it went."""

    def __init__(self, *, tenant: str, subject: str, interface: str, expected_events: int | None = None) -> None:
        self.tenant, self.subject, self.interface = tenant, subject, interface
        self.expected_events = expected_events
        self.tallies = {group: Tally() for group in MESSAGE_GROUPS}
        self.failures: list[EventFinding] = []
        self._warnings: dict[tuple[Group, str], _Folded] = {}
        self.probes: list[ProbeResult] = []
        self.feed_problems: list[str] = []
        self.events = 0
        self.duplicates = 0
        self.seconds = 0.0

    def add_message(self, result: MessageResult) -> None:
        self.events += 1
        for group in MESSAGE_GROUPS:
            if group not in result.checked:
                continue
            tally = self.tallies[group]
            tally.checked += 1
            mine = [finding for finding in result.findings if finding.group == group]
            if any(finding.severity == Severity.FAILURE for finding in mine):
                tally.failed += 1
            elif mine:
                tally.warned += 1
        for finding in result.findings:
            if finding.severity == Severity.FAILURE:
                self.failures.append(EventFinding(finding.group, finding.reason, result.event_id, result.subject))
                continue
            folded = self._warnings.setdefault((finding.group, finding.reason), _Folded())
            folded.count += 1
            if result.event_id is not None and len(folded.event_ids) < _WARNING_IDS_KEPT:
                folded.event_ids.append(result.event_id)

    def add_probes(self, results: Iterable[ProbeResult]) -> None:
        self.probes.extend(results)

    def finish(self, *, seconds: float, duplicates: int) -> None:
        """The run is over: how long it listened, how many duplicates it saw, and whether enough events came."""
        self.seconds, self.duplicates = seconds, duplicates
        if self.expected_events is not None and self.events < self.expected_events:
            self.feed_problems.append(f"only {self.events} of the {self.expected_events} events asked for (--events) "
                                      f"arrived within {seconds:.1f} s")

    @property
    def refused(self) -> int:
        return sum(1 for probe in self.probes if probe.refused)

    @property
    def passed(self) -> bool:
        return (not self.feed_problems and not self.failures and self.refused == len(self.probes))

    def render(self) -> str:
        """The text report: a verdict line, one line per group, then failures and folded warnings."""
        lines = [f"conformance of tenant {self.tenant}'s feed ({self.subject}, {self.seconds:.1f} s, interface "
                 f"{self.interface}): {_verdict(self.passed)}"]
        expected = f" of {self.expected_events} asked for" if self.expected_events is not None else ""
        nothing = " (nothing on the feed was checked)" if self.events == 0 else ""
        lines.append(f"  {'feed':<11} {_verdict(not self.feed_problems)}  {self.events} events{expected}, "
                     f"duplicate ids: {self.duplicates}{nothing}")
        for group, tally in self.tallies.items():
            warned = f", {tally.warned} with warnings" if tally.warned else ""
            lines.append(f"  {group.value:<11} {_verdict(tally.failed == 0)}  {tally.checked} checked, "
                         f"{tally.failed} failed{warned}")
        lines.append(f"  {Group.ISOLATION.value:<11} {_verdict(self.refused == len(self.probes))}  "
                     f"{len(self.probes)} probes, {self.refused} refused")
        failing_probes = [probe for probe in self.probes if not probe.refused]
        total = len(self.feed_problems) + len(self.failures) + len(failing_probes)
        if total:
            lines.append(f"failures ({total}):")
            lines += [f"  feed        {problem}" for problem in self.feed_problems]
            lines += [f"  {item.group.value:<11} id {item.event_id or '(none)'} on {item.subject}: {item.reason}"
                      for item in self.failures]
            lines += [f"  {Group.ISOLATION.value:<11} {probe.name} ({probe.target}): {probe.detail}"
                      for probe in failing_probes]
        if self._warnings:
            lines.append("warnings (these alone fail no run):")
            lines += [f"  {group.value:<11} {folded.count} event(s): {reason}"
                      for (group, reason), folded in self._warnings.items()]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Everything `render` says, as data (`--json`)."""
        groups: dict[str, Any] = {
            group.value: {"passed": tally.failed == 0, "checked": tally.checked, "failed": tally.failed,
                          "warned": tally.warned}
            for group, tally in self.tallies.items()
        }
        groups[Group.ISOLATION.value] = {"passed": self.refused == len(self.probes), "checked": len(self.probes),
                                         "failed": len(self.probes) - self.refused, "warned": 0}
        return {
            "passed": self.passed,
            "tenant": self.tenant,
            "subject": self.subject,
            "interface": self.interface,
            "seconds": round(self.seconds, 3),
            "feed": {"passed": not self.feed_problems, "events": self.events, "expected": self.expected_events,
                     "duplicates": self.duplicates, "problems": list(self.feed_problems)},
            "groups": groups,
            "failures": [{"group": item.group.value, "event_id": item.event_id, "subject": item.subject,
                          "reason": item.reason} for item in self.failures],
            "warnings": [{"group": group.value, "reason": reason, "events": folded.count,
                          "event_ids": folded.event_ids} for (group, reason), folded in self._warnings.items()],
            "probes": [{"name": probe.name, "target": probe.target, "refused": probe.refused, "detail": probe.detail}
                       for probe in self.probes],
        }


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"
