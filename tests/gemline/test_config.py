"""Config tree: TOML + overrides, typed coercion, errors that name the key."""

import pytest

from gemline.config import load_config, parse_set_flags


def test_defaults_without_file():
    config = load_config()
    assert config.lake == "./lake"
    assert config.kafka.bootstrap is None
    assert config.build.max_seq_len == 256


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "gemline.toml"
    path.write_text('lake = "/data/lake"\n[kafka]\nbootstrap = "k:9092"\npartitions = 8\n[build]\nmax_seq_len = 64\n')
    config = load_config(path, {"build.max_seq_len": "128", "ingest.domains": "facebook,instagram"})
    assert config.lake == "/data/lake"
    assert config.kafka.bootstrap == "k:9092"
    assert config.kafka.partitions == 8
    assert config.build.max_seq_len == 128  # the flag wins over the file
    assert config.ingest.domains == ("facebook", "instagram")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"build.nope": "1"}, "unknown config key 'build.nope'"),
        ({"build.max_seq_len": "abc"}, "build.max_seq_len: expected int"),
        ({"build.max_seq_len": "0"}, "max_seq_len must be >= 1"),
        ({"kafka.client": "librdkafka"}, "kafka.client: expected one of"),
        ({"kafka.partitions": "0"}, "partitions must be >= 1"),
        ({"validation.min_label_rate": "0.9", "validation.max_label_rate": "0.1"}, "min_label_rate <= max_label_rate"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_set_flags_need_equals():
    assert parse_set_flags(["a.b=1", "c = x=y"]) == {"a.b": "1", "c": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_set_flags(["a.b"])


def test_nested_sections_load_from_toml_and_set(tmp_path):
    """[build.hygiene] and [ingest.streaming] are sections of the one tree, like [trainer.gem]."""
    from gemline.hygiene import HygieneConfig
    from ingest.config import StreamingConfig

    path = tmp_path / "gemline.toml"
    path.write_text("[build]\nshards = 2\n[build.hygiene]\ncheckpoint_every = 5\ncompact_min_files = 30\n"
                    "[ingest.streaming]\ncommit_interval_s = 0.5\n")
    config = load_config(path, {"build.hygiene.retention_hours": "24", "ingest.streaming.max_batches": "3"})
    assert config.build.shards == 2
    assert config.build.hygiene == HygieneConfig(checkpoint_every=5, retention_hours=24.0, compact_min_files=30)
    assert config.ingest.streaming == StreamingConfig(commit_interval_s=0.5, max_batches=3)
    defaults = load_config()
    assert (defaults.build.hygiene, defaults.ingest.streaming) == (HygieneConfig(), StreamingConfig())


@pytest.mark.parametrize(("old", "new"), [
    ("build.checkpoint_every", "build.hygiene.checkpoint_every"),
    ("build.vacuum_retention_hours", "build.hygiene.retention_hours"),
    ("build.compact_min_files", "build.hygiene.compact_min_files"),
])
def test_a_flat_hygiene_key_names_its_new_key(old, new):
    with pytest.raises(ValueError) as error:
        load_config(overrides={old: "20"})
    leaf = new.rsplit(".", 1)[1]
    assert str(error.value) == (f"config key {old!r} moved to {new!r}: write {leaf} = ... under [build.hygiene] in the "
                                f"TOML, or --set {new}=...")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"build.hygiene.compact_min_files": "1"}, "build.hygiene.compact_min_files must be >= 2 files, got 1"),
    ({"ingest.streaming.commit_interval_s": "0"}, "ingest.streaming.commit_interval_s: expected > 0 seconds, got 0.0"),
    ({"ingest.streaming.max_batches": "0"}, "ingest.streaming.max_batches: expected >= 1 or None, got 0"),
])
def test_bad_nested_values_name_the_full_key(overrides, message):
    with pytest.raises(ValueError) as error:
        load_config(overrides=overrides)
    assert str(error.value) == message


@pytest.mark.parametrize(("key", "value", "choices"), [
    ("build.shard_step", "polars", "('vectorized', 'reference')"),
    ("build.events_gate", "warn", "('required', 'off')"),
    ("trainer.gem.kernel_backend", "cuda", "('reference', 'triton')"),
    ("trainer.init_from", "best", "('scratch', 'latest')"),
    ("validation.drift_severity", "error", "('warning', 'critical')"),
])
def test_a_bad_mode_names_the_key_and_its_choices(key, value, choices):
    with pytest.raises(ValueError) as error:
        load_config(overrides={key: value})
    assert str(error.value) == f"{key}: expected one of {choices}, got {value!r}"


def test_shard_step_is_checked_without_the_loader_too():
    from sequences.config import BuildConfig

    with pytest.raises(ValueError, match=r"^build.shard_step must be one of \('vectorized', 'reference'\), got 'polars'$"):
        BuildConfig(shard_step="polars")
    assert BuildConfig().shard_step == "vectorized"


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[trainer]\ntask_weights = 1\n", "trainer.task_weights: expected a list, got 1"),
        ("lake = 5\n", "lake: expected str, got 5"),
        ("[trainer]\nseed = true\n", "trainer.seed: expected int, got True"),
        ("[trainer]\nlearning_rate = false\n", "trainer.learning_rate: expected float, got False"),
    ],
)
def test_a_toml_value_of_the_wrong_kind_names_the_key(tmp_path, toml, message):
    from gemline.errors import BadConfigError

    path = tmp_path / "gemline.toml"
    path.write_text(toml)
    with pytest.raises(BadConfigError, match=message):
        load_config(path)
