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


def test_a_finished_build_is_imported_from_where_torch_builds_it(tmp_path, monkeypatch):
    """_already_built looks where torch.utils.cpp_extension.load builds (its own directory rule),
    imports a finished build from there, and leaves to load() a missing one, one whose build lock
    is held and one that does not import."""
    from torch.utils.cpp_extension import _get_build_directory

    module = native.quantized_matmul_ops()
    if module is None:
        pytest.skip("no native build here")
    name = f"blockserve_kernels_{native.build_key()}"
    assert module.__file__ == f"{_get_build_directory(name, False)}/{name}.so"
    assert native._already_built(name).__file__ == module.__file__
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native._already_built(name) is None
    build = tmp_path / name
    build.mkdir()
    (build / f"{name}.so").write_bytes(b"not a library")
    assert native._already_built(name) is None
    shutil.copy2(module.__file__, build / f"{name}.so")
    (build / "lock").touch()
    assert native._already_built(name) is None
