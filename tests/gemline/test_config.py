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
