"""host_memory_budget adds up per node: a share of RAM, or a size per node, is split between the node's ranks;
a size per rank says so; the node's total is checked against its RAM before anything is pinned."""

import logging

import pytest

from aidaptiv_ds.config import ds_config, host, resolve, schema
from aidaptiv_ds.config import settings as config_settings
from aidaptiv_ds.engine import machine

GiB = 1 << 30


def ds(budget, **block):
    return {
        "zero_optimization": {"stage": 3},
        "aidaptiv": {"enabled": True, "nvme_path": "/tmp", "host_memory_budget": budget, **block},
    }


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in host.LOCAL_RANK_COUNT_VARS:
        monkeypatch.delenv(name, raising=False)


def per_rank(budget, ranks=None, ram=64 * GiB):
    return config_settings.SwapSettings.from_block(
        ds(budget)["aidaptiv"], ram_bytes=ram, local_ranks=ranks
    ).host_budget_bytes


def test_a_share_of_ram_is_split_between_the_nodes_ranks(monkeypatch):
    assert per_rank("25%", ram=64 * GiB) == 16 * GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun, accelerate
    assert per_rank("25%", ram=64 * GiB) == 4 * GiB  # was 16 GiB each: 64 GiB pinned on a 64 GiB node
    assert per_rank(0.5, ram=64 * GiB) == 8 * GiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher
    assert per_rank("25%", ram=64 * GiB) == 8 * GiB


def test_sizes_say_per_node_or_per_rank_and_a_bare_size_stays_per_rank():
    assert per_rank("64GiB/node", ranks=4) == 16 * GiB
    assert per_rank("16GiB/rank", ranks=4) == 16 * GiB
    assert per_rank("16GiB", ranks=4) == 16 * GiB
    assert per_rank(3 << 30, ranks=4) == 3 << 30
    assert per_rank("25%/node", ranks=2) == 8 * GiB
    assert schema.parse_host_budget(" 4 GiB / Node ") == (4 * GiB, None, "node")


@pytest.mark.parametrize(
    "bad, words", [("25%/rank", "share of the node"), ("4GiB/gpu", "'node' or 'rank'"), ("lots/node", "not a size")]
)
def test_bad_scopes_are_refused_with_what_to_write(bad, words):
    with pytest.raises(ds_config.ConfigError) as e:
        config_settings.SwapSettings.from_block(ds(bad)["aidaptiv"], ram_bytes=GiB)
    assert "aidaptiv.host_memory_budget" in str(e.value) and words in str(e.value)


def test_the_translated_block_is_not_split_again(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    settings = config_settings.SwapSettings.from_block(ds("64GiB/node")["aidaptiv"])
    assert settings.host_budget_bytes == 16 * GiB
    assert config_settings.SwapSettings.from_block(settings.block()) == settings


def test_the_nodes_total_over_its_ram_is_refused_before_training(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "total_ram_bytes", lambda: 8 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = ds("3GiB")
    cfg["aidaptiv"]["nvme_path"] = str(tmp_path)
    with pytest.raises(ds_config.ConfigError) as e:  # 3 GiB each fits one rank; 4 of them do not
        resolve.validate(cfg)
    msg = str(e.value)
    assert "each of the 4 ranks" in msg and "12.00 GiB together" in msg and "8.00 GiB" in msg and "/node" in msg
    cfg["aidaptiv"]["host_memory_budget"] = "6GiB/node"
    assert resolve.validate(cfg).host_budget_bytes == 6 * GiB // 4


def test_a_total_over_the_memlock_limit_is_warned_about_not_refused(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(machine, "total_ram_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(machine, "memlock_limit", lambda: 64 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = ds("1GiB")
    cfg["aidaptiv"]["nvme_path"] = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="aidaptiv_ds.config"):
        settings = resolve.validate(cfg)
    assert settings.host_budget_bytes == GiB
    text = caplog.text
    assert "the 2 ranks on this node" in text and "2.00 GiB" in text and "ulimit -l" in text
    caplog.clear()
    monkeypatch.setattr(machine, "memlock_limit", lambda: None)
    resolve.validate(cfg)
    assert "ulimit -l" not in caplog.text


def test_memlock_limit_reads_the_rlimit_unless_privileged():
    import resource

    limit = machine.memlock_limit()
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert limit is None or limit == soft
