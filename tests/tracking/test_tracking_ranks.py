import pytest

from dsrl.distributed import ranks


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_single_process_defaults(clean_env):
    assert ranks.global_rank() == 0
    assert ranks.world_size() == 1
    assert ranks.local_rank() == 0
    assert ranks.is_main_rank() is True


def test_launcher_env(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    assert ranks.global_rank() == 5
    assert ranks.world_size() == 8
    assert ranks.local_rank() == 1
    assert ranks.is_main_rank() is False
    clean_env.setenv("RANK", "0")
    assert ranks.is_main_rank() is True


def test_bad_env_names_the_variable(clean_env):
    clean_env.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK"):
        ranks.global_rank()
