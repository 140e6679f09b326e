"""The errors a user can act on, each with the exit code the ``gemline`` command ends with.

The CLI (``gemline.cli.main``) turns a :class:`GemlineError` into one line, ``error: <message>``,
and exits with the error's :attr:`~GemlineError.exit_code`; any other exception is a bug and keeps
its traceback. So raise one of these only where the message tells the user what to do, and keep
``ValueError``/``RuntimeError`` for what a user cannot fix.

    exit  class                      raised when
    ----  -------------------------  ------------------------------------------------------------
    2     BadConfigError             a config file, ``--set`` or flag value a command cannot use
    2     MissingInputError          a table, file or topic a command reads does not exist
    2     CheckpointError            a checkpoint file is corrupt, tampered with or names no checkpoint
    2     BrokerUnreachableError     the Kafka cluster refuses connections or does not answer
    2     BrokerTimeoutError         a Kafka read made no progress within its timeout
    2     gemline.locks.LakeBusyError         another run of the stage holds the lake
    2     gemline.lake.CommitConflictError    another writer committed the same batch first
    2     TableSpecError             a write names a table the registry lacks, or breaks its spec
    2     ingest.kafka_source.TopicChangedError   the topic is not the one the lake read
    2     ClusterJobTimeoutError     a Dask job did not finish in time, or its cluster had no worker
    2     gemline.supervisor.StageGaveUpError   a stage of ``gemline run`` kept exiting 2
    3     gemline.gate.GateClosedError     the quality gate refuses a version a stage would read
    3     trainer.train.QuarantinedError      the quality gate refuses the examples version to train on
    4     RetentionGapError          Kafka retention deleted records before ingest read them
    130   (KeyboardInterrupt, SIGTERM: not an exception of this family; see gemline.cli)

Every class here is also a subclass of the builtin it replaced (``BadConfigError`` is a
``ValueError``, ``BrokerUnreachableError`` a ``ConnectionError``...), so ``except ValueError``
still catches a bad config. Each takes one message argument: Beam re-raises an exception from
inside a step as ``type(exn)(message + " [while running 'Step']")``, which keeps the class (and so
the exit code) only when that call works (``apache_beam.runners.common.DoFnRunner._reraise_augmented``).
"""

from __future__ import annotations

from typing import ClassVar


class GemlineError(Exception):
    """Base of the errors the ``gemline`` command reports in one line; ``exit_code`` is its exit status."""

    exit_code: ClassVar[int] = 2
    """Process exit status of ``gemline`` when a command ends with this error."""


class BadConfigError(GemlineError, ValueError):
    """A config file, ``--set`` override or flag value that a command cannot use (exit 2).

    Config sections raise it from ``__post_init__``; the message names the key, what was expected
    and what came.
    """


class MissingInputError(GemlineError, FileNotFoundError, ValueError):
    """A table, file or topic that a command reads does not exist (exit 2); the message says which
    stage or command creates it.

    A ``FileNotFoundError``, and a ``ValueError`` as well: the table checks of the build, the
    hygiene pass and the topic check raised ``ValueError`` before this family existed.
    """


class InputSchemaError(GemlineError, ValueError, TypeError):
    """A table a command reads lacks a column it needs, or the column has another type (exit 2): e.g. the
    continuous trainer resuming on an ``examples`` version whose build dropped or retyped a dense feature the
    model was trained with. The message names the column and what was expected.

    A ``ValueError`` for a missing column and a ``TypeError`` for a retyped one, as the readers raised before.
    """


class CheckpointError(GemlineError, ValueError):
    """A checkpoint a command would resume from cannot be used (exit 2): a ``state.pt`` (or students' file, DCP
    ``.metadata``) that does not load with ``torch.load(weights_only=True)`` -- corrupt, truncated, or holding an
    object that would run code when unpickled --, a ``meta.json`` that is not what the trainer writes, or a run
    pointer (``_continuous/CURRENT``) naming no complete checkpoint. The message names the file and how to go on
    (move the file away, point CURRENT elsewhere, or ``--from-scratch``).

    A ``ValueError``, as the loaders raised for a checkpoint that did not fit before this class existed.
    """


class BrokerUnreachableError(GemlineError, ConnectionError):
    """The Kafka cluster at ``--bootstrap`` refuses connections or does not answer (exit 2)."""


class BrokerTimeoutError(BrokerUnreachableError, TimeoutError):
    """A Kafka read made no progress within the client's timeout (exit 2): the broker went away,
    or the offsets were planned from another cluster."""


class RetentionGapError(GemlineError):
    """Kafka retention deleted records before ingest read them (exit 4). Ingest records the gap in
    the events commit and goes on; the command still ends with this error unless
    ``ingest.accept_gaps`` is set."""

    exit_code: ClassVar[int] = 4


class TableSpecError(GemlineError, ValueError):
    """A write that does not fit the table registry (``gemline.tables``): a table it does not list,
    data without the spec's partition columns, or a table in the lake partitioned otherwise than
    its spec (exit 2). The message names the table, what the spec says and what came."""


class ClusterJobTimeoutError(GemlineError, TimeoutError):
    """A Beam job on a Dask cluster (gemline.cluster) did not finish within ``--dask_job_timeout``, or the
    scheduler had no worker for ``--dask_no_worker_timeout`` (exit 2). The job's tasks are cancelled; every
    stage is restartable, so rerunning the command (on a healthy cluster) finishes it. A lost worker's tasks
    are rerun by Dask on the others; this bounds the cases where that never happens (a scheduler stuck on a
    dead worker's task, dask/distributed#3196, #6263)."""
