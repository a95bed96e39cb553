"""The supported-version check that replaces a pip pin on mace-torch."""

from __future__ import annotations

import warnings

import pytest

from mlipdd_mace import versions


def test_installed_mace_is_supported():
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UnsupportedVersionWarning)
        assert versions.require_mace()


def test_out_of_range_mace_warns_with_install_hint(monkeypatch):
    fake = {"mace-torch": "0.4.1", "e3nn": "0.6.0"}
    monkeypatch.setattr(versions, "_installed", fake.get)
    with pytest.warns(versions.UnsupportedVersionWarning, match=r"mace-torch 0\.4\.1.*--no-deps"):
        versions.require_mace()


def test_old_e3nn_warns(monkeypatch):
    fake = {"mace-torch": "0.3.16", "e3nn": "0.4.4"}
    monkeypatch.setattr(versions, "_installed", fake.get)
    with pytest.warns(versions.UnsupportedVersionWarning, match=r"e3nn 0\.4\.4"):
        versions.require_mace()


def test_missing_mace_says_how_to_install(monkeypatch):
    monkeypatch.setattr(versions, "_installed", lambda dist: None)
    with pytest.raises(ImportError, match="not installed.*--no-deps"):
        versions.require_mace()
