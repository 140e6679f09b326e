"""Fused PyTorch twins: jagged ops run through ``torch.nn.functional.scaled_dot_product_attention`` on one padded copy."""
