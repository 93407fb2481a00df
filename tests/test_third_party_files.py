"""The third-party fixtures (tests/THIRD_PARTY.md): each file found is the one listed, and
the lookup says where it looked.

The files are not kept in the project (what the fetch tool brings is never committed);
they are found in $RIDGELINE_THIRD_PARTY or SHARED/third-party/ and these checks skip for
a file that is absent.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import third_party
from support.third_party_files import DOC, listed_sha256, third_party_missing, third_party_path


def test_every_listed_file_has_its_provenance_section():
    listed = listed_sha256()
    assert len(listed) == 20
    text = DOC.read_text()
    for rel in listed:
        # once in the digest block, and at least once where its source is described
        assert text.count(Path(rel).name) >= 2, f"{rel}: listed with a digest but described nowhere"


@pytest.mark.parametrize("rel", sorted(listed_sha256()))
def test_the_file_found_is_the_one_listed(rel):
    """The file found is byte for byte the one tests/THIRD_PARTY.md describes."""
    p = third_party(rel)
    assert hashlib.sha256(p.read_bytes()).hexdigest() == listed_sha256()[rel], p


def test_lookup_order_and_the_line_for_an_absent_file(tmp_path, monkeypatch):
    first, shared = tmp_path / "tp", tmp_path / "shared"
    (first / "nsys").mkdir(parents=True)
    (shared / "third-party" / "nsys").mkdir(parents=True)
    (shared / "third-party" / "nsys" / "a.sqlite.gz").write_bytes(b"s")
    monkeypatch.setenv("RIDGELINE_SHARED", str(shared))
    monkeypatch.setenv("RIDGELINE_THIRD_PARTY", str(first))
    assert third_party_path("nsys/a.sqlite.gz") == shared / "third-party" / "nsys" / "a.sqlite.gz"
    (first / "nsys" / "a.sqlite.gz").write_bytes(b"f")
    assert third_party_path("nsys/a.sqlite.gz") == first / "nsys" / "a.sqlite.gz"
    assert third_party_path("nsys/b.sqlite.gz") is None
    line = third_party_missing("nsys/b.sqlite.gz")
    assert str(first / "nsys" / "b.sqlite.gz") in line and str(shared / "third-party" / "nsys" / "b.sqlite.gz") in line
    assert "\n" not in line and "tests/THIRD_PARTY.md" in line
