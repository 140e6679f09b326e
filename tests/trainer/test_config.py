"""[trainer.gem]: GemConfig's checks, loading from TOML and --set, the flat trainer.gem_* keys it
replaced, and the trip through trainer.launch.config_overrides (how torchrun ranks get the config)."""

from __future__ import annotations

import pytest

from gemline.config import load_config, parse_set_flags
from trainer.config import GemConfig, TrainerConfig


@pytest.mark.parametrize(
    ("message", "kwargs"),
    [
        ("trainer.gem.layers must be >= 1, got 0", {"layers": 0}),
        ("trainer.gem.heads must be >= 1, got 0", {"heads": 0}),
        ("trainer.gem.max_sequence_len must be >= 1, got 0", {"max_sequence_len": 0}),
        ("trainer.gem.dense_tokens must be >= 1, got 0", {"dense_tokens": 0}),
        ("trainer.gem.fm_outputs must be >= 1, got 0", {"fm_outputs": 0}),
        ("trainer.gem.fm_rank must be >= 1, got -2", {"fm_rank": -2}),
        ("trainer.gem.lcb_outputs must be >= 0, got -1", {"lcb_outputs": -1}),
        (r"trainer.gem.pyramid_ratio must be in \(0, 1\], got 0.0", {"pyramid_ratio": 0.0}),
        (r"trainer.gem.pyramid_ratio must be in \(0, 1\], got 1.5", {"pyramid_ratio": 1.5}),
        (r"trainer.gem.kernel_backend must be one of \('reference', 'triton'\), got 'cuda'", {"kernel_backend": "cuda"}),
    ],
)
def test_gem_config_rejects_bad_values(message, kwargs):
    with pytest.raises(ValueError, match=f"^{message}$"):
        GemConfig(**kwargs)


def test_gem_config_edges_that_are_valid():
    assert GemConfig(lcb_outputs=0, pyramid_ratio=1.0).lcb_outputs == 0  # no LCB; no pyramid
    with pytest.raises(ValueError, match=r"^trainer.embedding_dim=16 must be divisible by trainer.gem.heads=3$"):
        TrainerConfig(embedding_dim=16, gem=GemConfig(heads=3))
    assert TrainerConfig(embedding_dim=15, gem=GemConfig(heads=3)).gem.heads == 3


def test_gem_section_loads_from_toml_and_set_wins(tmp_path):
    path = tmp_path / "gemline.toml"
    path.write_text('[trainer]\nembedding_dim = 12\n[trainer.gem]\nlayers = 3\nheads = 3\npyramid_ratio = 0.25\n'
                    'kernel_backend = "triton"\n')
    config = load_config(path, parse_set_flags(["trainer.gem.layers=4", "trainer.gem.fm_rank=2"]))
    assert config.trainer.embedding_dim == 12
    assert config.trainer.gem == GemConfig(layers=4, heads=3, pyramid_ratio=0.25, fm_rank=2, kernel_backend="triton")
    assert load_config().trainer.gem == GemConfig()  # no [trainer.gem]: the defaults


@pytest.mark.parametrize(("old", "new"), sorted(TrainerConfig.MOVED_KEYS.items()))
def test_a_flat_gem_key_names_its_new_key(tmp_path, old, new):
    leaf = new.split(".")[-1]
    expected = (f"config key 'trainer.{old}' moved to 'trainer.{new}': write {leaf} = ... under [trainer.gem] in the "
                f"TOML, or --set trainer.{new}=...")
    with pytest.raises(ValueError) as by_flag:
        load_config(overrides={f"trainer.{old}": "2"})
    assert str(by_flag.value) == expected
    path = tmp_path / "old.toml"
    path.write_text(f"[trainer]\n{old} = 2\n")
    with pytest.raises(ValueError) as by_file:
        load_config(path)
    assert str(by_file.value) == expected


def test_moved_keys_cover_every_gem_field():
    """TrainerConfig.MOVED_KEYS maps a flat key onto each GemConfig field that had one (every field before issue 18
    added the preset and its switches, which never were flat keys), and onto no other name."""
    from dataclasses import fields

    before_issue_18 = {"layers", "heads", "pyramid_ratio", "max_sequence_len", "dense_tokens", "fm_outputs", "lcb_outputs",
                       "fm_rank", "kernel_backend"}
    assert before_issue_18 <= {f.name for f in fields(GemConfig)}
    assert sorted(new.removeprefix("gem.") for new in TrainerConfig.MOVED_KEYS.values()) == sorted(before_issue_18)


def test_a_bad_kernel_backend_names_the_key_and_the_choices():
    with pytest.raises(ValueError) as error:
        load_config(overrides={"trainer.gem.kernel_backend": "cuda"})
    assert str(error.value) == "trainer.gem.kernel_backend: expected one of ('reference', 'triton'), got 'cuda'"


def test_nested_sections_travel_to_torchrun_ranks_as_set_flags():
    """trainer.launch ships the config as --set flags; the nested sections must come back equal."""
    from trainer.launch import config_overrides

    config = load_config(overrides={
        "trainer.gem.layers": "3", "trainer.gem.pyramid_ratio": "0.25", "trainer.gem.kernel_backend": "triton",
        "build.hygiene.compact_min_files": "40", "build.shard_step": "reference",
        "ingest.streaming.commit_interval_s": "2.5", "ingest.streaming.max_batches": "7",
    })
    flags = config_overrides(config)
    assert sorted(flags) == sorted([
        "trainer.gem.layers=3", "trainer.gem.pyramid_ratio=0.25", "trainer.gem.kernel_backend=triton",
        "build.hygiene.compact_min_files=40", "build.shard_step=reference",
        "ingest.streaming.commit_interval_s=2.5", "ingest.streaming.max_batches=7",
    ])
    assert load_config(overrides=parse_set_flags(flags)) == config
