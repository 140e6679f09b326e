"""The GemlineError family: each class is also the builtin it replaced, survives Beam's re-raise and
pickling with its class, and the config loader raises the family's classes."""

import pickle

import pytest

from gemline.config import load_config
from gemline.errors import (
    BadConfigError,
    BrokerTimeoutError,
    BrokerUnreachableError,
    ClusterJobTimeoutError,
    GemlineError,
    MissingInputError,
    RetentionGapError,
)
from gemline.gate import GateClosedError, GateDecision
from gemline.lake import CommitConflictError
from gemline.locks import LakeBusyError
from ingest.kafka_source import TopicChangedError
from trainer.train import QuarantinedError

FAMILY = [  # (class, the builtins it is also, exit code)
    (BadConfigError, (ValueError,), 2),
    (MissingInputError, (FileNotFoundError, ValueError), 2),
    (BrokerUnreachableError, (ConnectionError,), 2),
    (BrokerTimeoutError, (ConnectionError, TimeoutError), 2),
    (ClusterJobTimeoutError, (TimeoutError,), 2),
    (LakeBusyError, (RuntimeError,), 2),
    (CommitConflictError, (RuntimeError,), 2),
    (TopicChangedError, (ValueError,), 2),
    (QuarantinedError, (RuntimeError,), 3),
    (RetentionGapError, (), 4),
]


@pytest.mark.parametrize("cls, builtins, code", FAMILY, ids=[c[0].__name__ for c in FAMILY])
def test_each_class_is_a_gemline_error_and_its_old_builtin(cls, builtins, code):
    exc = cls("what came, what was expected, what to do")
    assert isinstance(exc, GemlineError) and all(isinstance(exc, b) for b in builtins)
    assert exc.exit_code == code
    assert str(exc) == "what came, what was expected, what to do"
    # What Beam does to an exception raised inside a step: the same class, the step appended.
    again = type(exc)(exc.args[0] + " [while running 'S']", *exc.args[1:])
    assert type(again) is cls and str(again) == "what came, what was expected, what to do [while running 'S']"
    unpickled = pickle.loads(pickle.dumps(exc))
    assert type(unpickled) is cls and str(unpickled) == str(exc)


def test_the_gate_error_pickles_with_its_decision():
    refused = GateDecision("examples", 4, False, "examples@4 is quarantined: critical expectations failed: leakage")
    exc = GateClosedError(refused, "train")
    assert exc.exit_code == 3 and isinstance(exc, RuntimeError)
    unpickled = pickle.loads(pickle.dumps(exc))
    assert type(unpickled) is GateClosedError and unpickled.decision == refused and str(unpickled) == str(exc)


@pytest.mark.parametrize("overrides, cls, message", [
    ({"build.max_seq_len": "abc"}, BadConfigError, "build.max_seq_len: expected int, got 'abc'"),
    ({"build.max_seq_len": "0"}, BadConfigError, "build.max_seq_len must be >= 1, got 0"),
    ({"nosuch.key": "1"}, BadConfigError, "unknown config key 'nosuch'"),
    ({"trainer.batch_size": "0"}, BadConfigError, "trainer.batch_size must be >= 1, got 0"),
    ({"ingest.read_timeout_s": "0"}, BadConfigError, "ingest.read_timeout_s must be > 0, got 0.0"),
    ({"validation.drift_history_batches": "0"}, BadConfigError, "validation.drift_history_batches must be >= 1, got 0"),
    ({"generate.num_users": "0"}, BadConfigError, "generate.num_users must be >= 1, got 0"),
])
def test_bad_config_values_raise_bad_config_error(overrides, cls, message):
    with pytest.raises(cls, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_config_files_missing_or_not_toml(tmp_path):
    with pytest.raises(MissingInputError, match="no config file at '/nonexistent/g.toml'") as info:
        load_config("/nonexistent/g.toml")
    assert isinstance(info.value, FileNotFoundError)
    bad = tmp_path / "bad.toml"
    bad.write_text("[build\nmax_seq_len = 3\n")
    with pytest.raises(BadConfigError, match=f"config file '{bad}' is not valid TOML: "):
        load_config(bad)
    with pytest.raises(BadConfigError, match=f"--config '{tmp_path}' is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"\x80\x02\xff\xfe")
    with pytest.raises(BadConfigError, match=f"config file '{binary}' is not UTF-8 text"):
        load_config(binary)
