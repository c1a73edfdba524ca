"""The native kernels' build cache: shared by every checkout with the same sources, rebuilt for
new ones."""

from __future__ import annotations

import shutil

import pytest

from blockserve.native import extension as native


@pytest.fixture
def other_checkout(tmp_path):
    """csrc/ as another checkout (or virtual environment) of the same commit has it."""
    csrc = tmp_path / "another-checkout" / "csrc"
    shutil.copytree(native._CSRC, csrc)
    return csrc


def test_checkouts_of_the_same_sources_share_one_build(tmp_path, monkeypatch, other_checkout):
    key = native._build_key(())
    monkeypatch.setattr(native, "_CSRC", other_checkout)
    assert native._build_key(()) == key
    target = tmp_path / "extensions" / f"blockserve_kernels_{key}-src"
    assert native._shared_sources(target) == target
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in other_checkout.iterdir())
    monkeypatch.setattr(shutil, "copy2", lambda *args: pytest.fail("copied the sources again"))
    assert native._shared_sources(target) == target
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary directory left


def test_changed_sources_get_their_own_build(monkeypatch, other_checkout):
    key = native._build_key(())
    monkeypatch.setattr(native, "_CSRC", other_checkout)
    with open(other_checkout / "kernels.h", "a") as header:
        header.write("\n// changed\n")
    assert native._build_key(()) != key
    assert native._build_key(native.AVX2_ONLY) != native._build_key(())
