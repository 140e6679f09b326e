"""gemline stage: sequences."""
