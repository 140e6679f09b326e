"""gemline stage: trainer."""
