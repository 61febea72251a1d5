"""Fixtures shared by the chart tests."""

from __future__ import annotations

import pytest

from tests.helm_kit import Helm, ensure_helm


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Helm:
    """Real helm (installed on first use), with a scratch directory per test module."""
    return Helm(ensure_helm(), tmp_path_factory.mktemp("helm"))
