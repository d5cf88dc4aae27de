"""`megatron-arpo demo --seeds`: the per-seed table the docs quote, and its bad inputs."""

import pytest

from megatron_arpo import cli
from megatron_arpo.demo import seeds_table


def _summary(seed, before, after, acc_before=0.1, acc_after=0.2):
    return {"seed": seed, "before": {"all": {"reward": before, "accuracy": acc_before, "n": 60}},
            "after": {"all": {"reward": after, "accuracy": acc_after, "n": 60}}}


def test_the_table_has_one_row_per_seed_and_the_mean_and_spread_of_the_gain():
    text, data = seeds_table([_summary(0, 0.2, 0.6), _summary(1, 0.1, 0.3), _summary(2, 0.3, 0.8)], "configs/demo.yaml")
    lines = text.splitlines()
    assert "| 0 | 0.200 | 0.600 | 0.400 | 0.100 | 0.200 |" in lines
    assert "| 1 | 0.100 | 0.300 | 0.200 | 0.100 | 0.200 |" in lines
    gain = data["stats"]["gain"]
    assert gain["mean"] == pytest.approx((0.4 + 0.2 + 0.5) / 3)
    assert gain["min"] == pytest.approx(0.2) and gain["max"] == pytest.approx(0.5)
    assert gain["std"] == pytest.approx(((0.4 - 11 / 30) ** 2 + (0.2 - 11 / 30) ** 2 + (0.5 - 11 / 30) ** 2) ** 0.5 / 3 ** 0.5)
    assert f"| mean | 0.200 | {(0.6 + 0.3 + 0.8) / 3:.3f} | {11 / 30:.3f} |" in text
    assert "--seeds 0,1,2" in text  # the table names the command that reproduces it


def test_a_seed_without_an_evaluation_shows_a_dash_and_is_left_out_of_the_stats():
    partial = {"seed": 3, "before": {"all": {"reward": 0.2}}, "after": {}}
    text, data = seeds_table([_summary(0, 0.2, 0.6), partial], "c.yaml")
    assert "| 3 | 0.200 | - | - | - | - |" in text
    assert data["columns"]["gain"] == [pytest.approx(0.4)]


@pytest.mark.parametrize("seeds", ["0,0", "a,b", ","])
def test_bad_seed_lists_are_refused(seeds, capsys):
    assert cli.main(["demo", "--config", "configs/demo.yaml", "--seeds", seeds]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_each_seed_trains_in_its_own_directory_when_the_user_sets_trainer_run_dir(tmp_path):
    from megatron_arpo.config import load_config
    from megatron_arpo.demo import Demo

    base = tmp_path / "cmp"
    user = [f"trainer.run_dir={base}", "trainer.total_steps=3"]
    dirs = set()
    for seed in (0, 1):
        demo = Demo("configs/demo.yaml", user, tmp_path / f"cmp-seed{seed}", seed, 0.5)
        cfg = load_config("configs/demo.yaml", demo.path_overrides())
        assert cfg.run_dir == tmp_path / f"cmp-seed{seed}" and cfg.trainer.total_steps == 3
        assert cfg.model.hf_checkpoint == str(tmp_path / f"cmp-seed{seed}" / "sft" / "hf")
        dirs.add(cfg.run_dir)
    assert len(dirs) == 2
