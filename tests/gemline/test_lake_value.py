"""gemline.lake.Lake: one value for the root and its storage options, accepted wherever a root is,
and never showing a secret in a repr or a message."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from gemline.config import GemlineConfig, load_config
from gemline.lake import Lake, as_lake, commit_once, committed_version, lake_fs, open_table, read_table, redact

SECRET = "testing-secret-zzz"
REMOTE = {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "AKIA-id", "AWS_SECRET_ACCESS_KEY": SECRET,
          "AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_ALLOW_HTTP": "true"}


@pytest.mark.parametrize(("options", "expected"), [
    (None, None),
    ({}, {}),
    ({"AWS_REGION": "eu"}, {"AWS_REGION": "eu"}),
    ({"AWS_SECRET_ACCESS_KEY": SECRET, "aws_session_token": "t", "db_password": "p", "AWS_ACCESS_KEY_ID": "i"},
     {"AWS_SECRET_ACCESS_KEY": "***", "aws_session_token": "***", "db_password": "***", "AWS_ACCESS_KEY_ID": "***"}),
    ({"AWS_ALLOW_HTTP": True, "GOOGLE_SERVICE_ACCOUNT_KEY": 7}, {"AWS_ALLOW_HTTP": True, "GOOGLE_SERVICE_ACCOUNT_KEY": "***"}),
    ({"AWS_ENDPOINT_URL": "http://user:pass@host:9000/x", "PROXY": "https://tok@proxy", "AWS_REGION": "a@b"},
     {"AWS_ENDPOINT_URL": "http://***@host:9000/x", "PROXY": "https://***@proxy", "AWS_REGION": "a@b"}),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}),
])
def test_redact(options, expected):
    assert redact(options) == expected


def test_lake_value_hides_secrets_and_compares_by_content():
    options = dict(REMOTE)
    lake = Lake("s3://b/p", options)
    assert SECRET not in repr(lake) and "'AWS_REGION': 'us-east-1'" in repr(lake)
    assert str(lake) == "s3://b/p" and f"{lake}" == "s3://b/p"
    options["AWS_REGION"] = "changed"  # the Lake holds its own read-only copy
    assert lake.storage_options["AWS_REGION"] == "us-east-1"
    with pytest.raises(TypeError):
        lake.storage_options["AWS_REGION"] = "x"  # type: ignore[index]
    assert lake == Lake("s3://b/p", dict(REMOTE)) and hash(lake) == hash(Lake("s3://b/p", dict(reversed(REMOTE.items()))))
    assert lake != Lake("s3://b/p", None) and Lake("/l") == Lake("/l", None)
    assert lake.is_remote and lake.uri("features/user") == "s3://b/p/features/user"
    assert lake.delta_options == REMOTE
    assert isinstance(lake.fs, pafs.S3FileSystem) and lake.fs_path("_checkpoints/step-1/") == "b/p/_checkpoints/step-1"
    assert lake.fs_path() == "b/p"


def test_local_lake(tmp_path):
    lake = Lake(str(tmp_path), {"AWS_REGION": "x"})
    assert not lake.is_remote and lake.delta_options is None  # options are ignored for a local root
    assert lake.uri("events") == str(tmp_path / "events")
    assert isinstance(lake.fs, pafs.LocalFileSystem) and lake.fs_path("a/b") == f"{tmp_path.absolute()}/a/b"
    assert as_lake(tmp_path) == Lake(str(tmp_path)) and as_lake(lake) is lake
    assert lake_fs(lake)[1] == lake.fs_path() == str(tmp_path.absolute())


def test_module_functions_take_a_lake(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    data = pa.table({"x": [1, 2]})
    assert commit_once(lake, "t", data, app_id="a", version=0)
    assert not commit_once(lake, "t", data, app_id="a", version=0)  # already committed
    assert committed_version(lake, "t", "a") == 0
    assert read_table(lake, "t")["x"].to_pylist() == [1, 2] == read_table(str(tmp_path / "lake"), "t")["x"].to_pylist()
    assert open_table(lake, "t").version() == 0


BAD_LAKES = [
    (lambda: Lake(123), TypeError, "Lake.root: expected a str"),  # type: ignore[arg-type]
    (lambda: Lake("s3://b", {"AWS_ALLOW_HTTP": True, "AWS_SECRET_ACCESS_KEY": 5}), TypeError,
     "expected str keys and str values"),
    (lambda: as_lake(Lake("s3://b", {"AWS_SECRET_ACCESS_KEY": SECRET}), {"AWS_REGION": "x"}), TypeError,
     "pass the options in the Lake only"),
    (lambda: open_table(Lake("s3://b", {"AWS_SECRET_ACCESS_KEY": SECRET}), "t", storage_options={"A": "b"}),
     TypeError, "pass the options in the Lake only"),
    (lambda: GemlineConfig(lake_storage_options=str({"AWS_SECRET_ACCESS_KEY": SECRET})), ValueError,
     "lake_storage_options: expected a table of strings"),
    (lambda: GemlineConfig(lake_storage_options={"AWS_SECRET_ACCESS_KEY": 12345}), ValueError,
     "lake_storage_options.AWS_SECRET_ACCESS_KEY: expected a string"),
]


@pytest.mark.parametrize(("make", "error", "message"), BAD_LAKES)
def test_errors_name_the_problem_but_not_the_secret(make, error, message):
    with pytest.raises(error, match=message) as info:
        make()
    assert SECRET not in str(info.value) and "12345" not in str(info.value)


def test_config_repr_and_for_config_hide_nothing_but_secrets():
    config = load_config(overrides={"lake": "s3://b/p", **{f"lake_storage_options.{k}": v for k, v in REMOTE.items()}})
    assert SECRET not in repr(config) and "lake='s3://b/p'" in repr(config) and "trainer=TrainerConfig(" in repr(config)
    assert Lake.for_config(config) == Lake("s3://b/p", REMOTE)
    assert Lake.for_config(GemlineConfig(lake="/l")).storage_options is None


def test_config_file_error_keeps_the_secret_out(tmp_path):
    """The message the CLI prints for the object-store --nproc bug of issue 17: no secret in it."""
    bad = tmp_path / "bad.toml"
    bad.write_text(f'lake = "s3://b/p"\nlake_storage_options = "AWS_SECRET_ACCESS_KEY={SECRET}"\n')
    with pytest.raises(ValueError, match="lake_storage_options: expected a table of strings") as info:
        load_config(bad)
    assert SECRET not in str(info.value)
