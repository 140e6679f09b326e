"""gemline stage: validation."""
