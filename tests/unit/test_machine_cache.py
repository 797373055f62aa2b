"""Where the cache of measured rates and tuned I/O settings lives, and that the suite runs apart from it."""

import os

from aidaptiv_ds.engine import machine_cache


def test_the_cache_folder_can_be_moved_and_the_suite_runs_apart_from_the_machines(monkeypatch, tmp_path):
    # conftest gave this session its own (empty) folder, so a developer's tuned settings change nothing here
    assert os.environ.get("AIDAPTIV_DS_CACHE_DIR") and "aidaptiv-tests-cache-" in os.environ["AIDAPTIV_DS_CACHE_DIR"]
    monkeypatch.setenv("AIDAPTIV_DS_CACHE_DIR", str(tmp_path / "mine"))
    machine_cache.save_cache({"k": 1})
    assert machine_cache.cache_path() == str(tmp_path / "mine" / "rates.json")
    assert machine_cache.load_cache() == {"k": 1}
    monkeypatch.delenv("AIDAPTIV_DS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machine_cache.cache_path() == str(tmp_path / "xdg" / "aidaptiv-ds" / "rates.json")
