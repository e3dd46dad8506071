"""Per-tenant pseudonyms: stable for one tenant, unlinkable across tenants, keyed by the provider's secret."""

from __future__ import annotations

import re

import pytest

from api.services.tenant_views import free_gpus_bucket
from harmonaize.events.fields import GROUP_PSEUDONYM_PATTERN, HOST_PSEUDONYM_PATTERN
from harmonaize.pseudonyms import host_pseudonym, locality_pseudonym

SECRET = b"provider-secret"


def test_stable_and_well_formed() -> None:
    host = host_pseudonym(SECRET, "acme", "gpu-node-017")
    group = locality_pseudonym(SECRET, "acme", "rack-a")
    assert host == host_pseudonym(SECRET, "acme", "gpu-node-017")
    assert re.fullmatch(r"h-[0-9a-f]{16}", host)
    assert re.fullmatch(r"g-[0-9a-f]{16}", group)
    assert re.fullmatch(HOST_PSEUDONYM_PATTERN, host), "the event contract must accept what the API shows"
    assert re.fullmatch(GROUP_PSEUDONYM_PATTERN, group)


def test_unlinkable_across_tenants_kinds_and_secrets() -> None:
    names = {
        host_pseudonym(SECRET, "acme", "n1")[2:],
        host_pseudonym(SECRET, "globex", "n1")[2:],
        locality_pseudonym(SECRET, "acme", "n1")[2:],
        host_pseudonym(b"another-secret", "acme", "n1")[2:],
        host_pseudonym(SECRET, "acmen", "1")[2:],
        host_pseudonym(SECRET, "acme", "n2")[2:],
    }
    assert len(names) == 6


def test_no_collisions_among_many_hosts() -> None:
    pseudonyms = {host_pseudonym(SECRET, "acme", f"host-{index}") for index in range(20_000)}
    assert len(pseudonyms) == 20_000


def test_refuses_an_empty_secret() -> None:
    with pytest.raises(ValueError, match="secret"):
        host_pseudonym(b"", "acme", "n1")


@pytest.mark.parametrize(
    ("free", "bucket"),
    [(0, ("0", 0)), (1, ("1", 1)), (2, ("2-3", 2)), (3, ("2-3", 2)), (4, ("4-7", 4)), (7, ("4-7", 4)),
     (8, ("8-15", 8)), (1000, ("512-1023", 512)), (-1, ("0", 0))],
)
def test_capacity_buckets(free: int, bucket: tuple[str, int]) -> None:
    assert free_gpus_bucket(free) == bucket
