"""gemline: Kafka -> Beam -> Delta Lake -> PyTorch/TorchRec, modeled on Meta's GEM.

Stages (one package each) talk through Delta tables under one lake root:

    ingest/      Kafka topic  -> events, dead_letter
    sequences/   events       -> sequences, examples (labels + point-in-time sequence)
    features/    events       -> features/user, features/item
    validation/  any table    -> _quality/<table>/<version>/, quality (gate)
    trainer/     examples     -> _checkpoints/, _runs/
    kernels/     jagged ops used by the trainer's sequence encoder

This package holds only what every stage shares: typed config, lake paths and the CLI.
"""

__version__ = "0.1.0"
