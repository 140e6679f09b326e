"""gemline stage: ingest."""
