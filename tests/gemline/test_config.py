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
        ({"trainer.learning_rate": "nan"}, "trainer.learning_rate: expected a finite float, got 'nan'"),
        ({"trainer.learning_rate": "-inf"}, "trainer.learning_rate: expected a finite float, got '-inf'"),
        ({"trainer.learning_rate": "1e400"}, "trainer.learning_rate: expected a finite float, got '1e400'"),
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
        ("[trainer]\nlearning_rate = nan\n", "trainer.learning_rate: expected a finite float, got nan"),
        ("[trainer]\nlearning_rate = inf\n", "trainer.learning_rate: expected a finite float, got inf"),
    ],
)
def test_a_toml_value_of_the_wrong_kind_names_the_key(tmp_path, toml, message):
    from gemline.errors import BadConfigError

    path = tmp_path / "gemline.toml"
    path.write_text(toml)
    with pytest.raises(BadConfigError, match=message):
        load_config(path)


def _cli_error(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``gemline quality release`` (a command that loads the config before touching the lake)."""
    from gemline.cli import main

    code = main(["quality", "release", "0", "--reason", "r", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("toml", "message"), [
    ('[trainer]\nbatch_size = "64"\n',
     "trainer.batch_size: expected int, got '64' (a string in the TOML: write it without quotes)"),
    ('[trainer]\ncompile = "yes"\n',
     "trainer.compile: expected a boolean (true or false), got 'yes' (a string in the TOML: write it without quotes)"),
    ('[trainer]\nlearning_rate = "0.01"\n',
     "trainer.learning_rate: expected float, got '0.01' (a string in the TOML: write it without quotes)"),
    ('[trainer]\nhidden_dims = ["64", "32"]\n',
     "trainer.hidden_dims: expected int, got '64' (a string in the TOML: write it without quotes)"),
    ('[ingest]\ndomains = "facebook,instagram"\n',
     "ingest.domains: expected a list, got 'facebook,instagram' (a string in the TOML: write a TOML list such as "
     "[64, 32])"),
])
def test_a_quoted_toml_value_is_refused_in_one_line(tmp_path, capsys, toml, message):
    path = tmp_path / "gemline.toml"
    path.write_text(toml)
    assert _cli_error(["--config", str(path), "--lake", str(tmp_path / "lake")], capsys) == (2, f"error: {message}\n")
    assert not (tmp_path / "lake").exists()


def test_flag_text_is_still_parsed_into_the_field_type():
    config = load_config(overrides={"trainer.batch_size": "64", "trainer.compile": "True", "trainer.learning_rate": "0.5",
                                    "trainer.hidden_dims": "128,16", "ingest.domains": "facebook,instagram"})
    assert (config.trainer.batch_size, config.trainer.compile, config.trainer.learning_rate) == (64, True, 0.5)
    assert (config.trainer.hidden_dims, config.ingest.domains) == ((128, 16), ("facebook", "instagram"))
    assert type(config.trainer.ids.mapping) is str and type(config.lake) is str


@pytest.mark.parametrize(("text", "expected"), [
    ("[128,16]", (128, 16)), ("[128, 16]", (128, 16)), ("[ 8 ]", (8,)), ("[]", ()), ("128, 16", (128, 16)), ("", ()),
])
def test_a_list_flag_takes_the_toml_list_syntax_too(text, expected):
    assert load_config(overrides={"trainer.gem.recency_branches": text}).trainer.gem.recency_branches == expected


def test_a_toml_list_flag_of_strings_needs_quotes(capsys):
    config = load_config(overrides={"ingest.domains": '["facebook", "instagram"]'})
    assert config.ingest.domains == ("facebook", "instagram")
    assert _cli_error(["--set", "ingest.domains=[facebook]"], capsys) == (
        2, "error: ingest.domains: expected a list as 64,32 or as TOML [64, 32] (strings quoted: [\"a\", \"b\"]), got "
           "'[facebook]'\n")
    assert _cli_error(["--set", "trainer.hidden_dims=[64,"], capsys)[0] == 2
    # Items of a TOML list keep their TOML types: a quoted number is refused as in a file.
    assert _cli_error(["--set", 'trainer.hidden_dims=["64"]'], capsys) == (
        2, "error: trainer.hidden_dims: expected int, got '64' (a string in the TOML: write it without quotes)\n")


@pytest.mark.parametrize("argv", [["--set", "lake="], ["--set", "lake= "], ["--lake", ""]])
def test_an_empty_lake_path_is_refused(capsys, argv):
    assert _cli_error(argv, capsys) == (
        2, "error: lake: expected a directory or an object-store URI, got '': pass --lake DIR or --set lake=DIR "
           "(default ./lake)\n")


@pytest.mark.parametrize("text", ["yes", "no", "on", "off", "1", "0", "", "t"])
def test_a_boolean_flag_is_true_or_false_only(capsys, text):
    assert _cli_error(["--set", f"trainer.compile={text}"], capsys) == (
        2, f"error: trainer.compile: expected a boolean (true or false), got {text!r}\n")
    assert load_config(overrides={"trainer.compile": "false"}).trainer.compile is False


def test_a_union_setting_is_refused_in_one_line_naming_every_choice(capsys):
    assert _cli_error(["--set", "build.shards=AUTO"], capsys) == (
        2, "error: build.shards: expected int or 'auto', got 'AUTO'\n")
    assert load_config(overrides={"build.shards": "auto"}).build.shards == "auto"
    assert load_config(overrides={"build.shards": "3"}).build.shards == 3


@pytest.mark.parametrize("command", [
    ["build"], ["train", "--once"], ["train"], ["ingest", "--bootstrap", "127.0.0.1:1"], ["report"],
    ["validate", "--table", "examples"], ["run", "--generate-rate", "10"]])
def test_a_lake_path_that_is_a_file_is_refused_by_every_command(tmp_path, capsys, command):
    from gemline.cli import main

    afile = tmp_path / "afile"
    afile.write_text("not a lake")
    assert main([*command, "--lake", str(afile)]) == 2
    assert capsys.readouterr().err == (f"error: --lake {afile} is a file, not a directory: pass --lake DIR (an existing "
                                       "lake, or a path to create one at) or --set lake=DIR\n")
    assert main([*command, "--lake", str(afile / "lake")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --lake {afile / 'lake'} is under a file ({afile}), not a directory")
    assert afile.read_text() == "not a lake"


def test_a_lake_directory_or_a_new_path_is_accepted(tmp_path):
    assert load_config(overrides={"lake": str(tmp_path)}).lake == str(tmp_path)
    assert load_config(overrides={"lake": str(tmp_path / "new" / "lake")}).lake == str(tmp_path / "new" / "lake")
    assert load_config(overrides={"lake": "s3://bucket/afile"}).lake == "s3://bucket/afile"


def test_stages_alone_take_the_settings_gemline_run_saved_with_the_lake(tmp_path):
    """Issue 20: `gemline run --set build.label_mode=defer` then `gemline build --follow --lake L` alone built with
    the default `wait`. The saved settings are the stage's defaults; flags still win, except a lake-bound one."""
    from gemline.config import load_stage_config, save_run_settings

    lake = tmp_path / "lake"
    run = load_config(None, {"lake": str(lake), "build.label_mode": "defer", "trainer.learning_rate": "0.005",
                             "ingest.domains": "facebook,instagram"})
    path = save_run_settings(run)
    assert path == lake / "_config" / "run.toml"
    said: list[str] = []
    alone = load_stage_config(None, {"lake": str(lake)}, say=said.append)
    assert alone.build.label_mode == "defer"
    assert alone.trainer.learning_rate == 0.005
    assert alone.ingest.domains == ("facebook", "instagram")
    assert alone == run
    assert len(said) == 1 and str(path) in said[0] and "build.label_mode=defer" in said[0]
    # A flag wins over a saved setting that does not bind the lake, and the same value of a bound one is fine.
    flagged = load_stage_config(None, {"lake": str(lake), "trainer.learning_rate": "0.01",
                                       "build.label_mode": "defer"})
    assert flagged.trainer.learning_rate == 0.01 and flagged.build.label_mode == "defer"
    with pytest.raises(ValueError, match=r"build.label_mode='wait' conflicts with build.label_mode='defer'"):
        load_stage_config(None, {"lake": str(lake), "build.label_mode": "wait"})
    toml = tmp_path / "gemline.toml"
    toml.write_text("[build]\npublish_delay_ms = 5000\n")
    with pytest.raises(ValueError, match=r"build.publish_delay_ms=5000 conflicts with build.publish_delay_ms=60000"):
        load_stage_config(toml, {"lake": str(lake)})
    # Another lake has no saved settings: the plain defaults, and nothing said.
    other: list[str] = []
    assert load_stage_config(None, {"lake": str(tmp_path / "other")}, say=other.append).build.label_mode == "wait"
    assert other == []


def test_run_settings_keep_no_secret_and_no_lake(tmp_path):
    from gemline.config import save_run_settings

    lake = tmp_path / "lake"
    config = load_config(None, {"lake": str(lake), "lake_storage_options.AWS_SECRET_ACCESS_KEY": "hunter2",
                                "build.max_seq_len": "64"})
    text = save_run_settings(config).read_text()
    assert "hunter2" not in text and str(lake) not in text
    assert 'set = ["build.max_seq_len=64"]' in text
