"""gemline stage: features."""
