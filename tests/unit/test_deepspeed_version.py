"""Only the DeepSpeed versions the suite runs on are accepted (issue 11: supported means tested)."""

import pytest

deepspeed = pytest.importorskip("deepspeed")

from aidaptiv_ds.zero3 import compat  # noqa: E402


@pytest.fixture
def version(monkeypatch):
    monkeypatch.delenv(compat.UNTESTED_ENV, raising=False)
    return lambda v: monkeypatch.setattr(deepspeed, "__version__", v)


def test_the_tested_version_is_accepted(version):
    version(compat.TESTED)
    assert compat.check_deepspeed_version() == compat.TESTED


def test_an_untested_release_of_the_series_is_refused_unless_asked_for(version, monkeypatch):
    version("0.19.3")
    with pytest.raises(
        compat.UnsupportedDeepSpeedError, match=f"tested with DeepSpeed {compat.TESTED}.*{compat.UNTESTED_ENV}=1"
    ):
        compat.check_deepspeed_version()
    monkeypatch.setenv(compat.UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="untested"):
        assert compat.check_deepspeed_version() == "0.19.3"


@pytest.mark.parametrize("found", ["0.18.9", "0.20.0"])
def test_another_series_is_refused_even_when_asked(version, monkeypatch, found):
    version(found)
    monkeypatch.setenv(compat.UNTESTED_ENV, "1")
    with pytest.raises(
        compat.UnsupportedDeepSpeedError, match=f"pip install --no-build-isolation 'deepspeed=={compat.TESTED}'"
    ):
        compat.check_deepspeed_version()
